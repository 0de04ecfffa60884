"""Paged attention for a ragged batch: the one function a TPU kernel replaces.

The contract (shared with ``kernels/ragged_paged_attention.py``): a flattened
batch of prefill chunks and decode tokens, the tokens of one sequence
contiguous and in position order. Each token attends over its own sequence's
pages, found through the block table, under a causal mask and, on sliding
layers, a window: a key at position j is visible to a query at position i iff
``i - window < j <= i``. A table is a ring of ``ring`` entries (its width
unless given): block b of a sequence lives in entry ``b % ring``, so a
sliding layer's table need only span the keys one step can see, not the whole
context. A token with a negative position is padding: it sees nothing and its
output is zero. Softmax runs in f32.

This module is the pure-jnp version (the CPU path). Its cost follows what the
tokens can see, not the table's width:
- Queries are cut into *tiles*: up to ``QUERY_TILE`` consecutive tokens of one
  sequence, which share every key they gather (a decode is a tile of one).
- Each tile's visible keys, from its first query's window start to its last
  query, are cut into page-aligned chunks (``TILE_KEY_CHUNK`` keys, or
  ``KEY_CHUNK`` for a lone token). A (tile,
  chunk) pair is one *item*; a step's items form one ragged work list,
  tile-major, whose length is the sum of what each tile can see.
- A loop takes the items a fixed number at a time (gathering only their
  pages), and folds each into its tile's running softmax (max, denominator,
  numerator: the flash-attention recurrence), so the working set is
  O(items per iteration x tile x chunk) whatever the context length, and the
  trip count follows the live keys.
Tiles of one token and tiles of many run as two such loops, so a decode in a
step that also holds a prefill chunk costs one query row, not a tile's worth.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from kvd.engine.config import ATTENTION_CHOICES
from kvd.engine.kvquant import dequantise, from_pool, is_quantised

# Which implementation ``attend`` traces (``EngineConfig.attention``, the
# config's ``model.attention``): "auto" (the Pallas kernel on the TPU backend,
# this reference elsewhere), "reference", "pallas", or "pallas-interpret"
# (the kernel interpreted on any backend: for tests).
IMPLEMENTATIONS = ATTENTION_CHOICES[1:]

NO_WINDOW = 1 << 30  # a global layer's "window": longer than any sequence

# Tokens of one sequence whose queries share one gather of each key chunk.
# 32 query tokens x 4 heads make a 128-row matmul against a 256-key chunk:
# on this machine's XLA:CPU that ran a 512-token chunk at context ~3,000 in
# 67 ms per global layer, against 110 ms with 16 tokens and 128 keys.
QUERY_TILE = 32
# Keys per item (rounded to whole pages), for lone tokens and for tiles. Smaller
# wastes less of a window's edges; larger means fewer loop iterations and, for
# tiles, larger matmuls.
KEY_CHUNK = 128
TILE_KEY_CHUNK = 256
# Steps of at most this many tokens take every token as a tile of its own:
# one loop instead of two (smaller programs), at the price of a short prefill
# chunk gathering its keys once per token.
LONE_ONLY = 32
# Items per loop iteration, for tiles of many tokens and of one.
TILE_ITEMS = 4
SINGLE_ITEMS = 16


def resolve_attention(choice: str = "auto") -> str:
    """The implementation an engine asking for ``choice`` traces (resolved
    once, at construction: it is part of the engine's static spec, so two
    engines with different choices never share a trace)."""
    if choice == "auto":
        return "pallas" if jax.default_backend() == "tpu" else "reference"
    if choice not in IMPLEMENTATIONS:
        raise ValueError(f"attention {choice!r}: use auto, reference, pallas or pallas-interpret")
    return choice


def attend(
    implementation: str, q: jax.Array, view: jax.Array, place: Any, *args: Any, **kwargs: Any
) -> jax.Array:
    """The engine's one attention entry point: the kernel or the reference."""
    if implementation == "reference":
        return paged_attention(q, view, place, *args, **kwargs)
    from kvd_kernels.ragged_paged_attention import ragged_paged_attention

    if view.dtype == jnp.uint16:  # a bf16 pool's patterns (kvquant.storage_dtype)
        view = jax.lax.bitcast_convert_type(view, jnp.bfloat16)
    return ragged_paged_attention(
        q,
        view,
        place,
        *args,
        dequantise=dequantise if is_quantised(view.dtype) else None,
        interpret=implementation == "pallas-interpret",
        **kwargs,
    )


class _Tiles(NamedTuple):
    """One class of query tiles (capacity ``n``, ``size`` tokens each)."""

    first: jax.Array  # [n] flat index of each tile's first token
    length: jax.Array  # [n] tokens in the tile (0: unused)
    seq: jax.Array  # [n] its sequence's table row
    start: jax.Array  # [n] position of its first token
    of_token: jax.Array  # [T] the tile of each token (n where not in this class)


def paged_attention(
    q: jax.Array,  # [T, N, H] queries (RoPE applied)
    view: jax.Array,  # [P, places, 2, L, K, H] the pool seen by this layer's page group
    # (an int8 pool: [..., H + 4], dequantised as pages are gathered)
    place: Any,  # this layer's place in its group's pages
    tables: jax.Array,  # [S, W] block tables of this page group (rings, see above)
    seq_index: jax.Array,  # [T] sequence row of each token
    positions: jax.Array,  # [T] position of each token; negative: padding
    *,
    scale: float,
    window: jax.Array | int | None,
    softcap: float | None,
    ring: jax.Array | int | None = None,
) -> jax.Array:
    q, view, tables = jnp.asarray(q), jnp.asarray(view), jnp.asarray(tables)
    num_tokens, num_heads, head_dim = q.shape
    num_rows, width = tables.shape
    ring = width if ring is None else ring
    window = NO_WINDOW if window is None else window
    positions = jnp.asarray(positions, jnp.int32)
    seq_index = jnp.asarray(seq_index, jnp.int32)
    block_size = view.shape[3]
    attend_tiles = _tile_attention(
        q, view, place, tables, ring, window, scale=scale, softcap=softcap
    )
    lone_chunk_pages = max(1, KEY_CHUNK // block_size)
    if num_tokens <= LONE_ONLY:
        # Every token is a tile of its own, in place: padding is a tile that
        # sees nothing (its output is zero), so there is nothing to compact
        # and nothing to gather back. Decode steps are all of this kind.
        index = jnp.arange(num_tokens, dtype=jnp.int32)
        length = (positions >= 0).astype(jnp.int32)
        tiles = _Tiles(index, length, seq_index, positions, index)
        return attend_tiles(tiles, 1, SINGLE_ITEMS, lone_chunk_pages)[:, 0]
    singles, multis, offset = _tile(seq_index, positions, num_rows)
    out_single = attend_tiles(singles, 1, SINGLE_ITEMS, lone_chunk_pages)
    out_multi = attend_tiles(  # [m, QUERY_TILE, N, H]
        multis, QUERY_TILE, TILE_ITEMS, max(1, TILE_KEY_CHUNK // block_size)
    )
    # Back to the flat token order; padding (in neither class) gets zeros.
    zero = jnp.zeros((1, num_heads, head_dim), q.dtype)
    from_single = jnp.concatenate([out_single[:, 0], zero])[singles.of_token]
    multi_rows = out_multi.reshape(-1, num_heads, head_dim)
    multi_index = multis.of_token * QUERY_TILE + offset % QUERY_TILE
    from_multi = jnp.concatenate([multi_rows, zero])[jnp.minimum(multi_index, multi_rows.shape[0])]
    in_single = singles.of_token < singles.first.shape[0]
    return jnp.where(in_single[:, None, None], from_single, from_multi)


def _tile(
    seq_index: jax.Array, positions: jax.Array, num_rows: int
) -> tuple[_Tiles, _Tiles, jax.Array]:
    """Split a step's tokens into tiles: (tiles of a lone token, tiles of up to
    QUERY_TILE tokens of a longer run, each token's offset in its run)."""
    num_tokens = seq_index.shape[0]
    index = jnp.arange(num_tokens, dtype=jnp.int32)
    valid = positions >= 0
    previous_seq = jnp.concatenate([jnp.full((1,), -1, jnp.int32), seq_index[:-1]])
    previous_valid = jnp.concatenate([jnp.zeros((1,), bool), valid[:-1]])
    run_start = (seq_index != previous_seq) | (valid != previous_valid)
    first_of_run = jax.lax.cummax(jnp.where(run_start, index, 0))
    offset = index - first_of_run
    run_id = jnp.cumsum(run_start) - 1
    run_length = jnp.zeros(num_tokens, jnp.int32).at[run_id].add(1)[run_id]
    single = valid & (run_length == 1)
    multi = valid & ~single
    # Capacities: a lone token per sequence row; a longer run adds at most one
    # partial tile to its full ones.
    lone_capacity = min(num_tokens, num_rows)
    tile_capacity = -(-num_tokens // QUERY_TILE) + min(num_rows, num_tokens // 2)
    singles = _tiles_of(single, single, index, seq_index, positions, lone_capacity)
    tile_start = multi & (offset % QUERY_TILE == 0)
    multis = _tiles_of(multi, tile_start, index, seq_index, positions, tile_capacity)
    return singles, multis, offset


def _tiles_of(
    member: jax.Array,
    starts: jax.Array,
    index: jax.Array,
    seq_index: jax.Array,
    positions: jax.Array,
    capacity: int,
) -> _Tiles:
    tile = jnp.cumsum(starts) - 1
    of_token = jnp.where(member, tile, capacity).astype(jnp.int32)
    first = (
        jnp.zeros(capacity, jnp.int32).at[jnp.where(starts, tile, capacity)].set(index, mode="drop")
    )
    count = jnp.zeros(capacity, jnp.int32).at[of_token].add(1, mode="drop")
    return _Tiles(first, count, seq_index[first], positions[first], of_token)


def _tile_attention(
    q: jax.Array,
    view: jax.Array,
    place: Any,
    tables: jax.Array,
    ring: Any,
    window: Any,
    *,
    scale: float,
    softcap: float | None,
) -> Any:
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv = view.shape[3], view.shape[4]
    group = num_heads // num_kv
    grouped = q.reshape(num_tokens, num_kv, group, head_dim)

    def run(tiles: _Tiles, size: int, per_iteration: int, chunk_pages: int) -> jax.Array:
        chunk = chunk_pages * block_size
        capacity = tiles.first.shape[0]
        if capacity == 0:
            return jnp.zeros((0, size, num_heads, head_dim), q.dtype)
        rows = jnp.minimum(tiles.first[:, None] + jnp.arange(size), num_tokens - 1)
        queries = grouped[rows]  # [n, Q, K, G, H]
        last = tiles.start + tiles.length - 1  # the tile's last query position
        lowest = jnp.maximum(tiles.start - window + 1, 0)  # its first visible key
        first_chunk = lowest // chunk
        chunks = jnp.where(tiles.length > 0, last // chunk - first_chunk + 1, 0)
        ends = jnp.cumsum(chunks)  # tile-major work list: tile t owns [ends[t-1], ends[t])
        total = ends[-1]
        # A small step (a lone decode: capacity 2) takes few items at a time,
        # so it does not gather many dead ones.
        items = min(per_iteration, capacity * 4)
        lanes = jnp.arange(items, dtype=jnp.int32)

        # What an item needs of its tile, one row per tile: a single gather.
        per_tile = jnp.stack(
            [tiles.seq, tiles.start, tiles.length, last, lowest, first_chunk - (ends - chunks)],
            axis=1,
        )

        def fold(
            step: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]
        ) -> tuple[jax.Array, jax.Array, jax.Array]:
            best, denominator, numerator = carry
            item = step * items + lanes
            live = item < total
            tile = jnp.minimum(
                jnp.searchsorted(ends, item, side="right", method="compare_all"), capacity - 1
            )
            seq, start, count, last_pos, lowest_key, chunk_base = per_tile[tile].T
            key_chunk = chunk_base + item
            blocks = key_chunk[:, None] * chunk_pages + jnp.arange(chunk_pages)  # [B, c]
            seen = (
                live[:, None]
                & (blocks * block_size <= last_pos[:, None])
                & ((blocks + 1) * block_size > lowest_key[:, None])
            )
            # Blocks nobody in the tile sees read the null page, never a stale entry.
            pages = jnp.where(seen, tables[seq[:, None], blocks % ring], 0)
            # Keys and values as two gathers ([B, c, L, K, H] each): one gather
            # of both made XLA:CPU copy each half out of it again (at batch 32
            # on the 270M, 31 ms of a 190 ms decode step).
            keys, values = (
                from_pool(
                    view[pages, place, half].reshape(items, chunk, num_kv, -1), head_dim, q.dtype
                )
                for half in (0, 1)
            )
            scores = jnp.einsum("bqkgh,bckh->bkgqc", queries[tile], keys).astype(jnp.float32)
            scores = scores * scale
            if softcap is not None:
                scores = jnp.tanh(scores / softcap) * softcap
            key_pos = key_chunk[:, None] * chunk + jnp.arange(chunk)  # [B, C]
            query_pos = start[:, None] + jnp.arange(size)  # [B, Q]
            visible = (
                (key_pos[:, None, :] <= query_pos[:, :, None])
                & (key_pos[:, None, :] > query_pos[:, :, None] - window)
                & (jnp.arange(size) < count[:, None])[:, :, None]
                & live[:, None, None]
            )[:, None, None]  # [B, 1, 1, Q, C]
            scores = jnp.where(visible, scores, -jnp.inf)
            best_new = best.at[tile].max(scores.max(axis=-1))  # [n, K, G, Q]
            anchor = jnp.where(best_new == -jnp.inf, 0.0, best_new)[tile]  # [B, K, G, Q]
            # Only the tiles this iteration touches are rescaled: a tile met by
            # several items gets the same value from each (set, not multiply).
            rescale = jnp.exp(best[tile] - anchor)  # 0 where nothing was seen yet
            probs = jnp.exp(scores - anchor[..., None])  # masked keys: exp(-inf) = 0
            denominator = denominator.at[tile].set(denominator[tile] * rescale)
            denominator = denominator.at[tile].add(probs.sum(axis=-1))
            mixed = jnp.einsum("bkgqc,bckh->bkgqh", probs.astype(q.dtype), values)
            numerator = numerator.at[tile].set(numerator[tile] * rescale[..., None])
            numerator = numerator.at[tile].add(mixed.astype(jnp.float32))
            return best_new, denominator, numerator

        shape = (capacity, num_kv, group, size)
        carry = (
            jnp.full(shape, -jnp.inf, jnp.float32),
            jnp.zeros(shape, jnp.float32),
            jnp.zeros((*shape, head_dim), jnp.float32),
        )
        steps = (total + items - 1) // items
        _, denominator, numerator = jax.lax.fori_loop(0, steps, fold, carry)
        out = numerator / jnp.where(denominator == 0, 1.0, denominator)[..., None]
        # [n, K, G, Q, H] -> [n, Q, N, H]
        return (
            out.transpose(0, 3, 1, 2, 4)
            .reshape(capacity, size, num_heads, head_dim)
            .astype(q.dtype)
        )

    return run
