"""The reference paged attention against a plain numpy oracle: ragged batches
of lone tokens and long runs, windows, ring tables, padding, soft-cap, GQA."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvd.engine import attention  # noqa: E402
from kvd.engine.attention import paged_attention  # noqa: E402
from kvd.engine.kvquant import SCALE_LANES, dequantise, quantise  # noqa: E402

BLOCK = 4


@pytest.fixture(autouse=True, params=["tiles", "lone-tokens"])
def tiling(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every case both ways: runs of tokens as shared query tiles, and (as small
    steps do) every token as a tile of its own."""
    monkeypatch.setattr(attention, "LONE_ONLY", 0 if request.param == "tiles" else 10**6)


def oracle(
    q: np.ndarray,
    keys: list[np.ndarray],  # per sequence: [positions, K, H]
    values: list[np.ndarray],
    seq_index: np.ndarray,
    positions: np.ndarray,
    *,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> np.ndarray:
    """Attention written out token by token, in float64."""
    num_tokens, num_heads, head_dim = q.shape
    out = np.zeros((num_tokens, num_heads, head_dim))
    for t in range(num_tokens):
        pos = int(positions[t])
        if pos < 0:
            continue
        k, v = keys[seq_index[t]], values[seq_index[t]]
        group = num_heads // k.shape[1]
        lo = 0 if window is None else max(0, pos - window + 1)
        for h in range(num_heads):
            kv = h // group
            scores = k[lo : pos + 1, kv] @ q[t, h] * scale
            if softcap is not None:
                scores = np.tanh(scores / softcap) * softcap
            probs = np.exp(scores - scores.max())
            out[t, h] = probs @ v[lo : pos + 1, kv] / probs.sum()
    return out


def build(
    rng: np.random.Generator,
    runs: list[tuple[int, int]],  # per sequence: (tokens already cached, tokens this step)
    *,
    ring: int | None,
    window: int | None,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 8,
    places: int = 2,
    place: int = 1,
    padding: int = 0,
    spare_rows: int = 0,
    min_pages: int = 0,
) -> tuple[dict[str, object], tuple[list[np.ndarray], list[np.ndarray]]]:
    """Pages filled with each sequence's keys through (ring) tables, as the
    engine lays them out: a ring keeps only the blocks one step can see."""
    lengths = [cached + new for cached, new in runs]
    width = ring if ring is not None else max(-(-n // BLOCK) for n in lengths)
    pages = max(min_pages, 1 + sum(-(-n // BLOCK) for n in lengths) + 3)
    view = rng.standard_normal((pages, places, 2, BLOCK, kv_heads, head_dim)).astype(np.float32)
    view[0] = 0.0
    free = list(rng.permutation(np.arange(1, pages)))
    rows = len(runs) + spare_rows
    tables = np.zeros((rows, width), np.int32)
    keys, values = [], []
    for s, (cached, new) in enumerate(runs):
        n = cached + new
        blocks = -(-n // BLOCK)
        k = rng.standard_normal((n, kv_heads, head_dim)).astype(np.float32)
        v = rng.standard_normal((n, kv_heads, head_dim)).astype(np.float32)
        first_needed = 0 if window is None else max(0, cached - window + 1) // BLOCK
        for b in range(blocks):
            page = free.pop()
            view[page, place, 0, : min(BLOCK, n - b * BLOCK)] = k[b * BLOCK : (b + 1) * BLOCK]
            view[page, place, 1, : min(BLOCK, n - b * BLOCK)] = v[b * BLOCK : (b + 1) * BLOCK]
            if b >= first_needed or ring is None:
                tables[s, b % width] = page
        keys.append(k)
        values.append(v)
    seq_index = [s for s, (_, new) in enumerate(runs) for _ in range(new)]
    positions = [p for cached, new in runs for p in range(cached, cached + new)]
    seq_index += [len(runs) if spare_rows else 0] * padding
    positions += [-1] * padding
    q = rng.standard_normal((len(positions), heads, head_dim)).astype(np.float32)
    args = {
        "q": q,
        "view": view,
        "place": place,
        "tables": tables,
        "seq_index": np.asarray(seq_index, np.int32),
        "positions": np.asarray(positions, np.int32),
    }
    return args, (keys, values)


def check(
    runs: list[tuple[int, int]],
    *,
    window: int | None,
    ring: int | None = None,
    softcap: float | None = None,
    padding: int = 0,
    spare_rows: int = 0,
    seed: int = 0,
    kv_heads: int = 2,
    int8: bool = False,
) -> None:
    rng = np.random.default_rng(seed)
    args, (keys, values) = build(
        rng, runs, ring=ring, window=window, padding=padding, spare_rows=spare_rows,
        kv_heads=kv_heads,
    )  # fmt: skip
    if int8:
        args, (keys, values) = quantised(args, keys, values)
    got = paged_attention(
        **{k: jnp.asarray(v) if isinstance(v, np.ndarray) else v for k, v in args.items()},
        scale=0.3,
        window=window,
        softcap=softcap,
    )
    expected = oracle(
        args["q"], keys, values, args["seq_index"], args["positions"],  # type: ignore[arg-type]
        scale=0.3, window=window, softcap=softcap,
    )  # fmt: skip
    np.testing.assert_allclose(np.asarray(got), expected, rtol=2e-5, atol=2e-5)


def quantised(
    args: dict[str, object], keys: list[np.ndarray], values: list[np.ndarray]
) -> tuple[dict[str, object], tuple[list[np.ndarray], list[np.ndarray]]]:
    """The batch over an int8 pool, and the oracle's keys and values as the
    attention must see them: quantised row by row, then dequantised."""
    head_dim = keys[0].shape[-1]

    def round_trip(x: np.ndarray) -> np.ndarray:
        return np.asarray(dequantise(quantise(jnp.asarray(x)), head_dim), np.float64)

    view = np.asarray(quantise(jnp.asarray(args["view"])))
    return {**args, "view": view}, ([round_trip(k) for k in keys], [round_trip(v) for v in values])


def test_int8_rows_round_trip_within_half_a_step() -> None:
    rng = np.random.default_rng(4)
    x = rng.standard_normal((64, 3, 256)).astype(np.float32) * rng.uniform(0.01, 30, (64, 3, 1))
    x[0, 0] = 0.0  # an all-zero row
    raw = quantise(jnp.asarray(x))
    assert raw.dtype == jnp.int8 and raw.shape == (64, 3, 256 + SCALE_LANES)
    back = np.asarray(dequantise(raw, 256))
    step = np.abs(x).max(axis=-1, keepdims=True) / 127
    assert np.all(np.abs(back - x) <= step / 2 * (1 + 1e-5) + 1e-12)
    assert np.all(back[0, 0] == 0)
    # Two groups of 128 values: each its own scale, so each within its own half step.
    raw = quantise(jnp.asarray(x), 128)
    assert raw.shape == (64, 3, 256 + 2 * SCALE_LANES)
    back = np.asarray(dequantise(raw, 256)).reshape(64, 3, 2, 128)
    halves = x.reshape(64, 3, 2, 128)
    step = np.abs(halves).max(axis=-1, keepdims=True) / 127
    assert np.all(np.abs(back - halves) <= step / 2 * (1 + 1e-5) + 1e-12)


@pytest.mark.parametrize("runs", [[(5, 1), (16, 1), (31, 1)], [(0, 5), (16, 1), (3, 40), (90, 17)]])
@pytest.mark.parametrize("window", [None, 9])
def test_int8_pool_matches_the_oracle_on_dequantised_keys(
    runs: list[tuple[int, int]], window: int | None
) -> None:
    """An int8 pool is dequantised inside attention: the result is exact
    attention over the dequantised keys and values (same tolerance as f32)."""
    check(runs, window=window, softcap=5.0, int8=True)


@pytest.mark.parametrize(
    "runs",
    [
        [(0, 1)],
        [(5, 1), (16, 1), (31, 1), (47, 1)],  # decodes
        [(0, 37)],  # a prefill over several query tiles
        [(0, 5), (16, 1), (3, 40), (40, 1), (90, 17)],  # mixed: lone tokens and runs
        [(200, 33), (7, 1)],  # a chunk deep into a long context
    ],
)
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (9, 5.0)])
def test_matches_the_oracle(runs: list[tuple[int, int]], window: int | None, softcap: float | None):
    check(runs, window=window, softcap=softcap)


@pytest.mark.parametrize("chunk_tokens", [1, 7, 40])
def test_ring_tables_hold_only_the_window(chunk_tokens: int) -> None:
    """A sliding layer's table is a ring of ceil((window - 1 + chunk) / block) + 1
    entries: a step's queries see every key they need, wherever the ring wrapped."""
    window = 10
    ring = -(-(window - 1 + chunk_tokens) // BLOCK) + 1
    for cached in (0, 17, 101):
        check([(cached, chunk_tokens), (cached + 5, 1)], window=window, ring=ring, seed=cached)


def test_padding_outputs_zero_and_changes_nothing() -> None:
    for spare_rows in (0, 1):  # padding aliases row 0 when every row is used
        check([(3, 6), (9, 1)], window=None, padding=7, spare_rows=spare_rows)
        rng = np.random.default_rng(1)
        args, _ = build(rng, [(3, 6)], ring=None, window=None, padding=5, spare_rows=spare_rows)
        out = paged_attention(**args, scale=1.0, window=None, softcap=None)  # type: ignore[arg-type]
        assert np.all(np.asarray(out)[6:] == 0)


def test_long_contexts_span_many_loop_iterations() -> None:
    """More items than one iteration takes, for both tile classes (one
    sequence of lone tokens, one long run), with a global and a sliding window."""
    runs = [(600, 1), (333, 1), (1, 1), (450, 70)]
    check(runs, window=None, kv_heads=1)
    check(runs, window=100, kv_heads=1)
    # A lone decode deep into its context: one tile, its items over several iterations.
    check([(600, 1)], window=None, kv_heads=1)
    check([(600, 1)], window=100, softcap=5.0)


@settings(max_examples=6, deadline=None)
@given(
    runs=st.lists(st.tuples(st.integers(0, 80), st.integers(1, 40)), min_size=1, max_size=6),
    window=st.one_of(st.none(), st.integers(1, 50)),
    padding=st.integers(0, 9),
    seed=st.integers(0, 2**16),
)
def test_random_ragged_batches(
    runs: list[tuple[int, int]], window: int | None, padding: int, seed: int
) -> None:
    check(runs, window=window, padding=padding, spare_rows=1, seed=seed)


def test_one_compile_serves_every_context_length() -> None:
    """The loop's trip count follows the live keys: no shape depends on them."""
    traced = jax.jit(
        lambda q, view, tables, seq_index, positions: paged_attention(
            q, view, 1, tables, seq_index, positions, scale=0.3, window=None, softcap=None
        )
    )
    rng = np.random.default_rng(2)
    for cached in (0, 50, 190):
        args, (keys, values) = build(
            rng, [(cached, 9), (cached // 2, 1)], ring=64, window=None, min_pages=100
        )
        names = ("q", "view", "tables", "seq_index", "positions")
        got = traced(*(jnp.asarray(args[k]) for k in names))  # type: ignore[arg-type]
        expected = oracle(
            args["q"], keys, values, args["seq_index"], args["positions"],  # type: ignore[arg-type]
            scale=0.3, window=None, softcap=None,
        )  # fmt: skip
        np.testing.assert_allclose(np.asarray(got), expected, rtol=2e-5, atol=2e-5)
    assert traced._cache_size() == 1
