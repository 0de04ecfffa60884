"""The Gemma forward pass over kvd's paged KV pool, as one jittable function.

Shapes, one letter each everywhere (comments and einsum strings):
    T tokens in the ragged batch     S sequences          D model width
    N query heads   K KV heads   G = N / K query heads per KV head
    H head dim      F FFN width  V vocabulary
    P pages         W blocks per block table   L block size (tokens per page)

The pool is ONE array ``[P, E]``: page groups view it with their own shape
``[P, places, 2, L, K, H]`` (every group's page has the same bytes, see
kvd/kv/layout.py; an int8 pool's rows are ``H + 4``: values and their scale,
kvd/engine/kvquant.py). The host hands in int32 tables only: where each new token's
K/V go (page and offset per group) and each sequence's block table per group.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import msgspec
import numpy as np

from kvd.engine.attention import NO_WINDOW, attend, resolve_attention
from kvd.engine.config import ModelConfig
from kvd.engine.kvquant import is_quantised, rotation, to_pool
from kvd.engine.qdense import dense, dense_group, embedding_rows, output_logits
from kvd.kv.geometry import AttentionKind
from kvd.kv.layout import PageLayout

Params = dict[str, Any]


class StepBatch(NamedTuple):
    """One engine step: prefill chunks and decode tokens of many sequences.

    Built on the host as numpy arrays; inside jit the fields are traced arrays.
    """

    tokens: Any  # [T] int32; padding tokens are 0
    positions: Any  # [T] int32 position of each token in its sequence
    seq_index: Any  # [T] int32 row of each token's sequence in ``tables``
    write_pages: Any  # [Gp, T] int32 page per page group for each token's K/V
    write_offsets: Any  # [T] int32 offset of each token within its page
    tables: Any  # [Gp, S, W] int32 block tables; null page 0 where absent
    sample_index: Any  # [S] int32 token whose logits each sequence needs


class EngineSpec(msgspec.Struct, frozen=True):
    """Everything static about a step: the model and where each layer's KV lives."""

    config: ModelConfig
    block_size: int
    layer_places: tuple[tuple[int, int], ...]  # per layer: (page group, place in page)
    group_places: tuple[int, ...]  # layer places per page, per page group
    attention: str = "reference"  # see kvd.engine.attention.resolve_attention
    # Entries of a sliding group's table, a ring (kvd.engine.batching.sliding_ring);
    # 0: sliding tables are as wide as global ones.
    sliding_ring: int = 0

    @classmethod
    def build(
        cls,
        config: ModelConfig,
        layout: PageLayout,
        sliding_ring: int = 0,
        attention: str = "auto",
    ) -> EngineSpec:
        places = tuple(layout.group_of_layer(i) for i in range(config.num_layers))
        return cls(
            config,
            layout.block_size,
            places,
            tuple(g.places for g in layout.groups),
            resolve_attention(attention),
            sliding_ring,
        )

    def places_of(self, kind: AttentionKind) -> int:
        """Layer places per page of this kind's groups (the same for all of them)."""
        (places,) = {
            self.group_places[g]
            for (g, _), k in zip(self.layer_places, self.config.layer_kinds, strict=True)
            if k is kind
        }
        return places

    @property
    def uniform(self) -> bool:
        """Every layer has the same shapes (Gemma 3): the layers run as one
        ``lax.scan`` over stacked weights, compiled once instead of unrolled."""
        cfg = self.config
        kinds = set(cfg.layer_kinds)
        return (
            len({(cfg.kv_heads_of(k), cfg.head_dim_of(k)) for k in kinds}) == 1
            and len(set(self.group_places)) == 1
            and not cfg.layer_scalar
        )


def activation_dtype(params: Params) -> Any:
    """The dtype the model computes in: its float weights' (int8 weights
    dequantise into it)."""
    return params["final_norm"].dtype


def prepare_params(spec: EngineSpec, params: Params) -> Params:
    """Stack per-layer weights ``[L, ...]`` when the layers can be scanned
    (``body`` then runs them as one ``lax.scan``)."""
    if not spec.uniform:
        return params
    layers = params["layers"]
    stack = {
        name: jax.tree.map(lambda *arrays: np.stack(arrays), *[layer[name] for layer in layers])
        for name in layers[0]
    }
    return {"embed": params["embed"], "final_norm": params["final_norm"], "stack": stack}


class _LayerPlace(NamedTuple):
    """Where a layer's KV lives and how it attends (ints, or traced in a scan)."""

    group: Any
    in_page: Any  # the layer's place in its group's pages
    window: Any  # tokens; the global layers get one longer than any sequence
    is_global: Any


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
    kind: AttentionKind,
    place: _LayerPlace,
    p: Params,
    x: jax.Array,  # [T, D] normed input
    pool: jax.Array,
    batch: StepBatch,
    ropes: dict[AttentionKind, tuple[jax.Array, jax.Array]],
) -> tuple[jax.Array, jax.Array]:
    cfg = spec.config
    n_kv, head_dim = cfg.kv_heads_of(kind), cfg.head_dim_of(kind)
    num_tokens = x.shape[0]
    q, k, *rest = dense_group(x, [p[name] for name in ("q", "k", "v") if name in p])
    q = q.reshape(num_tokens, cfg.num_heads, head_dim)  # [T, N, H]
    k = k.reshape(num_tokens, n_kv, head_dim)  # [T, K, H]
    v = rest[0].reshape(num_tokens, n_kv, head_dim) if rest else k
    q = rms_norm(q, p["q_norm"], cfg.rms_eps)
    k = rms_norm(k, p["k_norm"], cfg.rms_eps)
    if cfg.value_norm:
        v = rms_norm(v, jnp.ones((head_dim,), v.dtype), cfg.rms_eps)
    if len(ropes) == 1:
        cos, sin = next(iter(ropes.values()))
    else:  # scanned layers choose their RoPE by a traced flag
        cos_g, sin_g = ropes[AttentionKind.GLOBAL]
        cos_s, sin_s = ropes[AttentionKind.SLIDING]
        cos = jnp.where(place.is_global, cos_g, cos_s)
        sin = jnp.where(place.is_global, sin_g, sin_s)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    turn = rotation(head_dim) if is_quantised(pool.dtype) else None
    if turn is not None:  # int8 K/V: channels evened out first (kvquant.rotation)
        turn_ = jnp.asarray(turn, q.dtype)
        q, k, v = q @ turn_, k @ turn_, v @ turn_

    num_pages = pool.shape[0]
    places = spec.places_of(kind)
    # The last axis is head_dim, or head_dim + the scale's bytes in an int8 pool.
    view = pool.reshape(num_pages, places, 2, spec.block_size, n_kv, -1)
    pages, offsets = batch.write_pages[place.group], batch.write_offsets
    k_rows, v_rows = (to_pool(x, view.dtype, view.shape[-1]) for x in (k, v))
    view = _write_kv(view, pages, place.in_page, offsets, k_rows, v_rows)
    tables, ring = batch.tables[place.group], None
    if spec.sliding_ring:
        if len(ropes) == 1:  # ``kind`` is this layer's: the ring is the table
            if kind is AttentionKind.SLIDING:
                tables = tables[:, : spec.sliding_ring]
        else:  # scanned layers of both kinds: the kind is traced, so is the ring
            ring = jnp.where(place.is_global, tables.shape[1], spec.sliding_ring)
    out = attend(
        spec.attention,
        q,
        view,
        place.in_page,
        tables,
        batch.seq_index,
        batch.positions,
        scale=cfg.query_scale,
        window=place.window,
        softcap=cfg.attn_logit_softcap,
        ring=ring,
    )  # [T, N, H]
    if turn is not None:
        out = out @ turn_  # its own inverse
    return dense(out.reshape(num_tokens, -1), p["o"]), view.reshape(pool.shape)


def _write_kv(
    view: jax.Array,
    pages: jax.Array,
    in_page: Any,
    offsets: jax.Array,
    k_rows: jax.Array,
    v_rows: jax.Array,
) -> jax.Array:
    """``view`` (the pool as ``[P, places, 2, L, K, H']``) with each token's K
    and V written at ``[page, in_page, 0 or 1, offset]``: one scatter of both.
    Two one-row scatters would not do for a lone token: XLA rewrites each into
    an update it does not do in place, copying the whole pool once per step
    (48 MB for a small bench pool; the daemon's is a gigabyte)."""
    halves = jnp.arange(2, dtype=jnp.int32)[:, None]
    return view.at[pages[None, :], in_page, halves, offsets[None, :]].set(
        jnp.stack([k_rows, v_rows])
    )


def _rope_for(
    cfg: ModelConfig, kind: AttentionKind, positions: jax.Array, dtype: Any
) -> tuple[jax.Array, jax.Array]:
    if kind is AttentionKind.SLIDING:
        return rope_tables(positions, cfg.head_dim_of(kind), cfg.rope_local_theta, 1.0, 1.0, dtype)
    return rope_tables(
        positions,
        cfg.head_dim_of(kind),
        cfg.rope_global_theta,
        cfg.rope_global_scale,
        cfg.rope_global_partial,
        dtype,
    )


def _block(
    spec: EngineSpec,
    kind: AttentionKind,
    place: _LayerPlace,
    p: Params,
    x: jax.Array,
    pool: jax.Array,
    batch: StepBatch,
    ropes: dict[AttentionKind, tuple[jax.Array, jax.Array]],
) -> tuple[jax.Array, jax.Array]:
    """One decoder layer: norms before and after attention and the MLP."""
    eps = spec.config.rms_eps
    h = rms_norm(x, p["attn_norm"], eps)
    h, pool = _attention_block(spec, kind, place, p, h, pool, batch, ropes)
    x = x + rms_norm(h, p["post_attn_norm"], eps)
    h = rms_norm(x, p["pre_ffn_norm"], eps)
    gate, up = dense_group(h, [p["gate"], p["up"]])
    h = jax.nn.gelu(gate, approximate=True) * up  # [T, F]
    x = x + rms_norm(dense(h, p["down"]), p["post_ffn_norm"], eps)
    if spec.config.layer_scalar:
        x = x * p["layer_scalar"]
    return x, pool


def body(
    spec: EngineSpec, params: Params, pool: jax.Array, batch: StepBatch
) -> tuple[jax.Array, jax.Array]:
    """The decoder stack over a ragged batch: (hidden states ``[T, D]``, updated pool)."""
    cfg = spec.config
    dtype = activation_dtype(params)
    x = embedding_rows(params["embed"], batch.tokens, dtype)  # [T, D]
    x = x * jnp.asarray(math.sqrt(cfg.hidden_size), dtype)
    kinds = sorted(set(cfg.layer_kinds))
    ropes = {k: _rope_for(cfg, k, batch.positions, dtype) for k in kinds}
    windows = [
        cfg.sliding_window if kind is AttentionKind.SLIDING else NO_WINDOW
        for kind in cfg.layer_kinds
    ]
    if "stack" in params:
        places = _LayerPlace(
            group=jnp.asarray([g for g, _ in spec.layer_places], jnp.int32),
            in_page=jnp.asarray([p for _, p in spec.layer_places], jnp.int32),
            window=jnp.asarray(windows, jnp.int32),
            is_global=jnp.asarray([k is AttentionKind.GLOBAL for k in cfg.layer_kinds]),
        )
        kind = cfg.layer_kinds[0]  # shapes are the same for every layer

        def one_layer(
            carry: tuple[jax.Array, jax.Array], layer: tuple[Params, _LayerPlace]
        ) -> tuple[tuple[jax.Array, jax.Array], None]:
            p, place = layer
            return _block(spec, kind, place, p, carry[0], carry[1], batch, ropes), None

        (x, pool), _ = jax.lax.scan(one_layer, (x, pool), (params["stack"], places))
        return x, pool
    for layer, kind in enumerate(cfg.layer_kinds):
        group, in_page = spec.layer_places[layer]
        place = _LayerPlace(
            jnp.int32(group),
            jnp.int32(in_page),
            jnp.int32(windows[layer]),
            kind is AttentionKind.GLOBAL,
        )
        x, pool = _traced_block(
            spec, kind, place, params["layers"][layer], x, pool, batch, {kind: ropes[kind]}
        )
    return x, pool


# Layers of one kind share a single trace: where a layer's KV lives is passed
# as traced scalars, so lowering an 18-layer step traces two layer bodies, not
# eighteen (XLA inlines the calls; the compiled step is the same).
_traced_block = jax.jit(_block, static_argnums=(0, 1))


def head(spec: EngineSpec, params: Params, rows: jax.Array) -> jax.Array:
    """Logits ``[S, V]`` (f32) for the hidden states of the tokens to sample."""
    return normed_logits(spec, params, final_norm(spec, params, rows))


def final_norm(spec: EngineSpec, params: Params, rows: jax.Array) -> jax.Array:
    """The hidden states the output projection multiplies: normed by the
    final norm. Computed where the rows are made (the decoder step), not in
    the head: XLA fuses the norm's multiplies into the output projection's
    product and redoes them for every vocabulary row (the 270M's head at one
    row: 5.6 ms against 4.2 with the row normed beforehand, on this machine)."""
    return rms_norm(rows, params["final_norm"], spec.config.rms_eps)


def normed_logits(spec: EngineSpec, params: Params, normed: jax.Array) -> jax.Array:
    """Logits ``[S, V]`` (f32) for rows already through ``final_norm``."""
    cfg = spec.config
    logits = output_logits(params["embed"], normed).astype(jnp.float32)
    if cfg.final_logit_softcap is not None:
        cap = cfg.final_logit_softcap
        logits = jnp.tanh(logits / cap) * cap
    return logits


def forward(
    spec: EngineSpec, params: Params, pool: jax.Array, batch: StepBatch
) -> tuple[jax.Array, jax.Array]:
    """One ragged step: (logits ``[S, V]`` in f32, the updated pool)."""
    hidden, pool = body(spec, params, pool, batch)
    return head(spec, params, hidden[batch.sample_index]), pool
