"""Products with int8 weights (``kvd.engine.wquant.QuantWeight``) inside the
model's programs, and the same products with float weights, so the model
reads one way whatever the weights' format.

Every form dequantises the weights exactly (the f32 numbers of the f32 load)
and only then multiplies: results differ from the f32 model's by summation
order alone. Which form is fastest was measured on XLA:CPU (2-core EPYC, jax
0.10) with ``scripts/bench_weight_products.py``; ``kvd bench weights``
measures the whole model:

- a layer's matrix (at most 2048 x 640 for the 270M): converted where it is
  multiplied (XLA writes it to a small f32 scratch, in cache, and runs its
  GEMM), each layer's conversion made to wait for that layer's input (see
  ``after``). Over 18 unrolled layers of the MLP's shape, two runs: 1.3x to
  2.2x f32's speed at 1 to 8 rows, 0.9x to 1.2x at 32 to 128 rows (the
  conversion's extra pass against a GEMM that no longer waits on memory);
- the output projection (262,144 x 640): fused at one row (2.5x faster than
  f32), but from two rows on XLA turns the fused form into a loop 6x slower
  than f32. There the matrix is dequantised one vocabulary chunk at a time
  into a small scratch (2,048 rows: 5 MB) and multiplied: 1.4x to 1.9x f32's
  speed at 2 to 8 rows, 0.87x at 32; its f32 form (0.67 GB) is never made.
  On an accelerator it is one product at every row count (``_fuses_any_rows``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from kvd.engine import onednn
from kvd.engine.onednn import OnednnWeight
from kvd.engine.wquant import QuantWeight, block_axis, block_size, transposed

# Rows up to which the output projection's conversion is fused into its product.
FUSED_ROWS = 1
# Vocabulary rows of the output projection dequantised at once past FUSED_ROWS
# (1,024 to 4,096 measured alike; 8,192 and more up to 2x slower).
HEAD_CHUNK = 2_048


def dequantized(weight: QuantWeight, dtype: Any) -> jax.Array:
    """The weight as a ``dtype`` matrix: ``values * scale - offset`` in f32
    (exact), then cast (as the float load casts its f32 numbers). Scales are
    broadcast over a blocked view of the values (a repeat would be a gather)."""
    axis, size = block_axis(weight), block_size(weight)
    shape = weight.values.shape
    expand: tuple[Any, ...]
    if axis == -1:  # [..., rows, blocks, size], a scale per (row, block)
        blocked = (*shape[:-1], shape[-1] // size, size)
        expand = (..., None)
    else:  # [..., blocks, size, cols], a scale per (block, column)
        blocked = (*shape[:-2], shape[-2] // size, size, shape[-1])
        expand = (..., slice(None), None, slice(None))
    out = weight.values.astype(jnp.float32).reshape(blocked) * weight.scale[expand]
    if weight.offset is not None:
        out = out - weight.offset[expand]
    return out.reshape(shape).astype(dtype)


class OneRowTwin(NamedTuple):
    """An int8 layer matrix as the model multiplies it (``weight``: a
    ``QuantWeight`` ``[in, out]``, or its ``OnednnWeight``) and transposed
    (``rows``, ``[out, in]``, its blocks along the rows), for products of
    one token.

    At one row XLA:CPU fuses the conversion of a matrix whose rows are the
    contracting axis into the product: each output is a dot product over a
    contiguous row of int8 values, read once, with no f32 scratch. In the
    ``[in, out]`` layout it cannot. ``scripts/bench_weight_products.py`` (18
    matrices of 640 x 2048, AMD EPYC, 2 cores): at one row 0.57 ms this way,
    1.77 ms converted then multiplied, 26 ms fused in ``[in, out]``; from two
    rows on the transposed fused form becomes a loop (27 ms), so larger
    steps keep ``weight``. In the dev config's engine a lone stream's token
    took 16.9 ms with the twins against 18.5 without (interleaved rounds,
    context 464, the same tokens). The twins cost the layers' int8 bytes
    again (123 MB for the 270M): the lone stream's step is the one no batch
    hides the host behind."""

    weight: Any
    rows: QuantWeight


def keeps_one_row_twins(backend: str, one_device: bool, scan_layers: bool) -> bool:
    """Whether an engine adds twins: on XLA:CPU, to per-layer weights on one
    device (stacked or split weights keep their one form)."""
    return backend == "cpu" and one_device and not scan_layers


def one_row_twin_bytes(params: dict[str, Any]) -> int:
    """What ``with_one_row_twins`` will add to ``params`` (unplaced or placed)."""
    return sum(
        a.nbytes
        for layer in params["layers"]
        for name in onednn.LAYER_MATRICES
        if isinstance(layer.get(name), QuantWeight)
        for a in layer[name]
        if a is not None
    )


def with_one_row_twins(params: dict[str, Any]) -> dict[str, Any]:
    """``params`` (per layer, not stacked, placed) with each int8 layer
    matrix, bare or in its ``OnednnWeight``, made a ``OneRowTwin``."""
    layers = []
    for layer in params["layers"]:
        layer = dict(layer)
        for name in onednn.LAYER_MATRICES:
            matrix = layer.get(name)
            quant = matrix.weight if isinstance(matrix, OnednnWeight) else matrix
            if not isinstance(quant, QuantWeight):
                continue
            rows = QuantWeight(*(None if a is None else jnp.asarray(a) for a in transposed(quant)))
            layer[name] = OneRowTwin(matrix, rows)
        layers.append(layer)
    return {**params, "layers": layers}


def dense(x: jax.Array, weight: Any) -> jax.Array:
    """``x @ weight`` for ``x [T, in]`` and a weight ``[in, out]``."""
    if isinstance(weight, OnednnWeight):
        return dense_group(x, [weight])[0]
    if isinstance(weight, OneRowTwin):
        if x.shape[0] == 1:
            return x @ dequantized(weight.rows, x.dtype).T
        return dense(x, weight.weight)
    if not isinstance(weight, QuantWeight):
        return x @ weight
    return x @ (dequantized(weight, x.dtype) * after(x))


def dense_group(x: jax.Array, weights: list[Any]) -> list[jax.Array]:
    """``x @ w`` for each of ``weights``: with oneDNN's matrices, one call
    into the library for all of them."""
    if any(isinstance(w, OneRowTwin) for w in weights):
        if x.shape[0] == 1:
            return [dense(x, w) for w in weights]
        weights = [w.weight if isinstance(w, OneRowTwin) else w for w in weights]
    if all(isinstance(w, OnednnWeight) for w in weights):
        if x.shape[0] >= onednn.LAYER_MIN_ROWS:
            return onednn.dense_many(x, weights)
        return [dense(x, w.weight) for w in weights]
    return [dense(x, w) for w in weights]


def after(x: jax.Array) -> jax.Array:
    """Exactly 1, computed from ``x``: a factor that makes a matrix's
    dequantisation wait for its input. Without it XLA:CPU, seeing that the
    conversions depend on the weights alone, runs every layer's at the start
    of the step into one scratch of the whole model's f32 form (94 MB for the
    270M's MLPs; a 2-token step took 156 ms where 35 was due), and
    ``optimization_barrier`` does not hold it (XLA:CPU drops barriers before
    it schedules). ``1 + 0 * x`` is exactly 1 for any finite ``x``; a
    non-finite ``x`` already makes the product NaN or infinite."""
    return 1.0 + x[0, 0] * 0.0


def embedding_rows(embed: Any, tokens: jax.Array, dtype: Any) -> jax.Array:
    """Rows ``tokens`` of the embedding ``[V, D]`` in ``dtype``."""
    if isinstance(embed, OnednnWeight):
        embed = embed.weight
    if not isinstance(embed, QuantWeight):
        return embed[tokens]
    return dequantized(_rows(embed, tokens), dtype)


def _rows(weight: QuantWeight, index: Any) -> QuantWeight:
    """Rows ``index`` of a weight blocked along its rows' last axis."""
    offset = None if weight.offset is None else weight.offset[index]
    return QuantWeight(weight.values[index], weight.scale[index], offset)


def _fuses_any_rows() -> bool:
    """Whether the output projection is one product at any row count. XLA:CPU
    turns the fused form into a slow loop past one row, hence the chunks
    there. On an accelerator the chunks' sequential loop of small products is
    the slow part: on an H200 (bf16 compute, ``kvd bench weights --dtype
    bfloat16``) int8 decode went from 0.63x to 0.88x bf16 weights' speed at
    batch 8 and from 0.72x to 0.94x at batch 32 with the head as one product."""
    return jax.default_backend() != "cpu"


def output_logits(embed: Any, last: jax.Array) -> jax.Array:
    """``last @ embed.T``: logits ``[S, V]`` for hidden states ``last [S, D]``
    from the tied embedding ``[V, D]`` (the output projection)."""
    if isinstance(embed, OnednnWeight):
        if last.shape[0] >= onednn.HEAD_MIN_ROWS:
            return onednn.output_logits(embed, last).astype(last.dtype)
        embed = embed.weight
    if not isinstance(embed, QuantWeight):
        return last @ embed.T
    if last.shape[0] <= FUSED_ROWS or _fuses_any_rows():
        return last @ dequantized(embed, last.dtype).T
    vocab = embed.values.shape[0]
    chunks = vocab // HEAD_CHUNK
    if chunks < 2:
        return last @ jax.lax.optimization_barrier(dequantized(embed, last.dtype)).T
    whole = chunks * HEAD_CHUNK

    def chunked(array: Any) -> Any:
        if array is None:
            return None
        return array[:whole].reshape(chunks, HEAD_CHUNK, *array.shape[1:])

    parts = QuantWeight(chunked(embed.values), chunked(embed.scale), chunked(embed.offset))

    # Each chunk's logits are written into their columns of one [S, V]
    # buffer, in place. The product itself is vocabulary-major, the
    # dequantised chunk its left operand: XLA:CPU's product with the chunk on
    # the right repacks it every call (8 rows: 27 ms against 20 for the
    # head). The barrier keeps XLA from folding the transpose back into the
    # product.
    def one_chunk(i: jax.Array, logits: jax.Array) -> jax.Array:
        part = QuantWeight(*(None if a is None else a[i] for a in parts))
        product = jax.lax.optimization_barrier(
            jax.lax.optimization_barrier(dequantized(part, last.dtype)) @ last.T
        )
        return jax.lax.dynamic_update_slice_in_dim(logits, product.T, i * HEAD_CHUNK, 1)

    logits = jax.lax.fori_loop(0, chunks, one_chunk, jnp.zeros((last.shape[0], vocab), last.dtype))
    if whole == vocab:
        return logits
    rest = _rows(embed, slice(whole, None))
    return logits.at[:, whole:].set(last @ dequantized(rest, last.dtype).T)
