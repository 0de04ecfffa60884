"""Weights at their stored precision: int8 values with an f32 scale per block
of values along the contracting axis, and an f32 offset per block where the
format has one (Q4_K's mins). Numpy only: the loader builds these, the model
dequantises them inside its programs (``kvd.engine.model``).

A GGUF block format re-encodes exactly. Each stored block is a small integer
code times an f16 scale (times a 6- or 8-bit sub-scale), minus an f16 min
times a 6-bit sub-min for Q4_K; every one of those products fits in f32's
24-bit significand, so ``value * scale`` is exact and ``value * scale -
offset`` rounds once, as ggml's own dequantisation does. The f32 numbers
the model multiplies by are therefore bit for bit those of the f32 load.

A float checkpoint (a Hugging Face directory) has no stored blocks: it is
quantised here, symmetric absmax per block of ``HF_BLOCK`` values, which is
not exact; the loader reports the error it introduced.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

# ggml type ids (kvd.engine.gguf.TENSOR_TYPES) with their int8 re-encodings.
Q8_0, Q5_0, Q4_K, Q6_K = 8, 6, 12, 14
QUANTISED_TYPES = frozenset({Q8_0, Q5_0, Q4_K, Q6_K})
_QK_K = 256  # values in a K-quant super-block
HF_BLOCK = 32  # float checkpoints: values per absmax scale (llama.cpp's Q8_0 block)

# "auto": int8 on the CPU where it is exact (a GGUF whose matrices are all
# stored in block formats, like the embedded 270M), else the float load
# (always on an accelerator: kvd.engine.weights.gguf_quantization).
QUANTIZATIONS = ("auto", "none", "int8")


class QuantWeight(NamedTuple):
    """A matrix as int8 ``values`` (the matrix's own shape, any leading
    stacking axes), ``scale`` (the same shape with the block axis divided by
    the block size) and ``offset`` (like ``scale``, or None). The block axis
    is the one of the last two whose length the scale divides; the matrix is
    ``values * scale - offset`` with each scale repeated over its block.

    A NamedTuple, so JAX takes it as a pytree node without kvd registering it."""

    values: Any
    scale: Any
    offset: Any = None


def matrix_shape(weight: Any) -> tuple[int, ...]:
    """The shape of a matrix, stored as an array or as a ``QuantWeight``."""
    return tuple(int(d) for d in getattr(weight, "values", weight).shape)


def block_axis(weight: QuantWeight) -> int:
    """The axis (-2 or -1) the blocks run along: the one the scale is shorter on."""
    rows, cols = weight.values.shape[-2:]
    scale_rows, scale_cols = weight.scale.shape[-2:]
    if scale_rows == rows and cols % scale_cols == 0 and scale_cols < cols:
        return -1
    if scale_cols == cols and rows % scale_rows == 0 and scale_rows < rows:
        return -2
    raise ValueError(f"scale {weight.scale.shape} does not block values {weight.values.shape}")


def block_size(weight: QuantWeight) -> int:
    axis = block_axis(weight)
    return int(weight.values.shape[axis] // weight.scale.shape[axis])


def dequantize(weight: QuantWeight) -> np.ndarray[Any, np.dtype[np.float32]]:
    """The f32 matrix (numpy; the reference the model's programs must equal)."""
    axis, size = block_axis(weight), block_size(weight)
    scale = np.repeat(np.asarray(weight.scale, np.float32), size, axis=axis)
    out = np.asarray(weight.values).astype(np.float32) * scale
    if weight.offset is not None:
        out = out - np.repeat(np.asarray(weight.offset, np.float32), size, axis=axis)
    return out


def transposed(weight: QuantWeight) -> QuantWeight:
    """The same matrix transposed (its last two axes), blocks kept with their values."""

    def flip(array: Any) -> Any:
        return None if array is None else np.ascontiguousarray(np.swapaxes(array, -1, -2))

    return QuantWeight(flip(weight.values), flip(weight.scale), flip(weight.offset))


def regrouped(weight: QuantWeight, size: int, with_offset: bool) -> QuantWeight:
    """The same matrix in blocks of ``size`` (a divisor of its block size),
    with an offset array (zeros if it had none) when ``with_offset``: layers
    stacked into one array need one representation, and ``down`` mixes Q6_K
    (16-value blocks) with Q4_K (32-value blocks and mins) across layers."""
    axis, current = block_axis(weight), block_size(weight)
    if current % size:
        raise ValueError(f"blocks of {current} do not split into blocks of {size}")
    scale = np.repeat(weight.scale, current // size, axis=axis)
    offset = weight.offset
    if offset is not None:
        offset = np.repeat(offset, current // size, axis=axis)
    elif with_offset:
        offset = np.zeros_like(scale)
    if offset is not None and not with_offset:
        raise ValueError("a weight with offsets cannot drop them")
    return QuantWeight(weight.values, scale, offset)


def common_form(weights: list[QuantWeight]) -> tuple[int, bool]:
    """The coarsest block size and offset choice that every weight fits exactly."""
    size = int(np.gcd.reduce([block_size(w) for w in weights]))
    return size, any(w.offset is not None for w in weights)


def from_gguf(
    raw: np.ndarray[Any, np.dtype[np.uint8]], type_id: int, shape: tuple[int, int]
) -> QuantWeight:
    """A GGUF tensor's blocks (``raw``: its bytes) as int8 values in numpy
    shape ``shape`` (rows outermost), blocks along the last axis as stored."""
    decode = _DECODERS.get(type_id)
    if decode is None:
        raise ValueError(f"ggml type {type_id} has no int8 re-encoding")
    values, scale, offset = decode(np.ascontiguousarray(raw))
    rows = shape[0]
    return QuantWeight(
        values.reshape(shape),
        scale.reshape(rows, -1),
        None if offset is None else offset.reshape(rows, -1),
    )


_Decoded = tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any] | None]


def _f16(column: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return np.ascontiguousarray(column).view(np.float16).astype(np.float32)


def _q8_0(raw: np.ndarray[Any, Any]) -> _Decoded:
    blocks = raw.reshape(-1, 34)
    return blocks[:, 2:].view(np.int8), _f16(blocks[:, :2])[:, 0], None


def _q5_0(raw: np.ndarray[Any, Any]) -> _Decoded:
    blocks = raw.reshape(-1, 22)
    high_bits = np.ascontiguousarray(blocks[:, 2:6]).view(np.uint32)  # bit j: value j's 5th bit
    high = ((high_bits >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    nibbles = blocks[:, 6:]
    low = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=1)  # values 0..15, then 16..31
    values = (low | (high << 4)).astype(np.int8) - np.int8(16)
    return values, _f16(blocks[:, :2])[:, 0], None


def _q4_k(raw: np.ndarray[Any, Any]) -> _Decoded:
    blocks = raw.reshape(-1, 144)
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    packed = blocks[:, 4:16].reshape(-1, 3, 4)
    low6, mins6, extra = packed[:, 0], packed[:, 1], packed[:, 2]
    sub_scales = np.concatenate([low6 & 0x3F, (extra & 0x0F) | ((low6 >> 2) & 0x30)], axis=1)
    sub_mins = np.concatenate([mins6 & 0x3F, (extra >> 4) | ((mins6 >> 2) & 0x30)], axis=1)
    nibbles = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    values = (nibbles & 0x0F).astype(np.int8).reshape(-1, _QK_K)
    # Both products are exact in f32 (11-bit f16 times a 6-bit code).
    return values, d * sub_scales.astype(np.float32), dmin * sub_mins.astype(np.float32)


def _q6_k(raw: np.ndarray[Any, Any]) -> _Decoded:
    blocks = raw.reshape(-1, 210)
    low_shifted = blocks[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(
        1, 1, 2, 1
    )
    low = (low_shifted & 0x0F).reshape(-1, 8, 32)
    high_shifted = blocks[:, 128:192].reshape(-1, 2, 1, 32) >> np.array(
        [0, 2, 4, 6], np.uint8
    ).reshape(1, 1, 4, 1)
    high = (high_shifted & 0x03).reshape(-1, 8, 32)
    values = ((low | (high << 4)).astype(np.int8) - np.int8(32)).reshape(-1, _QK_K)
    sub_scales = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8).astype(np.float32)
    return values, _f16(blocks[:, 208:210]) * sub_scales, None  # 16 scales of 16 values


_DECODERS = {Q8_0: _q8_0, Q5_0: _q5_0, Q4_K: _q4_k, Q6_K: _q6_k}


def quantize_absmax(matrix: np.ndarray[Any, Any], block: int = HF_BLOCK) -> QuantWeight:
    """Symmetric int8 per block of ``block`` values along the last axis (a
    float checkpoint's contracting axis, as stored): scale = absmax / 127."""
    matrix = np.asarray(matrix, np.float32)
    rows, cols = matrix.shape
    if cols % block:
        raise ValueError(f"a row of {cols} values does not split into blocks of {block}")
    blocks = matrix.reshape(rows, cols // block, block)
    scale = np.abs(blocks).max(axis=-1) / 127.0
    safe = np.where(scale == 0, 1.0, scale)
    values = np.clip(np.rint(blocks / safe[..., None]), -127, 127).astype(np.int8)
    return QuantWeight(values.reshape(rows, cols), scale.astype(np.float32), None)


def relative_error(matrix: np.ndarray[Any, Any], weight: QuantWeight) -> float:
    """RMS of the quantisation error over RMS of the matrix."""
    reference = np.asarray(matrix, np.float32)
    error = dequantize(weight) - reference
    denominator = float(np.sqrt(np.mean(reference.astype(np.float64) ** 2)))
    return float(np.sqrt(np.mean(error.astype(np.float64) ** 2))) / (denominator or 1.0)


def tree_bytes(tree: Any) -> int:
    """Bytes of every array in a parameter tree (dicts, lists, QuantWeights)."""
    if isinstance(tree, dict):
        return sum(tree_bytes(value) for value in tree.values())
    if isinstance(tree, list | tuple):
        return sum(tree_bytes(value) for value in tree)
    return 0 if tree is None else int(tree.nbytes)
