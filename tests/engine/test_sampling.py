"""Top-k and top-p are exact over the whole vocabulary: the set a sampled
token comes from equals a sort-based numpy oracle's, whether the cut falls
among the device's candidates or beyond them (bisection)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvd.engine.sampling import BEYOND_ROWS, CANDIDATES, SamplingBatch, exact_keep, sample

VOCAB = 1024


def oracle_keep(row: np.ndarray, top_k: int, top_p: float) -> set[int]:
    """vLLM's order: top-k, then top-p over the renormalised rest; the best stays."""
    order = np.argsort(-row, kind="stable")
    values = row[order].astype(np.float64)
    k = top_k if top_k > 0 else len(row)
    kept = order[:k]
    probs = np.exp(values[:k] - values[:k].max())
    probs /= probs.sum()
    before = np.cumsum(probs) - probs
    return {int(t) for t, b in zip(kept, before, strict=True) if b < top_p} | {int(order[0])}


def logits_for(kind: str, rng: np.random.Generator) -> np.ndarray:
    if kind == "peaked":  # a few tokens hold nearly all the mass
        row = rng.normal(0, 1, VOCAB)
        row[rng.choice(VOCAB, 5, replace=False)] += 12
        return row
    return rng.normal(0, 0.3, VOCAB)  # flat: the best 256 hold about a quarter


CASES = [
    ("peaked", 5, 1.0),  # top-k among the candidates
    ("peaked", 0, 0.5),  # a nucleus the candidates hold
    ("flat", 0, 0.9),  # a nucleus beyond them
    ("flat", CANDIDATES + 200, 1.0),  # top-k beyond them
    ("flat", CANDIDATES + 200, 0.7),  # both
    ("flat", 0, 1e-30),  # a nucleus of one token
]


@pytest.mark.parametrize(("kind", "top_k", "top_p"), CASES)
def test_exact_keep_matches_a_sort(kind: str, top_k: int, top_p: float) -> None:
    rng = np.random.default_rng(7)
    rows = np.stack([logits_for(kind, rng) for _ in range(3)]).astype(np.float32)
    keep = np.asarray(
        exact_keep(
            jnp.asarray(rows.T),
            jnp.full(3, top_k, jnp.int32),
            jnp.full(3, top_p, jnp.float32),
        )
    )
    for row, mask in zip(rows, keep, strict=True):
        assert set(np.flatnonzero(mask).tolist()) == oracle_keep(row, top_k, top_p)


def _batch(rows: int, top_k: int, top_p: float, seed: int) -> SamplingBatch:
    return SamplingBatch(
        temperature=jnp.ones(rows, jnp.float32),
        top_k=jnp.full(rows, top_k, jnp.int32),
        top_p=jnp.full(rows, top_p, jnp.float32),
        seeds=jnp.arange(seed, seed + rows, dtype=jnp.uint32),
        positions=jnp.zeros(rows, jnp.int32),
        stop_ids=jnp.full((rows, 8), -1, jnp.int32),
        want_logprobs=jnp.zeros(rows, bool),
    )


@pytest.mark.parametrize(("kind", "top_k", "top_p"), CASES)
def test_sampled_tokens_stay_in_the_exact_set(kind: str, top_k: int, top_p: float) -> None:
    rng = np.random.default_rng(11)
    row = logits_for(kind, rng).astype(np.float32)
    allowed = oracle_keep(row, top_k, top_p)
    draws = 64
    logits = jnp.asarray(np.repeat(row[:, None], draws, axis=1))  # [V, S]: one row, 64 seeds
    step = jax.jit(sample)
    tokens, _, _ = step(logits, _batch(draws, top_k, top_p, seed=1))
    seen = set(np.asarray(tokens).tolist())
    assert seen <= allowed
    # The draws are spread over the set, not stuck on its best token.
    assert len(seen) >= min(len(allowed), 8)


def test_a_batch_mixes_exact_paths_per_row() -> None:
    """Rows that need the whole-vocabulary cut (more than one group of them),
    rows cut among the candidates, free draws and a greedy row: each row's
    token is what it gets alone (the path a row takes is its own)."""
    rng = np.random.default_rng(3)
    kinds = ["flat"] * (BEYOND_ROWS + 2) + ["peaked", "peaked", "peaked"]
    rows = [logits_for(kind, rng) for kind in kinds]
    logits = jnp.asarray(np.stack(rows, axis=1).astype(np.float32))
    n = len(rows)
    top_k = jnp.asarray([0] * (BEYOND_ROWS + 2) + [5, 0, 0], jnp.int32)
    top_p = jnp.asarray([0.9] * (BEYOND_ROWS + 2) + [1.0, 1.0, 1.0], jnp.float32)
    temperature = jnp.asarray([1.0] * (n - 1) + [0.0], jnp.float32)
    batch = _batch(n, 0, 1.0, seed=5)._replace(top_k=top_k, top_p=top_p, temperature=temperature)
    together, _, _ = jax.jit(sample)(logits, batch)
    for i in range(n):
        alone_batch = SamplingBatch(*(field[i : i + 1] for field in batch))
        alone, _, _ = jax.jit(sample)(logits[:, i : i + 1], alone_batch)
        assert int(alone[0]) == int(together[i]), i
        if i < BEYOND_ROWS + 2:
            assert int(alone[0]) in oracle_keep(rows[i].astype(np.float32), 0, 0.9)
    assert int(together[-1]) == int(np.argmax(rows[-1]))  # greedy
