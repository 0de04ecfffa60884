"""Ragged paged attention as a Pallas TPU kernel, over kvd's page layout.

The contract is the engine's one attention function
(``kvd.engine.attention.paged_attention``): a flattened batch of prefill
chunks and decode tokens, each token attending over its own sequence's pages
through the block table, under a causal mask and (sliding layers) a window
``pos - window < key <= pos``, with GQA, an optional logit soft-cap, and
softmax in f32.

Tiling
- Grid ``(T, W)``: one query token, one block of its block table. T is
  parallel; W is the reduction ("arbitrary") axis, innermost, so the
  online-softmax state (running max, denominator, accumulator per KV head)
  lives in VMEM scratch across the blocks of one token. Every KV head of a
  page block comes in one DMA (``[L, K, H]``: its last two dims are whole,
  as Mosaic requires), and the kernel loops over the K heads statically,
  each with its G = N/K query heads as one ``[G, H] x [H, L]`` matmul.
- The block table, each token's sequence row and position, and the window
  are scalar-prefetched into SMEM. The K and V BlockSpecs' index maps read
  the page id from the table, so Pallas's pipeline DMAs the next page
  while the current one is computed.
- Blocks a token cannot see (past its position, or wholly before its
  window) map to the null page 0 (always resident, never written) and their
  compute is skipped, so a short sequence in a wide table costs a DMA of the
  null page per skipped block, not a matmul.
- A table is a ring of ``ring`` entries (block b in entry ``b % ring``): the
  block held by entry w is the one in the token's visible range congruent to
  w, so a sliding layer's narrow table (its window plus a step) is walked as
  is. A token with a negative position is padding: it sees no block and its
  output is zero.

Limits
- One query token per grid row: prefill chunks are correct but do not share
  a page's DMA between their tokens (a production kernel tiles queries of a
  sequence together; this is the obvious next step).
- head_dim is the lane dimension: 128, 256 or 512 tile cleanly; block_size
  (the sublane dimension of a page block) should be a multiple of 8 (16 by
  default) for f32, 16 for bf16.
- The pool view is ``[P, places, 2, L, K, H]``; each (page, place, K-or-V)
  block is one ``[L, K, H]`` DMA. An int8 pool's rows are ``H + 4`` (values,
  then their f32 scale's bytes), dequantised in VMEM after the DMA by the
  ``dequantise`` function the caller passes (the row format is the engine's:
  kvd/engine/kvquant.py), so the DMA moves half the bytes of bf16. That row width is
  not a multiple of 128 lanes; a production TPU layout would keep the scales
  in lanes of their own (untested here: no TPU in this project's CI).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

# Stored rows ``[L, stored]`` and head_dim -> f32 values ``[L, head_dim]``.
Dequantise = Callable[[jax.Array, int], jax.Array]

NO_WINDOW = 2**30  # "window" of global layers: every earlier key is visible


def _kernel(
    # scalar prefetch (SMEM)
    tables_ref,  # [S, W] int32
    seq_ref,  # [T] int32
    pos_ref,  # [T] int32
    window_ref,  # [1] int32
    ring_ref,  # [1] int32
    place_ref,  # [1] int32 (read by the index maps)
    # inputs (VMEM blocks)
    q_ref,  # [K, G, H]
    k_ref,  # [L, K, H]
    v_ref,  # [L, K, H]
    # output
    o_ref,  # [K, G, H]
    # scratch
    m_ref,  # [K, G, 1] f32 running max
    l_ref,  # [K, G, 1] f32 running denominator
    acc_ref,  # [K, G, H] f32 running numerator
    *,
    scale: float,
    softcap: float | None,
    block_size: int,
    num_kv: int,
    head_dim: int,
    dequantise: Dequantise | None,
):
    t, w = pl.program_id(0), pl.program_id(1)
    position = pos_ref[t]
    window = window_ref[0]
    first_key, visible_block = _entry_block(w, position, window, ring_ref[0], block_size)

    @pl.when(w == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(visible_block)
    def _compute():
        for head in range(num_kv):  # static: K is small; each head's G queries together
            q = q_ref[head].astype(jnp.float32)  # [G, H]
            k = _rows(k_ref[:, head, :], head_dim, dequantise)  # [L, H]
            v = _rows(v_ref[:, head, :], head_dim, dequantise)
            scores = (
                jax.lax.dot_general(
                    q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
                )
                * scale
            )  # [G, L]
            if softcap is not None:
                scores = jnp.tanh(scores / softcap) * softcap
            keys = first_key + jax.lax.broadcasted_iota(jnp.int32, scores.shape, 1)
            visible = (keys <= position) & (keys > position - window)
            scores = jnp.where(visible, scores, -jnp.inf)
            m_prev = m_ref[head]
            m_next = jnp.maximum(m_prev, scores.max(axis=1, keepdims=True))
            # A visible block holds at least one visible key, so m_next is finite.
            correction = jnp.exp(m_prev - m_next)
            probs = jnp.exp(scores - m_next)
            l_ref[head] = l_ref[head] * correction + probs.sum(axis=1, keepdims=True)
            acc_ref[head] = acc_ref[head] * correction + jax.lax.dot_general(
                probs, v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
            )
            m_ref[head] = m_next

    @pl.when(w == pl.num_programs(1) - 1)
    def _finish():
        seen = l_ref[...] > 0  # padding saw nothing: its output is zero
        o_ref[...] = jnp.where(seen, acc_ref[...] / jnp.where(seen, l_ref[...], 1.0), 0.0).astype(
            o_ref.dtype
        )


def _entry_block(w, position, window, ring, block_size: int):
    """(first key of the block table entry ``w`` holds for a token at
    ``position``, whether the token sees any of that block)."""
    # lax.div and lax.rem truncate (Mosaic lowers them directly; ``//`` needs sign).
    lowest_block = jax.lax.div(jnp.maximum(position - window + 1, 0), block_size)
    offset = jax.lax.rem(w - lowest_block, ring)
    offset = jnp.where(offset < 0, offset + ring, offset)
    first_key = (lowest_block + offset) * block_size
    seen = (w < ring) & (first_key <= position) & (first_key + block_size - 1 > position - window)
    return first_key, seen


def _rows(stored: jax.Array, head_dim: int, dequantise: Dequantise | None) -> jax.Array:
    if dequantise is None:
        return stored.astype(jnp.float32)
    return dequantise(stored, head_dim).astype(jnp.float32)


def ragged_paged_attention(
    q: jax.Array,  # [T, N, H]
    view: jax.Array,  # [P, places, 2, L, K, H]
    place: jax.Array | int,
    tables: jax.Array,  # [S, W]
    seq_index: jax.Array,  # [T]
    positions: jax.Array,  # [T]
    *,
    scale: float,
    window: jax.Array | int | None,
    softcap: float | None,
    ring: jax.Array | int | None = None,
    dequantise: Dequantise | None = None,
    interpret: bool | object = False,
) -> jax.Array:
    """Same arguments and result as the engine's reference ``paged_attention``.

    A pool whose rows are wider than head_dim (int8 values and their scales)
    needs ``dequantise``, which turns its rows back into values."""
    num_tokens, num_heads, head_dim = q.shape
    _, _, _, block_size, num_kv, stored = view.shape
    if stored != head_dim and dequantise is None:
        raise ValueError(f"pool rows of {stored} for head_dim {head_dim} need a dequantise")
    group = num_heads // num_kv
    width = tables.shape[1]
    window_arr = jnp.full((1,), NO_WINDOW if window is None else window, jnp.int32)
    ring_arr = jnp.full((1,), width if ring is None else ring, jnp.int32)

    def q_map(t, w, tables, seqs, pos, win, ring, place):
        return (t, 0, 0, 0)

    def page(t, w, tables, seqs, pos, win, ring):
        _, seen = _entry_block(w, pos[t], win[0], ring[0], block_size)
        return jnp.where(seen, tables[seqs[t], w], 0)

    def k_map(t, w, tables, seqs, pos, win, ring, place):
        return (page(t, w, tables, seqs, pos, win, ring), place[0], 0, 0, 0, 0)

    def v_map(t, w, tables, seqs, pos, win, ring, place):
        return (page(t, w, tables, seqs, pos, win, ring), place[0], 1, 0, 0, 0)

    squeezed = pl.squeezed
    # The last two block dims (K, H) are whole array dims, as Mosaic requires.
    kv_block = (squeezed, squeezed, squeezed, block_size, num_kv, stored)
    q_block = (squeezed, num_kv, group, head_dim)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=6,
        grid=(num_tokens, width),
        in_specs=[
            pl.BlockSpec(q_block, q_map),
            pl.BlockSpec(kv_block, k_map),
            pl.BlockSpec(kv_block, v_map),
        ],
        out_specs=pl.BlockSpec(q_block, q_map),
        scratch_shapes=[
            pltpu.VMEM((num_kv, group, 1), jnp.float32),
            pltpu.VMEM((num_kv, group, 1), jnp.float32),
            pltpu.VMEM((num_kv, group, head_dim), jnp.float32),
        ],
    )
    kernel = functools.partial(
        _kernel,
        scale=scale,
        softcap=softcap,
        block_size=block_size,
        num_kv=num_kv,
        head_dim=head_dim,
        dequantise=dequantise,
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((num_tokens, num_kv, group, head_dim), q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
    )(
        tables.astype(jnp.int32),
        seq_index.astype(jnp.int32),
        positions.astype(jnp.int32),
        window_arr,
        ring_arr,
        jnp.full((1,), place, jnp.int32),
        q.reshape(num_tokens, num_kv, group, head_dim),
        view,
        view,
    )
    return out.reshape(num_tokens, num_heads, head_dim)
