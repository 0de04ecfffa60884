"""int8 K/V in the pool: each (token, KV head) row quantised with its own scales.

A row of ``H`` values is stored as ``H`` int8 values followed by one f32 scale
per ``group`` values, each scale bitcast to 4 int8 bytes: ``[..., H + 4H/group]``.
``group`` is the geometry's ``quant_group`` (256 for Gemma's head dims, so a
256-wide row has one scale and Gemma 4's 512-wide global rows two), and
``from_pool`` reads it back from the row width. The scales live inside the
page, so a page is still one row of the one pool array: swapping, the host
cache and tensor-parallel splits (by KV head) move scales with their values
and need no second array.

Why per token and not per block: the step writes a block one token at a time
(decodes), so a block-wide scale would have to be fixed by the block's first
token, or every earlier token requantised when a larger one arrives; and on
the real 270M the per-token error is the smaller one (``kvd bench int8``
measures both on the model's own K/V). The price is 4 bytes per 256 values
(1.6%).

Before quantising, K, V and Q are turned by a Hadamard rotation
(``rotation``), which evens out per-channel outliers and leaves attention
unchanged.

Symmetric absmax: ``scale = max|x| / 127``, ``q = round(x / scale)`` in
[-127, 127]; an all-zero group gets scale 1 (its values are all 0 either way).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvd.kv.geometry import SCALE_BYTES

QUANTISED = "int8"
SCALE_LANES = SCALE_BYTES[QUANTISED]  # int8 elements that hold one f32 scale
LEVELS = 127.0

# Attention gathers whole pages and masks the keys it must not see, so it also
# reads rows nobody wrote for this layer: the null page (padding of every page
# group writes there, each in its own row shape) and the unfilled tail of a
# page last used by a group of another shape. Their "scale" bytes are arbitrary
# and may read as NaN or inf, and masking multiplies by 0, which keeps NaN. A
# scale outside this bound is therefore read as 0: every dequantised value is
# finite, and a real scale (absmax / 127 of finite f32 values) always passes.
MAX_SCALE = float(jnp.finfo(jnp.float32).max) / (2 * LEVELS)


def storage_dtype(kv_dtype: str, backend: str) -> np.dtype[Any]:
    """The element type a pool of ``kv_dtype`` is kept in. XLA:CPU has no
    bf16 scatter or gather: it rewrote each layer's write and reads into f32
    ones between conversions of the whole pool (a gigabyte pool made a lone
    token's step take seconds). There a bf16 pool is kept as its 16-bit
    patterns (uint16), which it moves as they are; ``to_pool`` and
    ``from_pool`` convert the rows they touch."""
    if kv_dtype == "bfloat16" and backend == "cpu":
        return np.dtype(np.uint16)
    return np.dtype(jnp.dtype(kv_dtype))


def is_quantised(dtype: Any) -> bool:
    return bool(jnp.dtype(dtype) == jnp.int8)


def quantise(x: jax.Array, group: int | None = None) -> jax.Array:
    """``[..., H]`` float -> ``[..., H + 4H/group]`` int8 (values, then scales)."""
    head_dim = x.shape[-1]
    group = head_dim if group is None else group
    lead = x.shape[:-1]
    x32 = x.astype(jnp.float32).reshape(*lead, head_dim // group, group)
    absmax = jnp.max(jnp.abs(x32), axis=-1, keepdims=True)
    scale = jnp.where(absmax > 0, absmax / LEVELS, 1.0)
    values = jnp.clip(jnp.round(x32 / scale), -LEVELS, LEVELS).astype(jnp.int8)
    scale_bytes = jax.lax.bitcast_convert_type(scale[..., 0], jnp.int8)  # [..., n, 4]
    return jnp.concatenate(
        [values.reshape(*lead, head_dim), scale_bytes.reshape(*lead, -1)], axis=-1
    )


def dequantise(raw: jax.Array, head_dim: int) -> jax.Array:
    """``[..., H + 4H/group]`` int8 -> ``[..., H]`` f32."""
    groups = (raw.shape[-1] - head_dim) // SCALE_LANES
    lead = raw.shape[:-1]
    scale = jax.lax.bitcast_convert_type(
        raw[..., head_dim:].reshape(*lead, groups, SCALE_LANES), jnp.float32
    )  # [..., n]
    scale = jnp.where(jnp.abs(scale) <= MAX_SCALE, scale, 0.0)  # NaN fails the test too
    values = raw[..., :head_dim].astype(jnp.float32).reshape(*lead, groups, head_dim // groups)
    return (values * scale[..., None]).reshape(*lead, head_dim)


def to_pool(x: jax.Array, pool_dtype: object, width: int) -> jax.Array:
    """K or V rows ``[..., H]`` as a pool of ``pool_dtype`` with rows of ``width`` stores them."""
    # A pool of uint16 holds bf16 patterns (storage_dtype).
    if jnp.dtype(pool_dtype) == jnp.uint16:  # type: ignore[call-overload]
        return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)
    if not is_quantised(pool_dtype):
        return x.astype(pool_dtype)  # type: ignore[arg-type]
    head_dim = x.shape[-1]
    groups = (width - head_dim) // SCALE_LANES
    return quantise(x, head_dim // groups)


def from_pool(raw: jax.Array, head_dim: int, dtype: object) -> jax.Array:
    """Pool rows as ``dtype`` values of ``head_dim`` (dequantised if int8)."""
    if raw.dtype == jnp.uint16:  # bf16 patterns (storage_dtype)
        return jax.lax.bitcast_convert_type(raw, jnp.bfloat16).astype(dtype)  # type: ignore[arg-type]
    if is_quantised(raw.dtype):
        return dequantise(raw, head_dim).astype(dtype)  # type: ignore[arg-type]
    return raw.astype(dtype)  # type: ignore[arg-type]


def rotation(head_dim: int) -> np.ndarray[Any, Any] | None:
    """The orthonormal Hadamard matrix ``[H, H]`` K, V and Q are turned by
    before int8 (None when ``head_dim`` is not a power of two).

    A K/V row's absmax is set by its largest channels: the 270M's keys carry
    the k_norm weight (0 to 30 across channels), so the median row's absmax is
    7x its RMS and one scale leaves the small channels a few levels. A
    Hadamard rotation spreads every channel over all of them (QuaRot's
    observation), so rows look Gaussian (absmax about 3x RMS), and it is free
    to undo: it is symmetric and its own inverse, so ``(qR)(kR)^T = qk^T``
    and attention over ``vR`` gives ``out R``, turned back by one more
    ``R``. On the 270M's own K/V this cuts the relative RMS error of int8 from
    1.8% to 0.64% (keys) and 1.5% to 0.68% (values) (``kvd bench int8``). The
    price is four [H, H] matmuls per layer and token (about 12% more compute
    for the 270M), paid only by int8 pools.
    """
    if head_dim < 1 or head_dim & (head_dim - 1):
        return None
    matrix = np.ones((1, 1))
    while matrix.shape[0] < head_dim:  # Sylvester: H_2n = [[H, H], [H, -H]]
        matrix = np.block([[matrix, matrix], [matrix, -matrix]])
    return matrix / np.sqrt(head_dim)
