"""Paged attention for a ragged batch: the one function a TPU kernel replaces.

This is the pure-jnp reference (the CPU path). Each token attends over its own
sequence's pages, gathered through the block table, under a causal mask and,
on sliding layers, a window: a key at position j is visible to a query at
position i iff ``i - window < j <= i``. Softmax runs in f32.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp

# Which implementation ``attend`` traces: "auto" (the Pallas kernel on the TPU
# backend, this reference elsewhere), "reference", "pallas", or
# "pallas-interpret" (the kernel interpreted on any backend: for tests).
ATTENTION_ENV = "KVD_ATTENTION"


IMPLEMENTATIONS = ("reference", "pallas", "pallas-interpret")


def resolve_attention() -> str:
    """The implementation an engine built now will trace (read once, at
    construction: it is part of the engine's static spec, so two engines
    with different choices never share a trace)."""
    choice = os.environ.get(ATTENTION_ENV, "auto")
    if choice == "auto":
        return "pallas" if jax.default_backend() == "tpu" else "reference"
    if choice not in IMPLEMENTATIONS:
        raise ValueError(
            f"{ATTENTION_ENV}={choice!r}: use auto, reference, pallas or pallas-interpret"
        )
    return choice


def attend(
    implementation: str, q: jax.Array, view: jax.Array, slot: Any, *args: Any, **kwargs: Any
) -> jax.Array:
    """The engine's one attention entry point: the kernel or the reference."""
    if implementation == "reference":
        return paged_attention(q, view, slot, *args, **kwargs)
    from kernels.ragged_paged_attention import ragged_paged_attention

    return ragged_paged_attention(
        q, view, slot, *args, interpret=implementation == "pallas-interpret", **kwargs
    )


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
