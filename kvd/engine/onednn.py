"""The model's matrix products on oneDNN's bf16 kernels (Intel AMX, or
AVX-512 BF16), for XLA:CPU, which has no fast path for either.

On a Xeon with AMX, XLA:CPU's f32 products run the 270M's output projection
(262,144 x 640) at 32 rows in ~73 ms, and its bf16 and int8 products are
slower still (~220 and ~430 ms); oneDNN's AMX kernel does the same product
in bf16 in ~19 ms. vLLM's CPU backend serves through the same library. The
cost is precision: activations and weights are rounded to bf16 (vLLM's CPU
numbers), where ``xla`` keeps f32 activations and the weights' exact values.
``model.matmul`` chooses.

How the products reach oneDNN: an XLA FFI custom call whose handler, in
this module, calls the library through ctypes (no build step: the library
comes from PyPI's ``onednn-cpu-gomp`` wheel). XLA passes the handler its
buffers in place, so a call costs the library's work and a few
microseconds. A ``jax.pure_callback`` cost 0.25 to 0.5 ms a call (operands
converted, results copied back: 33 MB of logits a step at 32 rows). A
layer's products that read the same input (q, k, v; gate, up) share one
call. The weights never cross the call: they live here, converted once at
load to oneDNN's blocked layout, and a program passes only their slot (an
int32 jit argument, so the layers share one trace). Programs with these
calls are cached on disk like any other: the handler is registered by name
before a program is traced.

The output projection is the tied embedding transposed (``[D, V]``),
multiplied like a layer's matrix: a row of logits per input row, the
layout the sampler reads. With the embedding as the left operand
(vocabulary-major logits) oneDNN's kernel took 22-24 ms at 1 to 32 rows
on an AMD EPYC with AVX-512 BF16, against 8-19 ms this way; a
vocabulary-major result descriptor falls to its reference kernel (13 s).

Small products keep XLA's: the output projection at one row, where XLA's
fused int8 product streams half of bf16's bytes (~5 ms inside a step,
against oneDNN's ~8.5), and the layers' products below ``LAYER_MIN_ROWS``
tokens. Measured in whole decode steps on that EPYC (context 464,
interleaved rounds): every product on oneDNN gave 39 tok/s at batch 1
against XLA's 62; with these thresholds, 192 against 179 at batch 8 and 359
against 332 at batch 32, and oneDNN's layers at 8 and 32 rows were within
the rounds' noise of XLA's. Prefill chunks (64 tokens and more) run on
oneDNN in full.
"""

from __future__ import annotations

import ctypes
import math
import os
import platform
import re
import sys
import threading
import weakref
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import numpy as np

from kvd.engine.wquant import QuantWeight, dequantize, matrix_shape

# Rows from which a product goes to oneDNN (see the module's docstring).
HEAD_MIN_ROWS = 2
LAYER_MIN_ROWS = 64

# oneDNN's C API constants (dnnl_types.h, oneDNN 3.x).
_CPU = 1
_IN_ORDER = 1
_BF16, _F32 = 2, 3
_ANY, _AB = 1, 3
_QUERY_WEIGHTS_MD = 131
_ARG_SRC, _ARG_DST, _ARG_WEIGHTS = 1, 17, 33
_ALLOCATE = ctypes.c_void_p(-1 & (2**64 - 1))
_Dims = ctypes.c_int64 * 12

_LIBRARY = "libdnnl.so.3"


class OnednnError(RuntimeError):
    """oneDNN cannot run here, or a call failed; the message says why."""


class _ExecArg(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_int), ("memory", ctypes.c_void_p)]


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _library_path() -> Path | None:
    """libdnnl from the onednn-cpu-gomp wheel (installed under the
    environment's ``lib/``), or None."""
    for prefix in (sys.prefix, sys.base_prefix):
        candidate = Path(prefix) / "lib" / _LIBRARY
        if candidate.exists():
            return candidate
    return None


def unavailable_reason(backend: str = "cpu", single_device: bool = True) -> str | None:
    """Why oneDNN's bf16 products cannot run here, or None when they can:
    for an engine on JAX's ``backend``, over one device (no tensor
    parallelism, one process) or not."""
    if backend != "cpu":
        return f"oneDNN products are for the CPU; this backend is {backend}"
    if not single_device:
        return "oneDNN products run on one CPU device, with unstacked layers"
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return "oneDNN products run on x86-64 Linux only"
    flags = _cpu_flags()
    if not flags & {"amx_bf16", "avx512_bf16"}:
        return "the CPU has neither AMX nor AVX-512 BF16 (bf16 would be emulated, slower than f32)"
    if _library_path() is None:
        return f"{_LIBRARY} not found under {sys.prefix}/lib (pip install onednn-cpu-gomp)"
    try:  # found is not loadable: it needs the system's libgomp, for one
        _runtime()
    except OnednnError as exc:
        return str(exc)
    return _ffi_problem()


def _ffi_problem() -> str | None:
    """Why the installed jax cannot make the products' calls as this module
    makes them, or None: it needs ``jax.ffi`` and the FFI's C API at major
    version 0, whose call frames the handler reads by offset."""
    import jax

    ffi = getattr(jax, "ffi", None)
    if ffi is None:
        return f"jax {jax.__version__} has no jax.ffi (oneDNN products need a newer jax)"
    header = Path(ffi.include_dir()) / "xla" / "ffi" / "api" / "c_api.h"
    try:
        found = re.search(r"#define XLA_FFI_API_MAJOR (\d+)", header.read_text())
    except OSError:
        found = None
    if found is None or found.group(1) != "0":
        return f"the XLA FFI of jax {jax.__version__} is not the C API 0.x this module reads"
    return None


class _Dnnl:
    """One oneDNN CPU engine and in-order stream for the process."""

    def __init__(self) -> None:
        path = _library_path()
        if path is None:
            raise OnednnError(unavailable_reason() or f"{_LIBRARY} not found")
        # OpenMP threads that spin after a product would take the cores
        # from XLA's threads, which run the rest of the step.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        try:
            self.lib = lib = ctypes.CDLL(str(path))
        except OSError as exc:
            raise OnednnError(f"cannot load {path}: {exc}") from None
        lib.dnnl_primitive_desc_query_md.restype = ctypes.c_void_p
        self.engine = ctypes.c_void_p()
        self._check(lib.dnnl_engine_create(ctypes.byref(self.engine), _CPU, ctypes.c_size_t(0)))
        self.stream = ctypes.c_void_p()
        self._check(lib.dnnl_stream_create(ctypes.byref(self.stream), self.engine, _IN_ORDER))
        # XLA may run two callbacks at once (independent products of a
        # step); oneDNN already uses every core for one.
        self.lock = threading.Lock()

    @staticmethod
    def _check(status: int, what: str = "call") -> None:
        if status != 0:
            raise OnednnError(f"oneDNN {what} failed with status {status}")

    def desc(self, dims: tuple[int, ...], dtype: int, tag: int) -> ctypes.c_void_p:
        md = ctypes.c_void_p()
        self._check(
            self.lib.dnnl_memory_desc_create_with_tag(
                ctypes.byref(md), len(dims), _Dims(*dims), dtype, tag
            ),
            "memory descriptor",
        )
        return md

    def memory(self, desc: ctypes.c_void_p, handle: ctypes.c_void_p) -> ctypes.c_void_p:
        mem = ctypes.c_void_p()
        self._check(
            self.lib.dnnl_memory_create(ctypes.byref(mem), desc, self.engine, handle), "memory"
        )
        return mem

    def _matmul_desc(
        self, src: ctypes.c_void_p, weights: ctypes.c_void_p, dst: ctypes.c_void_p
    ) -> ctypes.c_void_p:
        pd = ctypes.c_void_p()
        self._check(
            self.lib.dnnl_matmul_primitive_desc_create(
                ctypes.byref(pd), self.engine, src, weights, None, dst, None
            ),
            "matmul descriptor",
        )
        return pd

    def _primitive(self, pd: ctypes.c_void_p, what: str) -> ctypes.c_void_p:
        """The primitive of a descriptor, which it then destroys."""
        prim = ctypes.c_void_p()
        try:
            self._check(self.lib.dnnl_primitive_create(ctypes.byref(prim), pd), what)
        finally:
            self.lib.dnnl_primitive_desc_destroy(pd)
        return prim

    def matmul(
        self, src: ctypes.c_void_p, weights: ctypes.c_void_p, dst: ctypes.c_void_p
    ) -> ctypes.c_void_p:
        return self._primitive(self._matmul_desc(src, weights, dst), "matmul")

    def preferred_weights(
        self, src: ctypes.c_void_p, weights: ctypes.c_void_p, dst: ctypes.c_void_p
    ) -> ctypes.c_void_p:
        """The weights' layout oneDNN picks for a matmul whose weights are
        given as ``any`` (a descriptor of its own)."""
        pd = self._matmul_desc(src, weights, dst)
        chosen = ctypes.c_void_p()
        try:
            queried = self.lib.dnnl_primitive_desc_query_md(pd, _QUERY_WEIGHTS_MD, 0)
            self._check(
                self.lib.dnnl_memory_desc_clone(ctypes.byref(chosen), ctypes.c_void_p(queried)),
                "descriptor clone",
            )
        finally:
            self.lib.dnnl_primitive_desc_destroy(pd)
        return chosen

    def reorder(self, src: ctypes.c_void_p, dst: ctypes.c_void_p) -> ctypes.c_void_p:
        pd = ctypes.c_void_p()
        self._check(
            self.lib.dnnl_reorder_primitive_desc_create(
                ctypes.byref(pd), src, self.engine, dst, self.engine, None
            ),
            "reorder descriptor",
        )
        return self._primitive(pd, "reorder")

    def destroy(self, handles: list[tuple[str, ctypes.c_void_p]]) -> None:
        """``dnnl_<kind>_destroy`` for each (kind, handle): memory,
        memory_desc or primitive."""
        for kind, handle in handles:
            getattr(self.lib, f"dnnl_{kind}_destroy")(handle)

    def destroy_with(self, owner: object, handles: list[tuple[str, ctypes.c_void_p]]) -> None:
        """Destroy ``handles`` when ``owner`` is collected: a released
        matrix gives back its native copy, not only its Python object."""
        weakref.finalize(owner, self.destroy, handles)

    def execute(self, prim: ctypes.c_void_p, args: list[tuple[int, ctypes.c_void_p]]) -> None:
        packed = (_ExecArg * len(args))(*(_ExecArg(kind, mem) for kind, mem in args))
        self._check(
            self.lib.dnnl_primitive_execute(prim, self.stream, len(args), packed), "execute"
        )
        self._check(self.lib.dnnl_stream_wait(self.stream), "stream wait")


_dnnl: _Dnnl | None = None
_dnnl_lock = threading.Lock()


def _runtime() -> _Dnnl:
    global _dnnl
    with _dnnl_lock:
        if _dnnl is None:
            _dnnl = _Dnnl()
        return _dnnl


class _Operand:
    """A plain row-major array oneDNN reads or writes in place: its
    descriptor and a memory object whose handle is re-pointed per call."""

    def __init__(self, dnnl: _Dnnl, dims: tuple[int, ...], dtype: int) -> None:
        self.desc = dnnl.desc(dims, dtype, _AB)
        self.memory = dnnl.memory(self.desc, ctypes.c_void_p(None))
        self._dnnl = dnnl
        dnnl.destroy_with(self, [("memory", self.memory), ("memory_desc", self.desc)])

    def at(self, array: np.ndarray[Any, Any]) -> ctypes.c_void_p:
        self._dnnl._check(
            self._dnnl.lib.dnnl_memory_set_data_handle(
                self.memory, ctypes.c_void_p(array.ctypes.data)
            ),
            "set handle",
        )
        return self.memory


class _HasMemory(Protocol):  # an _Operand, or a matrix with its weights' memory object
    memory: ctypes.c_void_p


def _exec_args(*args: tuple[int, _HasMemory]) -> ctypes.Array[_ExecArg]:
    return (_ExecArg * len(args))(*(_ExecArg(kind, owner.memory) for kind, owner in args))


class _Kernel(NamedTuple):
    """A matmul for one row count: its primitive, the operands whose
    handles each call re-points, and the execution's argument list."""

    primitive: ctypes.c_void_p
    src: _Operand
    dst: _Operand
    args: ctypes.Array[_ExecArg]

    def run(self, dnnl: _Dnnl, src: int, dst: int) -> None:
        lib = dnnl.lib
        check = dnnl._check
        check(lib.dnnl_memory_set_data_handle(self.src.memory, ctypes.c_void_p(src)), "set handle")
        check(lib.dnnl_memory_set_data_handle(self.dst.memory, ctypes.c_void_p(dst)), "set handle")
        check(
            lib.dnnl_primitive_execute(self.primitive, dnnl.stream, len(self.args), self.args),
            "execute",
        )
        check(lib.dnnl_stream_wait(dnnl.stream), "stream wait")


class PackedMatrix:
    """``x @ W`` for a weight ``W [K, N]``, kept in the blocked bf16 layout
    oneDNN's kernel reads (converted once, here)."""

    def __init__(self, weight: np.ndarray[Any, Any]) -> None:
        import ml_dtypes

        self._dnnl = dnnl = _runtime()
        self.k, self.n = (int(d) for d in weight.shape)
        plain = np.ascontiguousarray(weight, dtype=ml_dtypes.bfloat16)
        # The layout oneDNN prefers for these weights (at a mid-sized row count).
        asked = [
            dnnl.desc((64, self.k), _BF16, _AB),
            dnnl.desc((self.k, self.n), _BF16, _ANY),
            dnnl.desc((64, self.n), _F32, _AB),
        ]
        try:
            self.desc = dnnl.preferred_weights(*asked)
        finally:
            dnnl.destroy([("memory_desc", desc) for desc in asked])
        self.memory = dnnl.memory(self.desc, _ALLOCATE)
        dnnl.destroy_with(self, [("memory", self.memory), ("memory_desc", self.desc)])
        source = _Operand(dnnl, (self.k, self.n), _BF16)
        convert = dnnl.reorder(source.desc, self.desc)
        try:
            dnnl.execute(convert, [(_ARG_SRC, source.at(plain)), (_ARG_DST, self.memory)])
        finally:
            dnnl.destroy([("primitive", convert)])
        self._kernels: dict[int, _Kernel] = {}
        self.calls = 0

    def run(self, rows: int, src: int, dst: int) -> None:
        """``dst [rows, N]`` f32 = ``src [rows, K]`` bf16 times the weight,
        both given as addresses of row-major arrays."""
        kernel = self._kernels.get(rows)
        if kernel is None:
            dnnl = self._dnnl
            x = _Operand(dnnl, (rows, self.k), _BF16)
            out = _Operand(dnnl, (rows, self.n), _F32)
            prim = dnnl.matmul(x.desc, self.desc, out.desc)
            dnnl.destroy_with(self, [("primitive", prim)])
            kernel = self._kernels[rows] = _Kernel(
                prim, x, out, _exec_args((_ARG_SRC, x), (_ARG_WEIGHTS, self), (_ARG_DST, out))
            )
        kernel.run(self._dnnl, src, dst)

    def product(self, x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """``x [rows, K]`` (bf16, contiguous) times the weight: ``[rows, N]`` f32."""
        x = np.ascontiguousarray(x)
        out = np.empty((x.shape[0], self.n), np.float32)
        self.run(x.shape[0], x.ctypes.data, out.ctypes.data)
        return out


class _Registry:
    """The prepared matrices of every engine in the process, by slot."""

    def __init__(self) -> None:
        self._matrices: dict[int, PackedMatrix] = {}
        self._next = 0
        self._lock = threading.Lock()

    def add(self, matrix: PackedMatrix) -> int:
        with self._lock:
            slot = self._next
            self._next += 1
            self._matrices[slot] = matrix
            return slot

    def get(self, slot: int) -> PackedMatrix:
        return self._matrices[slot]

    def release(self, slots: list[int]) -> None:
        with self._lock:
            for slot in slots:
                self._matrices.pop(slot, None)


REGISTRY = _Registry()


class OnednnWeight(NamedTuple):
    """A matrix with its oneDNN form: ``weight`` as XLA multiplies it (an
    array or ``wquant.QuantWeight``, for the small products) and
    ``slot``, the int32 scalar that names its prepared form in ``REGISTRY``."""

    weight: Any
    slot: Any


def columns(weight: OnednnWeight) -> int:
    return matrix_shape(weight.weight)[-1]


# The products are an XLA FFI custom call (the typed API of
# jaxlib/include/xla/ffi/api/c_api.h) whose handler is a ctypes function:
# XLA hands it its operands' and results' buffers in place: 72 products of
# the 270M's layer shapes at 8 rows took 9.6 ms this way, 9.3 ms called
# directly and 18.7 ms as jax.pure_callbacks (each operand converted, each
# result copied back). Byte offsets below are the C structs' (API 0.x, see
# _ffi_problem) on 64-bit Linux.
_TARGET = "kvd_onednn_products"
_FRAME_EXTENSIONS, _FRAME_API, _FRAME_STAGE, _FRAME_ARGS, _FRAME_RETS = 8, 16, 32, 40, 80
_LIST_SIZE, _LIST_ITEMS = 16, 32  # XLA_FFI_Args and XLA_FFI_Rets
_BUFFER_DATA, _BUFFER_DIMS = 24, 40  # XLA_FFI_Buffer
_API_VERSION, _API_ERROR_CREATE = 16, 48  # XLA_FFI_Api
_EXTENSION_TYPE, _EXTENSION_NEXT, _METADATA = 8, 16, 24
_METADATA_VERSION, _METADATA_TRAITS, _METADATA_STATE = 8, 32, 40  # XLA_FFI_Metadata
_METADATA_EXTENSION, _EXECUTE, _INTERNAL = 1, 3, 13
_VERSION_SIZE = 24  # XLA_FFI_Api_Version


class _ErrorArgs(ctypes.Structure):  # XLA_FFI_Error_Create_Args
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", ctypes.c_void_p),
        ("message", ctypes.c_char_p),
        ("errc", ctypes.c_int),
    ]


_ErrorCreate = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.POINTER(_ErrorArgs))


def _word(address: int) -> int:
    return ctypes.c_void_p.from_address(address).value or 0


def _int64(address: int) -> int:
    return ctypes.c_int64.from_address(address).value


def _answer_metadata(frame: int) -> bool:
    """Fill the metadata XLA asks of a handler at registration (its FFI
    version: the one XLA passes; no traits, no state); False when this is
    not that query."""
    extension = _word(frame + _FRAME_EXTENSIONS)
    while extension:
        if ctypes.c_int.from_address(extension + _EXTENSION_TYPE).value == _METADATA_EXTENSION:
            metadata = _word(extension + _METADATA)
            api_version = _word(frame + _FRAME_API) + _API_VERSION
            ctypes.memmove(metadata + _METADATA_VERSION, api_version, _VERSION_SIZE)
            ctypes.c_uint32.from_address(metadata + _METADATA_TRAITS).value = 0
            ctypes.c_int64.from_address(metadata + _METADATA_STATE).value = 0
            return True
        extension = _word(extension + _EXTENSION_NEXT)
    return False


def _error(frame: int, message: str) -> int | None:
    create = _ErrorCreate(_word(_word(frame + _FRAME_API) + _API_ERROR_CREATE))
    args = _ErrorArgs(ctypes.sizeof(_ErrorArgs), None, message.encode(), _INTERNAL)
    error: int | None = create(ctypes.byref(args))
    return error


def _products(frame: int) -> int | None:
    """The handler: operand 0 is the products' shared input, each further
    operand an int32 slot; result i is the product with slot i."""
    try:
        if _answer_metadata(frame):
            return None
        if ctypes.c_int.from_address(frame + _FRAME_STAGE).value != _EXECUTE:
            return None
        operands = _word(frame + _FRAME_ARGS + _LIST_ITEMS)
        count = _int64(frame + _FRAME_ARGS + _LIST_SIZE)
        results = _word(frame + _FRAME_RETS + _LIST_ITEMS)
        x = _word(operands)
        src, rows = _word(x + _BUFFER_DATA), _int64(_word(x + _BUFFER_DIMS))
        runtime = _runtime()
        with runtime.lock:
            for i in range(1, count):
                slot = _word(operands + 8 * i) + _BUFFER_DATA
                matrix = REGISTRY.get(ctypes.c_int32.from_address(_word(slot)).value)
                matrix.calls += 1
                dst = _word(_word(results + 8 * (i - 1)) + _BUFFER_DATA)
                matrix.run(rows, src, dst)
        return None
    except BaseException as exc:  # noqa: BLE001 - XLA must hear of any failure
        return _error(frame, f"oneDNN product failed: {exc!r}")


_HANDLER = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)(_products)
_registered = False


def _call(operand: Any, slots: list[Any], shapes: list[Any]) -> list[Any]:
    import jax

    global _registered
    with _dnnl_lock:
        if not _registered:
            jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(_HANDLER), platform="cpu")
            _registered = True
    return list(jax.ffi.ffi_call(_TARGET, shapes)(operand, *slots))


def dense_many(x: Any, weights: list[OnednnWeight]) -> list[Any]:
    """``x @ w`` for each of ``weights`` (all reading the same ``x [T, K]``)
    in one call; results in ``x``'s dtype."""
    import jax
    import jax.numpy as jnp

    shapes = [jax.ShapeDtypeStruct((x.shape[0], columns(w)), jnp.float32) for w in weights]
    outs = _call(x.astype(jnp.bfloat16), [w.slot for w in weights], shapes)
    return [out.astype(x.dtype) for out in outs]


def output_logits(embed: OnednnWeight, rows: Any) -> Any:
    """Logits ``[S, V]`` f32 for the normed rows ``[S, D]``."""
    import jax
    import jax.numpy as jnp

    vocab = matrix_shape(embed.weight)[0]
    shape = jax.ShapeDtypeStruct((rows.shape[0], vocab), jnp.float32)
    (out,) = _call(rows.astype(jnp.bfloat16), [embed.slot], [shape])
    return out


# The layers' matrices (model.py's names) and how each is stored: [in, out].
LAYER_MATRICES = ("q", "k", "v", "o", "gate", "up", "down")


def _as_float(weight: Any) -> np.ndarray[Any, Any]:
    if isinstance(weight, QuantWeight):
        return dequantize(QuantWeight(*(None if a is None else np.asarray(a) for a in weight)))
    return np.asarray(weight, np.float32)


def copy_bytes(params: dict[str, Any]) -> int:
    """Bytes of the bf16 copies ``prepare`` makes of ``params``' matrices."""
    layers = params["layers"]
    matrices = [layer[name] for layer in layers for name in LAYER_MATRICES if name in layer]
    return 2 * sum(math.prod(matrix_shape(m)) for m in [*matrices, params["embed"]])


def prepare(params: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
    """``params`` (per-layer, not stacked) with every layer matrix and the
    tied embedding wrapped as ``OnednnWeight``; and the slots taken (to
    ``REGISTRY.release`` when the engine goes)."""
    import jax.numpy as jnp

    slots: list[int] = []

    def wrap(weight: Any, matrix: PackedMatrix) -> OnednnWeight:
        slot = REGISTRY.add(matrix)
        slots.append(slot)
        return OnednnWeight(weight, jnp.asarray(slot, jnp.int32))

    layers = []
    try:
        for layer in params["layers"]:
            layer = dict(layer)
            for name in LAYER_MATRICES:
                if name in layer:
                    layer[name] = wrap(layer[name], PackedMatrix(_as_float(layer[name])))
            layers.append(layer)
        embed = params["embed"]
        embed = wrap(embed, PackedMatrix(np.ascontiguousarray(_as_float(embed).T)))
    except OnednnError:
        REGISTRY.release(slots)  # nothing kept of a preparation that failed
        raise
    return {**params, "layers": layers, "embed": embed}, slots
