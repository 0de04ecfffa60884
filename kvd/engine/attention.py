"""Paged attention for a ragged batch: the one function a TPU kernel replaces.

This is the pure-jnp reference (the CPU path). Each token attends over its own
sequence's pages, gathered through the block table, under a causal mask and,
on sliding layers, a window: a key at position j is visible to a query at
position i iff ``i - window < j <= i``. Softmax runs in f32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def paged_attention(
    q: jax.Array,  # [T, N, H] queries (RoPE applied)
    view: jax.Array,  # [P, slots, 2, L, K, H] the pool seen by this layer's page group
    slot: int,  # this layer's slot in the page
    tables: jax.Array,  # [S, W] block tables of this page group
    seq_index: jax.Array,  # [T] sequence row of each token
    positions: jax.Array,  # [T] position of each token
    *,
    scale: float,
    window: jax.Array | int | None,
    softcap: float | None,
) -> jax.Array:
    num_tokens, num_heads, head_dim = q.shape
    num_kv = view.shape[4]
    block_size = view.shape[3]
    pages = tables[seq_index]  # [T, W]
    keys = view[pages, slot, 0].reshape(num_tokens, -1, num_kv, head_dim)  # [T, W*L, K, H]
    values = view[pages, slot, 1].reshape(num_tokens, -1, num_kv, head_dim)
    grouped = q.reshape(num_tokens, num_kv, num_heads // num_kv, head_dim)  # [T, K, G, H]
    scores = jnp.einsum("tkgh,tlkh->tkgl", grouped, keys.astype(q.dtype))  # [T, K, G, W*L]
    scores = scores.astype(jnp.float32) * scale
    if softcap is not None:
        scores = jnp.tanh(scores / softcap) * softcap
    key_pos = jnp.arange(pages.shape[1] * block_size)[None, :]  # [1, W*L]
    query_pos = positions[:, None]  # [T, 1]
    visible = key_pos <= query_pos
    if window is not None:  # may be traced: global layers pass a huge window
        visible &= key_pos > query_pos - window
    scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    out = jnp.einsum("tkgl,tlkh->tkgh", probs, values.astype(q.dtype))  # [T, K, G, H]
    return out.reshape(num_tokens, num_heads, head_dim)
