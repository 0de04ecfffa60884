"""A fast GGUF reader: the header by hand over mmap, tensors dequantised on demand.

``gguf.GGUFReader`` takes 20-35 s to open Gemma 3 270M because it builds a
numpy view per element of the 262,144-entry vocabulary arrays. This parser
reads the same header in well under a second: scalar arrays become one
``numpy.frombuffer`` each, and strings are decoded in one pass. Tensor data is
left in the mmap until asked for, then dequantised with the ``gguf`` package's
numpy kernels.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types
_SCALARS: dict[int, tuple[str, np.dtype[Any]]] = {
    0: ("<B", np.dtype("<u1")),
    1: ("<b", np.dtype("<i1")),
    2: ("<H", np.dtype("<u2")),
    3: ("<h", np.dtype("<i2")),
    4: ("<I", np.dtype("<u4")),
    5: ("<i", np.dtype("<i4")),
    6: ("<f", np.dtype("<f4")),
    7: ("<?", np.dtype("?")),
    10: ("<Q", np.dtype("<u8")),
    11: ("<q", np.dtype("<i8")),
    12: ("<d", np.dtype("<f8")),
}
_STRING, _ARRAY = 8, 9

# Tensor types kvd can dequantise (ggml type ids), and their block geometry:
# (elements per block, bytes per block).
TENSOR_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    30: ("BF16", 1, 2),
    8: ("Q8_0", 32, 34),
    6: ("Q5_0", 32, 22),
    12: ("Q4_K", 256, 144),
    14: ("Q6_K", 256, 210),
}


class GGUFError(ValueError):
    """The file is not a GGUF file kvd can read; the message says why."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (outermost first): GGUF's ne reversed
    type_id: int
    offset: int  # absolute offset of the data in the file
    nbytes: int


class GGUFFile:
    """An open GGUF file: ``metadata`` (key -> value) and ``tensors`` (name -> info)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as handle:
                self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        except FileNotFoundError:
            raise GGUFError(f"{self.path}: no such file") from None
        except ValueError:
            raise GGUFError(f"{self.path}: empty file, not GGUF") from None
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, TensorInfo] = {}
        try:
            self._parse()
        except (struct.error, IndexError, UnicodeDecodeError) as exc:
            raise GGUFError(f"{self.path}: truncated or corrupt GGUF header ({exc})") from None

    def close(self) -> None:
        self._map.close()

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- header ----------------------------------------------------------------

    def _parse(self) -> None:
        buf = self._map
        if buf[:4] != GGUF_MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (bad magic {bytes(buf[:4])!r})")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise GGUFError(f"{self.path}: unsupported GGUF version {version}")
        pos = 24
        for _ in range(n_kv):
            key, pos = self._string(pos)
            (value_type,) = struct.unpack_from("<I", buf, pos)
            self.metadata[key], pos = self._value(value_type, pos + 4)
        infos: list[tuple[str, tuple[int, ...], int, int]] = []
        for _ in range(n_tensors):
            name, pos = self._string(pos)
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            type_id, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            infos.append((name, tuple(reversed(dims)), type_id, offset))
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = -(-pos // alignment) * alignment
        for name, shape, type_id, offset in infos:
            if type_id not in TENSOR_TYPES:
                raise GGUFError(
                    f"{self.path}: tensor {name!r} has quantisation type {type_id}, "
                    f"which kvd cannot dequantise (supported: "
                    f"{', '.join(t[0] for t in TENSOR_TYPES.values())})"
                )
            _, per_block, block_bytes = TENSOR_TYPES[type_id]
            elements = int(np.prod(shape))
            if elements % per_block:
                raise GGUFError(f"{self.path}: tensor {name!r} is not whole blocks")
            nbytes = elements // per_block * block_bytes
            start = data_start + offset
            if start + nbytes > len(buf):
                raise GGUFError(
                    f"{self.path}: truncated: tensor {name!r} needs bytes up to "
                    f"{start + nbytes:,}, the file has {len(buf):,}"
                )
            self.tensors[name] = TensorInfo(name, shape, type_id, start, nbytes)

    def _string(self, pos: int) -> tuple[str, int]:
        (length,) = struct.unpack_from("<Q", self._map, pos)
        end = pos + 8 + length
        if end > len(self._map):
            raise IndexError("string runs past the end of the file")
        return self._map[pos + 8 : end].decode("utf-8"), end

    def _value(self, value_type: int, pos: int) -> tuple[Any, int]:
        if value_type in _SCALARS:
            fmt, dtype = _SCALARS[value_type]
            return struct.unpack_from(fmt, self._map, pos)[0], pos + dtype.itemsize
        if value_type == _STRING:
            return self._string(pos)
        if value_type == _ARRAY:
            item_type, count = struct.unpack_from("<IQ", self._map, pos)
            pos += 12
            if item_type in _SCALARS:
                dtype = _SCALARS[item_type][1]
                end = pos + count * dtype.itemsize
                if end > len(self._map):
                    raise IndexError("array runs past the end of the file")
                return np.frombuffer(self._map, dtype, count, pos).copy(), end
            items = []
            for _ in range(count):
                item, pos = self._value(item_type, pos)
                items.append(item)
            return items, pos
        raise GGUFError(f"{self.path}: unknown metadata value type {value_type}")

    # -- tensors ---------------------------------------------------------------

    def raw(self, name: str) -> np.ndarray[Any, np.dtype[np.uint8]]:
        info = self.tensor(name)
        return np.frombuffer(self._map, np.uint8, info.nbytes, info.offset)

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise GGUFError(f"{self.path}: no tensor named {name!r}") from None

    def load(self, name: str, dtype: np.dtype[Any] | type = np.float32) -> np.ndarray[Any, Any]:
        """Dequantise one tensor into ``dtype``, in numpy (outermost-first) shape."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        info = self.tensor(name)
        raw = self.raw(name)
        if info.type_id == 0:
            values = raw.view(np.float32)
        elif info.type_id == 1:
            values = raw.view(np.float16)
        else:
            values = dequantize(raw, GGMLQuantizationType(info.type_id))
        return np.asarray(values, dtype=dtype).reshape(info.shape)
