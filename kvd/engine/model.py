"""The Gemma forward pass over kvd's paged KV pool, as one jittable function.

Shapes, one letter each everywhere (comments and einsum strings):
    T tokens in the ragged batch     S sequences          D model width
    N query heads   K KV heads   G = N / K query heads per KV head
    H head dim      F FFN width  V vocabulary
    P pages         W blocks per block table   L block size (tokens per page)

The pool is ONE array ``[P, E]``: page groups view it with their own shape
``[P, slots, 2, L, K, H]`` (every group's page has the same bytes, see
kvd/kv/layout.py). The host hands in int32 tables only: where each new token's
K/V go (page and offset per group) and each sequence's block table per group.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import msgspec

from kvd.engine.attention import paged_attention
from kvd.engine.config import ModelConfig
from kvd.kv.geometry import AttentionKind
from kvd.kv.layout import PageLayout

Params = dict[str, Any]


class StepBatch(NamedTuple):
    """One engine step: prefill chunks and decode tokens of many sequences."""

    tokens: jax.Array  # [T] int32; padding tokens are 0
    positions: jax.Array  # [T] int32 position of each token in its sequence
    seq_index: jax.Array  # [T] int32 row of each token's sequence in ``tables``
    write_pages: jax.Array  # [Gp, T] int32 page per page group for each token's K/V
    write_offsets: jax.Array  # [T] int32 offset of each token within its page
    tables: jax.Array  # [Gp, S, W] int32 block tables; null page 0 where absent
    sample_index: jax.Array  # [S] int32 token whose logits each sequence needs


class EngineSpec(msgspec.Struct, frozen=True):
    """Everything static about a step: the model and where each layer's KV lives."""

    config: ModelConfig
    block_size: int
    layer_places: tuple[tuple[int, int], ...]  # per layer: (page group, slot in page)
    group_slots: tuple[int, ...]  # layer slots per page, per page group

    @classmethod
    def build(cls, config: ModelConfig, layout: PageLayout) -> EngineSpec:
        places = tuple(layout.group_of_layer(i) for i in range(config.num_layers))
        return cls(config, layout.block_size, places, tuple(g.slots for g in layout.groups))


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMS norm in f32 (as Gemma does), cast back; ``scale`` is the direct multiplier."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * scale.astype(jnp.float32)).astype(x.dtype)


def rope_tables(
    positions: jax.Array, head_dim: int, theta: float, scale: float, partial: float, dtype: Any
) -> tuple[jax.Array, jax.Array]:
    """cos and sin ``[T, H]`` for rotate-half RoPE; non-rotating pairs get cos 1, sin 0."""
    half = head_dim // 2
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    inv_freq = inv_freq / scale
    rotating = int(half * partial)
    if rotating < half:  # Gemma 4 partial RoPE: frequencies of the first pairs only
        inv_freq = jnp.where(jnp.arange(half) < rotating, inv_freq, 0.0)
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, H/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # [T, H]
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x ``[T, heads, H]`` rotated by position (the rotate-half / NeoX form)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def _attention_block(
    spec: EngineSpec,
    layer: int,
    p: Params,
    x: jax.Array,  # [T, D] normed input
    pool: jax.Array,
    batch: StepBatch,
) -> tuple[jax.Array, jax.Array]:
    cfg = spec.config
    kind = cfg.layer_kinds[layer]
    n_kv, head_dim = cfg.kv_heads_of(kind), cfg.head_dim_of(kind)
    num_tokens = x.shape[0]
    q = (x @ p["q"]).reshape(num_tokens, cfg.num_heads, head_dim)  # [T, N, H]
    k = (x @ p["k"]).reshape(num_tokens, n_kv, head_dim)  # [T, K, H]
    v = k if "v" not in p else (x @ p["v"]).reshape(num_tokens, n_kv, head_dim)
    q = rms_norm(q, p["q_norm"], cfg.rms_eps)
    k = rms_norm(k, p["k_norm"], cfg.rms_eps)
    if cfg.value_norm:
        v = rms_norm(v, jnp.ones((head_dim,), v.dtype), cfg.rms_eps)
    sliding = kind is AttentionKind.SLIDING
    theta = cfg.rope_local_theta if sliding else cfg.rope_global_theta
    scale = 1.0 if sliding else cfg.rope_global_scale
    partial = 1.0 if sliding else cfg.rope_global_partial
    cos, sin = rope_tables(batch.positions, head_dim, theta, scale, partial, x.dtype)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    group, slot = spec.layer_places[layer]
    num_pages = pool.shape[0]
    view = pool.reshape(num_pages, spec.group_slots[group], 2, spec.block_size, n_kv, head_dim)
    pages, offsets = batch.write_pages[group], batch.write_offsets
    view = view.at[pages, slot, 0, offsets].set(k.astype(view.dtype))
    view = view.at[pages, slot, 1, offsets].set(v.astype(view.dtype))
    out = paged_attention(
        q,
        view,
        slot,
        batch.tables[group],
        batch.seq_index,
        batch.positions,
        scale=cfg.query_scale,
        window=cfg.sliding_window if sliding else None,
        softcap=cfg.attn_logit_softcap,
    )  # [T, N, H]
    return out.reshape(num_tokens, -1) @ p["o"], view.reshape(pool.shape)


def forward(
    spec: EngineSpec, params: Params, pool: jax.Array, batch: StepBatch
) -> tuple[jax.Array, jax.Array]:
    """Run one ragged step; returns (logits ``[S, V]`` in f32, the updated pool)."""
    cfg = spec.config
    embed = params["embed"]  # [V, D]
    dtype = embed.dtype
    x = embed[batch.tokens] * jnp.asarray(math.sqrt(cfg.hidden_size), dtype)  # [T, D]
    for layer in range(cfg.num_layers):
        p = params["layers"][layer]
        residual = x
        h = rms_norm(x, p["attn_norm"], cfg.rms_eps)
        h, pool = _attention_block(spec, layer, p, h, pool, batch)
        h = rms_norm(h, p["post_attn_norm"], cfg.rms_eps)
        x = residual + h
        residual = x
        h = rms_norm(x, p["pre_ffn_norm"], cfg.rms_eps)
        h = jax.nn.gelu(h @ p["gate"], approximate=True) * (h @ p["up"])  # [T, F]
        h = rms_norm(h @ p["down"], p["post_ffn_norm"], cfg.rms_eps)
        x = residual + h
        if cfg.layer_scalar:
            x = x * p["layer_scalar"]
    last = rms_norm(x[batch.sample_index], params["final_norm"], cfg.rms_eps)  # [S, D]
    logits = (last @ embed.T).astype(jnp.float32)  # [S, V]
    if cfg.final_logit_softcap is not None:
        cap = cfg.final_logit_softcap
        logits = jnp.tanh(logits / cap) * cap
    return logits, pool
