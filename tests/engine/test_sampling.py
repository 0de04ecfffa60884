"""Choosing tokens on the device against numpy oracles: top-k and top-p exact
over the whole vocabulary (the set a sampled token comes from equals a sort's,
whether the cut falls among the candidates or beyond them), logit biases,
min_tokens' masking, min_p, the penalties, the top logprobs and structured
output's token bitmasks."""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvd.engine.sampling import (
    BEYOND_ROWS,
    CANDIDATE_GROUPS,
    CANDIDATES,
    COLUMNS,
    DRAW_ROWS,
    MAX_LOGIT_BIAS,
    MAX_STOP_IDS,
    MAX_TOP_LOGPROBS,
    SamplingBatch,
    adjusted_logits,
    block_size,
    exact_keep,
    first_argmax,
    sample,
    sampling_batch,
    top_candidates,
    uniforms,
)
from kvd.sched.constraint import allowed_tokens, mask_words

VOCAB = 1024


def log_softmax(x: np.ndarray) -> np.ndarray:
    """Over the vocabulary axis (the last) of ``[S, V]`` logits."""
    shifted = x - x.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


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


def test_top_candidates_in_stages_are_top_k() -> None:
    """The staged selection (blocks with the best maxima, then finer blocks)
    gives top_k's values and tokens: on a vocabulary large enough to take
    the stages, with ties everywhere and with nearly every token at -inf."""
    rng = np.random.default_rng(4)
    vocab = 131_072  # 512 blocks of 256: the stages run
    rows = np.stack(
        [
            rng.normal(0, 1, vocab),
            rng.integers(-4, 4, vocab).astype(np.float64),  # many equal values
            np.where(rng.random(vocab) < 0.999, -np.inf, rng.normal(0, 1, vocab)),
        ]
    ).astype(np.float32)
    values, tokens = jax.jit(lambda x: top_candidates(x, CANDIDATES))(jnp.asarray(rows))
    want_values, want_tokens = jax.lax.top_k(jnp.asarray(rows), CANDIDATES)
    np.testing.assert_array_equal(np.asarray(values), np.asarray(want_values))
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(want_tokens))


@pytest.mark.parametrize(("kind", "top_k", "top_p"), CASES)
def test_exact_keep_matches_a_sort(kind: str, top_k: int, top_p: float) -> None:
    rng = np.random.default_rng(7)
    rows = np.stack([logits_for(kind, rng) for _ in range(3)]).astype(np.float32)
    keep = np.asarray(
        exact_keep(
            jnp.asarray(rows),
            jnp.full(3, top_k, jnp.int32),
            jnp.full(3, top_p, jnp.float32),
        )
    )
    for row, mask in zip(rows, keep, strict=True):
        assert set(np.flatnonzero(mask).tolist()) == oracle_keep(row, top_k, top_p)


def _batch(rows: int, top_k: int, top_p: float, seed: int) -> SamplingBatch:
    return sampling_batch(
        rows,
        temperature=jnp.ones(rows, jnp.float32),
        top_k=jnp.full(rows, top_k, jnp.int32),
        top_p=jnp.full(rows, top_p, jnp.float32),
        seeds=jnp.arange(seed, seed + rows, dtype=jnp.uint32),
    )


@pytest.mark.parametrize(("kind", "top_k", "top_p"), CASES)
def test_sampled_tokens_stay_in_the_exact_set(kind: str, top_k: int, top_p: float) -> None:
    rng = np.random.default_rng(11)
    row = logits_for(kind, rng).astype(np.float32)
    allowed = oracle_keep(row, top_k, top_p)
    draws = 64
    logits = jnp.asarray(np.repeat(row[None, :], draws, axis=0))  # [S, V]: one row, 64 seeds
    step = jax.jit(sample)
    tokens, *_ = step(logits, _batch(draws, top_k, top_p, seed=1))
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
    logits = jnp.asarray(np.stack(rows, axis=0).astype(np.float32))
    n = len(rows)
    top_k = jnp.asarray([0] * (BEYOND_ROWS + 2) + [5, 0, 0], jnp.int32)
    top_p = jnp.asarray([0.9] * (BEYOND_ROWS + 2) + [1.0, 1.0, 1.0], jnp.float32)
    temperature = jnp.asarray([1.0] * (n - 1) + [0.0], jnp.float32)
    batch = _batch(n, 0, 1.0, seed=5)._replace(top_k=top_k, top_p=top_p, temperature=temperature)
    together, *_ = jax.jit(sample)(logits, batch)
    for i in range(n):
        alone_batch = SamplingBatch(
            *(None if field is None else field[i : i + 1] for field in batch)
        )
        alone, *_ = jax.jit(sample)(logits[i : i + 1], alone_batch)
        assert int(alone[0]) == int(together[i]), i
        if i < BEYOND_ROWS + 2:
            assert int(alone[0]) in oracle_keep(rows[i].astype(np.float32), 0, 0.9)
    assert int(together[-1]) == int(np.argmax(rows[-1]))  # greedy


def test_logit_bias_moves_greedy_and_sampled_choices_as_numpy_does() -> None:
    """Biases are added to the logits before any choice (numpy's argmax of the
    biased logits); rows without biases are untouched; the logprobs stay the
    model's own."""
    rng = np.random.default_rng(21)
    rows = 4
    logits = rng.normal(0, 3, (rows, VOCAB)).astype(np.float32)
    ids = np.full((rows, MAX_LOGIT_BIAS), -1, np.int32)
    biases = np.zeros((rows, MAX_LOGIT_BIAS), np.float32)
    best = logits.argmax(axis=1)
    ids[0, :2], biases[0, :2] = [17, 500], [100.0, 3.5]  # forced
    ids[1, :1], biases[1, :1] = [best[1]], [-100.0]  # banned: the runner-up wins
    ids[2, :MAX_LOGIT_BIAS] = rng.choice(VOCAB, MAX_LOGIT_BIAS, replace=False)
    biases[2] = rng.uniform(-5, 5, MAX_LOGIT_BIAS)  # a full table of small ones
    batch = sampling_batch(
        rows,
        bias_ids=jnp.asarray(ids),
        biases=jnp.asarray(biases),
        want_logprobs=jnp.ones(rows, bool),
    )
    tokens, logprobs, *_ = jax.jit(sample)(jnp.asarray(logits), batch)
    biased = logits.copy()
    for r in range(rows):
        for token, bias in zip(ids[r], biases[r], strict=True):
            if token >= 0:
                biased[r, token] += bias
    np.testing.assert_array_equal(np.asarray(tokens), biased.argmax(axis=1))
    assert int(tokens[0]) == 17 and int(tokens[3]) == int(best[3])
    peak = logits.max(1, keepdims=True)
    own = logits - np.log(np.exp(logits - peak).sum(1, keepdims=True)) - peak
    np.testing.assert_allclose(
        np.asarray(logprobs), own[range(rows), np.asarray(tokens)], atol=1e-5
    )


@pytest.mark.parametrize("adjusted", [1, 5])
def test_a_few_adjusted_rows_choose_apart_as_the_whole_batch_would(
    adjusted: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a few rows adjusted, those rows are gathered, adjusted and chosen
    from apart; with every row adjusted (here by biases of zero, which
    change nothing) the batch's logits are adjusted whole. Greedy and drawn
    rows, cut or not, choose the same tokens both ways, and an adjusted row
    its adjustment's token."""
    rng = np.random.default_rng(31)
    rows = 12  # more than ADJUSTED_ROWS[-1]: the whole batch is the other path
    logits = np.stack([logits_for(("peaked", "flat")[r % 2], rng) for r in range(rows)])
    at = rng.choice(rows, adjusted, replace=False)
    history = rng.integers(0, VOCAB, (rows, 64)).astype(np.int32)
    ids = np.full((rows, MAX_LOGIT_BIAS), -1, np.int32)
    biases = np.zeros((rows, MAX_LOGIT_BIAS), np.float32)
    ids[at, 0], biases[at, 0] = rng.integers(0, VOCAB, adjusted), 40.0
    repetition = np.ones(rows, np.float32)
    repetition[at[0]] = 1.5

    def batch(every: bool) -> SamplingBatch:
        table = ids.copy()
        if every:
            table[:, 1] = 0  # a bias of zero: the row is adjusted, its logits unchanged
        return sampling_batch(
            rows,
            temperature=jnp.asarray([0.0, 1.0, 0.7, 1.0] * 3, jnp.float32),
            top_k=jnp.asarray([0, 0, 0, 5] * 3, jnp.int32),
            top_p=jnp.asarray([1.0, 1.0, 0.9, 1.0] * 3, jnp.float32),
            seeds=jnp.arange(rows, dtype=jnp.uint32) + 7,
            positions=jnp.full(rows, 64, jnp.int32),
            bias_ids=jnp.asarray(table),
            biases=jnp.asarray(biases),
            history=jnp.asarray(history),
            prompt_end=jnp.full(rows, 32, jnp.int32),
            repetition=jnp.asarray(repetition),
        )

    import kvd.engine.sampling as sampling

    monkeypatch.setattr(sampling, "APART_BYTES", 0)  # these logits are small
    # A function of its own: a trace of ``sample`` made with the constant
    # patched must not serve other tests.
    step = jax.jit(lambda logits, batch: sample(logits, batch))
    apart = np.asarray(step(jnp.asarray(logits, jnp.float32), batch(False))[0])
    whole = np.asarray(step(jnp.asarray(logits, jnp.float32), batch(True))[0])
    np.testing.assert_array_equal(apart, whole)
    # Each adjusted row's bias outweighs the rest of its logits, its penalty
    # included: that token, greedy or drawn, cut or not.
    np.testing.assert_array_equal(apart[at], ids[at, 0])


def test_min_tokens_masks_end_tokens_and_stop_ids_until_its_position() -> None:
    """A row short of its min_end never samples an end token or one of its stop
    ids, greedy or drawn, however likely; from min_end on it may."""
    rows = 6
    logits = np.zeros((rows, VOCAB), np.float32)
    logits[:, 5] = 50.0  # an end token of the model, by far the most likely
    logits[:, 9] = 40.0  # a stop id of the rows, next
    logits[:, 11] = 30.0
    stop_ids = np.full((rows, MAX_STOP_IDS), -1, np.int32)
    stop_ids[:, 0] = 9
    positions = jnp.asarray([3, 3, 3, 7, 8, 3], jnp.int32)
    min_end = jnp.asarray([4, 4, 0, 8, 8, 4], jnp.int32)
    temperature = jnp.asarray([0, 1, 0, 0, 0, 1], jnp.float32)
    batch = sampling_batch(
        rows,
        stop_ids=jnp.asarray(stop_ids),
        positions=positions,
        min_end=min_end,
        temperature=temperature,
        seeds=jnp.arange(rows, dtype=jnp.uint32),
    )
    step = jax.jit(partial(sample, end_ids=(5, 6)))
    tokens, *_ = step(jnp.asarray(logits), batch)
    assert np.asarray(tokens).tolist() == [11, 11, 5, 11, 5, 11]
    logits[:, 5] = 0.0  # now the stop id leads: sampled where it is no longer masked
    tokens, *_ = step(jnp.asarray(logits), batch)
    assert np.asarray(tokens).tolist() == [11, 11, 9, 11, 9, 11]


@pytest.mark.parametrize(("min_p", "top_k"), [(0.05, 0), (0.3, 0), (0.05, 3)])
def test_min_p_draws_stay_in_numpys_set(min_p: float, top_k: int) -> None:
    """min_p keeps the tokens at least ``min_p`` times as likely as the best
    (after the temperature), before top-k; every draw stays in that set, and
    the draws cover it."""
    rng = np.random.default_rng(5)
    row = logits_for("peaked", rng).astype(np.float32)
    row[rng.choice(VOCAB, 6, replace=False)] = row.max() - rng.uniform(0, 4, 6)
    temperature = 0.7
    scaled = row / temperature
    probs = np.exp(scaled - scaled.max())
    allowed = set(np.flatnonzero(probs >= min_p).tolist())
    if top_k:
        allowed &= set(np.argsort(-scaled)[:top_k].tolist())
    draws = 128
    batch = sampling_batch(
        draws,
        temperature=jnp.full(draws, temperature, jnp.float32),
        top_k=jnp.full(draws, top_k, jnp.int32),
        seeds=jnp.arange(draws, dtype=jnp.uint32),
        min_p=jnp.full(draws, min_p, jnp.float32),
    )
    logits = jnp.asarray(np.repeat(row[None, :], draws, axis=0))
    tokens, *_ = jax.jit(sample)(logits, batch)
    seen = set(np.asarray(tokens).tolist())
    assert seen <= allowed
    assert len(seen) >= min(len(allowed), 3)


def test_top_logprobs_are_numpys_best_tokens_of_the_log_softmax() -> None:
    """The alternatives are the model's most likely tokens, best first, with
    their log-softmax values (before biases), for the rows that ask; a row
    that does not, or a batch where none asks, gets zeros (the pass is
    skipped)."""
    rng = np.random.default_rng(8)
    rows = 3
    logits = rng.normal(0, 2, (rows, VOCAB)).astype(np.float32)
    bias_ids = np.full((rows, MAX_LOGIT_BIAS), -1, np.int32)
    bias_ids[0, 0] = 3
    biases = np.zeros((rows, MAX_LOGIT_BIAS), np.float32)
    biases[0, 0] = 100.0
    batch = sampling_batch(
        rows,
        top_count=jnp.asarray([20, 0, 5], jnp.int32),
        bias_ids=jnp.asarray(bias_ids),
        biases=jnp.asarray(biases),
    )
    step = jax.jit(sample)
    _, _, ids, values = step(jnp.asarray(logits), batch)
    shifted = logits - logits.max(1, keepdims=True)
    log_softmax = shifted - np.log(np.exp(shifted).sum(1, keepdims=True))
    for r in (0, 2):
        best = np.argsort(-log_softmax[r], kind="stable")[:MAX_TOP_LOGPROBS]
        assert np.asarray(ids)[r].tolist() == best.tolist()
        np.testing.assert_allclose(np.asarray(values)[r], log_softmax[r, best], atol=1e-5)
    assert not np.asarray(ids)[1].any() and not np.asarray(values)[1].any()
    _, _, ids, values = step(jnp.asarray(logits), sampling_batch(rows))
    assert not np.asarray(ids).any() and not np.asarray(values).any()


@pytest.mark.parametrize("asking", [[], [7], [0, 4, 9], [1, 2, 3, 5, 6], list(range(10))])
def test_logprobs_are_computed_for_the_rows_that_ask_whatever_their_number(
    asking: list[int],
) -> None:
    """However many rows ask (none, one, a few gathered apart, all), each gets
    the log-softmax of its chosen token and of its best tokens, and the
    others get zeros."""
    rng = np.random.default_rng(len(asking))
    rows = 10
    logits = rng.normal(0, 2, (rows, VOCAB)).astype(np.float32)
    wants = np.isin(np.arange(rows), asking)
    batch = sampling_batch(
        rows,
        want_logprobs=jnp.asarray(wants),
        top_count=jnp.asarray(np.where(wants, 5, 0), jnp.int32),
    )
    tokens, logprobs, ids, values = jax.jit(sample)(jnp.asarray(logits), batch)
    own = log_softmax(logits.astype(np.float64))
    for r in range(rows):
        if r in asking:
            best = np.argsort(-own[r], kind="stable")[:MAX_TOP_LOGPROBS]
            assert np.asarray(ids)[r].tolist() == best.tolist()
            np.testing.assert_allclose(np.asarray(values)[r], own[r, best], atol=1e-5)
            assert abs(float(logprobs[r]) - own[r, int(tokens[r])]) < 1e-5
        else:
            assert float(logprobs[r]) == 0.0 and not np.asarray(ids)[r].any()


def penalized_oracle(
    logits: np.ndarray,
    history: np.ndarray,
    prompt_end: np.ndarray,
    positions: np.ndarray,
    penalties: list[tuple[float, float, float]],
) -> np.ndarray:
    """vLLM's apply_penalties in numpy, row by row of ``[S, V]`` logits:
    (presence, frequency, repetition) per row, over the history's tokens
    below its position."""
    out = logits.astype(np.float64).copy()
    for r, (presence, frequency, repetition) in enumerate(penalties):
        tokens = history[r, : positions[r]]
        prompt, generated = tokens[: prompt_end[r]], tokens[prompt_end[r] :]
        counts = np.bincount(generated, minlength=logits.shape[1])
        seen = np.zeros(logits.shape[1], bool)
        seen[prompt] = True
        seen[generated] = True
        row = out[r]
        factor = np.where(seen, repetition, 1.0)
        row[:] = np.where(row > 0, row / factor, row * factor)
        row -= frequency * counts + presence * (counts > 0)
    return out


def test_penalties_give_numpys_next_token_distribution() -> None:
    """Each penalty alone and all together: the log-softmax of the adjusted
    logits (the distribution a token is drawn from, and the greedy choice)
    equals the numpy oracle's within 1e-5; prompt tokens count for the
    repetition penalty only, tokens at or past a row's position not at all,
    and a row without penalties is left bit for bit."""
    rng = np.random.default_rng(13)
    penalties = [
        (0.0, 0.0, 1.0),  # none: untouched
        (1.5, 0.0, 1.0),  # presence
        (0.0, 0.7, 1.0),  # frequency
        (0.0, 0.0, 1.8),  # repetition
        (-1.0, 2.0, 0.6),  # all, negative presence and a repetition below 1
        (2.0, -2.0, 10.0),
    ]
    rows, width = len(penalties), 96
    logits = rng.normal(0, 3, (rows, VOCAB)).astype(np.float32)
    # Histories drawn from a few tokens, so tokens repeat in prompt and output.
    history = rng.choice(rng.choice(VOCAB, 24, replace=False), (rows, width)).astype(np.int32)
    prompt_end = rng.integers(1, 40, rows).astype(np.int32)
    positions = (prompt_end + rng.integers(0, 50, rows)).astype(np.int32)
    history[np.arange(width)[None, :] >= positions[:, None] + 5] = -1  # padding past the end
    presence, frequency, repetition = (
        np.asarray(p, np.float32) for p in zip(*penalties, strict=True)
    )
    batch = sampling_batch(
        rows,
        history=jnp.asarray(history),
        prompt_end=jnp.asarray(prompt_end),
        positions=jnp.asarray(positions),
        presence=jnp.asarray(presence),
        frequency=jnp.asarray(frequency),
        repetition=jnp.asarray(repetition),
        want_logprobs=jnp.ones(rows, bool),
    )
    adjusted = np.asarray(jax.jit(adjusted_logits)(jnp.asarray(logits), batch))
    want = penalized_oracle(logits, history, prompt_end, positions, penalties)
    np.testing.assert_allclose(log_softmax(adjusted), log_softmax(want), atol=1e-5)
    np.testing.assert_array_equal(adjusted[0], logits[0])
    tokens, logprobs, *_ = jax.jit(sample)(jnp.asarray(logits), batch)
    assert np.asarray(tokens).tolist() == want.argmax(axis=1).tolist()
    own = log_softmax(logits.astype(np.float64))  # reported logprobs: the model's own
    np.testing.assert_allclose(
        np.asarray(logprobs), own[range(rows), np.asarray(tokens)], atol=1e-5
    )
    # Prompt tokens do not count for frequency and presence: a row whose
    # history is all prompt is changed by repetition alone.
    only_prompt = sampling_batch(
        1,
        history=jnp.asarray(history[:1]),
        prompt_end=jnp.asarray(positions[:1]),
        positions=jnp.asarray(positions[:1]),
        presence=jnp.asarray([2.0], jnp.float32),
        frequency=jnp.asarray([2.0], jnp.float32),
    )
    np.testing.assert_array_equal(
        np.asarray(jax.jit(adjusted_logits)(jnp.asarray(logits[:1]), only_prompt)),
        logits[:1],
    )


def test_a_grammars_bitmask_allows_only_its_tokens() -> None:
    """Structured output's masks: a row samples only what its bitmask allows
    (greedy: numpy's argmax over the allowed; drawn, top-k or top-p: always
    among them), an all-ones row is untouched, and the logprobs stay the
    model's own."""
    rng = np.random.default_rng(5)
    rows = 4
    logits = rng.normal(0, 3, (rows, VOCAB)).astype(np.float32)
    allowed = [
        np.array([5, 17, 999]),
        np.arange(VOCAB),  # all ones: a row without a grammar
        np.array([3]),
        np.flatnonzero(rng.random(VOCAB) < 0.5),
    ]
    masks = np.zeros((rows, mask_words(VOCAB)), np.int32)
    for r, ids in enumerate(allowed):
        bits = np.zeros(mask_words(VOCAB) * 32, np.uint8)
        bits[ids] = 1
        masks[r] = np.packbits(bits, bitorder="little").view(np.int32)
        np.testing.assert_array_equal(allowed_tokens(masks[r], VOCAB), ids)
    assert (masks[1] == -1).all()
    batch = sampling_batch(rows, allowed=jnp.asarray(masks), want_logprobs=jnp.ones(rows, bool))
    tokens, logprobs, *_ = jax.jit(sample)(jnp.asarray(logits), batch)
    expected = [int(ids[logits[r, ids].argmax()]) for r, ids in enumerate(allowed)]
    assert np.asarray(tokens).tolist() == expected
    peak = logits.max(1, keepdims=True)
    own = logits - np.log(np.exp(logits - peak).sum(1, keepdims=True)) - peak
    np.testing.assert_allclose(np.asarray(logprobs), own[range(rows), expected], atol=1e-5)
    draw = jax.jit(sample)
    for seed in range(40):
        batch = sampling_batch(
            rows,
            allowed=jnp.asarray(masks),
            temperature=jnp.full(rows, 2.0),
            top_k=jnp.asarray([0, 0, 50, 0], jnp.int32),
            top_p=jnp.asarray([1.0, 1.0, 1.0, 0.9], jnp.float32),
            seeds=jnp.full(rows, seed, jnp.uint32),
        )
        drawn = np.asarray(draw(jnp.asarray(logits), batch)[0])
        for r in (0, 2, 3):
            assert int(drawn[r]) in set(allowed[r].tolist()), (seed, r, int(drawn[r]))


def test_first_argmax_is_argmax_with_ties_and_masks() -> None:
    """The blockwise argmax picks what ``argmax`` picks: the first of equal
    maxima, a row all masked to -inf included; a NaN row gives an
    in-range index."""
    rng = np.random.default_rng(7)
    values = rng.integers(-3, 4, (9, 1000)).astype(np.float32)  # many ties
    values[3] = -np.inf
    values[4] = rng.standard_normal(1000)
    values[5, [10, 900]] = 50.0  # two equal maxima: the first wins
    picked = np.asarray(jax.jit(first_argmax)(jnp.asarray(values)))
    np.testing.assert_array_equal(picked, np.argmax(values, axis=1))
    assert picked[5] == 10
    values[6, 17] = np.nan
    assert 0 <= int(jax.jit(first_argmax)(jnp.asarray(values))[6]) < 1000


def test_first_argmax_finds_ties_across_blocks() -> None:
    """Equal maxima in different blocks: the first block's wins, and within
    it the first entry."""
    vocab = 64 * block_size(1 << 16)
    values = np.zeros((3, vocab), np.float32)
    values[0, [70_000 % vocab, 5_000, 5_001]] = 9.0
    values[1, vocab - 1] = 1.0
    values[2, [3, 2]] = 4.0
    picked = np.asarray(jax.jit(first_argmax)(jnp.asarray(values)))
    np.testing.assert_array_equal(picked, np.argmax(values, axis=1))


def test_first_argmax_with_ties_within_and_across_columns() -> None:
    """Equal maxima in one column (the earlier entry wins without a second
    pass), in several columns (the second pass), and none, on a vocabulary
    of many columns; a batch with no tie and a batch with one agree on the
    rows without."""
    columns = COLUMNS
    vocab = 64 * columns
    rng = np.random.default_rng(11)
    values = rng.standard_normal((6, vocab)).astype(np.float32)
    values[0, [7 + 5 * columns, 7 + 2 * columns]] = 9.0  # one column, two entries
    values[1, [columns - 1, 3 * columns]] = 9.0  # two columns: the later column first
    values[2, [vocab - 1]] = 9.0  # the very last entry
    values[3, [0]] = 9.0
    values[4, :] = -np.inf
    argmax = jax.jit(first_argmax)
    np.testing.assert_array_equal(np.asarray(argmax(jnp.asarray(values))), np.argmax(values, 1))
    untied = np.delete(values, [1, 4], axis=0)
    np.testing.assert_array_equal(np.asarray(argmax(jnp.asarray(untied))), np.argmax(untied, 1))


def _chi_square_ok(tokens: np.ndarray, probs: np.ndarray) -> tuple[float, float]:
    """(statistic, bound): Pearson's chi-square of ``tokens`` against
    ``probs``, over bins of tokens (likeliest first) that each expect at least
    20 draws, and its 1-in-10,000 quantile (Wilson-Hilferty)."""
    draws = len(tokens)
    counts = np.bincount(tokens, minlength=len(probs))
    bins_seen, bins_expected = [], []
    seen = expected = 0.0
    for t in np.argsort(-probs, kind="stable"):
        seen += counts[t]
        expected += probs[t] * draws
        if expected >= 20:
            bins_seen.append(seen)
            bins_expected.append(expected)
            seen = expected = 0.0
    bins_seen[-1] += seen
    bins_expected[-1] += expected
    observed, wanted = np.asarray(bins_seen), np.asarray(bins_expected)
    statistic = float(((observed - wanted) ** 2 / wanted).sum())
    k = len(wanted) - 1
    z = 3.72  # the normal's 1-in-10,000 upper quantile
    bound = k * (1 - 2 / (9 * k) + z * np.sqrt(2 / (9 * k))) ** 3
    return statistic, float(bound)


DRAW_VOCAB = 16 * 1024  # blocks enough that the candidates leave most of them out


_SAMPLE = jax.jit(sample)  # one program for the draws below (their shapes are one)


def _softmax_draws(
    row: np.ndarray,
    temperature: float,
    min_p: float,
    calls: int = 24,
    rows: int = 512,
    step: Any = None,
) -> np.ndarray:
    """Tokens drawn for ``row`` of logits, ``calls`` x ``rows`` times: each
    a different seed and position (``step``: the jitted sampler to use)."""
    logits = jnp.asarray(np.repeat(row[None, :], rows, axis=0))
    step = step or _SAMPLE
    drawn = []
    for call in range(calls):
        batch = sampling_batch(
            rows,
            temperature=jnp.full(rows, temperature, jnp.float32),
            min_p=jnp.full(rows, min_p, jnp.float32),
            seeds=jnp.full(rows, call, jnp.uint32),
            positions=jnp.arange(rows, dtype=jnp.int32),
        )
        drawn.append(np.asarray(step(logits, batch)[0]))
    return np.concatenate(drawn)


def _draw_rows(kind: str) -> np.ndarray:
    rng = np.random.default_rng(17)
    if kind == "peaked":  # a few tokens hold most of the mass, the rest a share
        row = rng.normal(0, 1, DRAW_VOCAB)
        row[rng.choice(DRAW_VOCAB, 12, replace=False)] += rng.uniform(5, 9, 12)
    elif kind == "flat":  # the mass spread over every block: many proposals refused
        row = rng.normal(0, 1, DRAW_VOCAB)
    else:  # "spiky": more heavy blocks than candidates
        row = rng.normal(0, 0.5, DRAW_VOCAB)
        row[rng.choice(DRAW_VOCAB, 4 * CANDIDATE_GROUPS, replace=False)] += 6
    return row.astype(np.float32)


@pytest.mark.parametrize(
    ("kind", "temperature", "min_p"),
    [("peaked", 1.0, 0.0), ("flat", 1.0, 0.0), ("spiky", 0.7, 0.0), ("peaked", 1.3, 0.01)],
)
def test_temperature_draws_follow_the_softmax(kind: str, temperature: float, min_p: float) -> None:
    """Temperature draws (the rejection sampler over blocks) against the
    exact softmax of the logits over the temperature, min_p's cut applied:
    a chi-square over 12,288 draws. It fails a sampler that drops the tail,
    the proposals' bounds, or min_p (tested: a draw from the candidates
    alone fails every case)."""
    row = _draw_rows(kind)
    scaled = row.astype(np.float64) / temperature
    probs = np.exp(scaled - scaled.max())
    probs[probs < min_p] = 0.0
    probs /= probs.sum()
    tokens = _softmax_draws(row, temperature, min_p)
    assert probs[tokens].min() > 0  # nothing min_p drops
    statistic, bound = _chi_square_ok(tokens, probs)
    assert statistic < bound, (statistic, bound)


@pytest.mark.parametrize(("top_k", "top_p"), [(CANDIDATES + 200, 1.0), (0, 0.9)])
def test_cuts_beyond_the_candidates_draw_the_renormalised_softmax(top_k: int, top_p: float) -> None:
    """Rows whose cut falls beyond the candidates (a top-k larger than them,
    a nucleus of a flat distribution) draw by Gumbel-max over the kept set
    of the whole vocabulary: a chi-square over 12,288 draws against the
    softmax renormalised over vLLM's set."""
    row = np.random.default_rng(23).normal(0, 0.5, VOCAB).astype(np.float32)
    kept = sorted(oracle_keep(row, top_k, top_p))
    assert len(kept) > CANDIDATES  # the path under test
    probs = np.zeros(VOCAB)
    probs[kept] = np.exp(row[kept].astype(np.float64) - row.max())
    probs /= probs.sum()
    rows, drawn = 512, []
    logits = jnp.asarray(np.repeat(row[None, :], rows, axis=0))
    for call in range(24):
        batch = sampling_batch(
            rows,
            temperature=jnp.ones(rows, jnp.float32),
            top_k=jnp.full(rows, top_k, jnp.int32),
            top_p=jnp.full(rows, top_p, jnp.float32),
            seeds=jnp.full(rows, call, jnp.uint32),
            positions=jnp.arange(rows, dtype=jnp.int32),
        )
        drawn.append(np.asarray(_SAMPLE(logits, batch)[0]))
    tokens = np.concatenate(drawn)
    assert probs[tokens].min() > 0  # nothing outside the set
    statistic, bound = _chi_square_ok(tokens, probs)
    assert statistic < bound, (statistic, bound)


@pytest.mark.parametrize("rows", [DRAW_ROWS, 512])
def test_draws_refused_too_often_end_on_exact_masses(
    rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no second proposal allowed, rows whose first is refused take
    their draw from every entry's exact weight, summed by blocks in one
    reduction (one group of DRAW_ROWS rows, or a loop of them): the
    distribution stays the softmax's, with min_p's cut."""
    import kvd.engine.sampling as sampling

    monkeypatch.setattr(sampling, "PROPOSALS", 1)
    row = _draw_rows("flat")
    probs = np.exp(row.astype(np.float64) - row.max())
    probs[probs < 0.05] = 0.0
    probs /= probs.sum()
    # A function of its own: JAX keeps traces by function, and a trace of
    # ``sample`` made with the constant patched would serve other tests.
    patched = jax.jit(lambda logits, batch: sample(logits, batch))
    draws = _softmax_draws(row, 1.0, 0.05, calls=8192 // rows, rows=rows, step=patched)
    assert probs[draws].min() > 0
    statistic, bound = _chi_square_ok(draws, probs)
    assert statistic < bound, (statistic, bound)


def test_rows_that_keep_no_early_proposal_draw_from_the_later_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With one early proposal, most rows of flat logits keep none of it
    and take their draw from the later proposals, made for the batch only
    then: the distribution stays the softmax's, and a row that kept its
    early proposal keeps its token whatever the rest of its batch did."""
    import kvd.engine.sampling as sampling

    monkeypatch.setattr(sampling, "EARLY_PROPOSALS", 1)
    row = _draw_rows("flat")
    probs = np.exp(row.astype(np.float64) - row.max())
    probs /= probs.sum()
    patched = jax.jit(lambda logits, batch: sample(logits, batch))  # see above
    draws = _softmax_draws(row, 1.0, 0.0, step=patched)
    statistic, bound = _chi_square_ok(draws, probs)
    assert statistic < bound, (statistic, bound)
    # A row that kept its early proposal draws the same token whether or
    # not another row of its batch made the later ones.
    logits = jnp.asarray(np.stack([_draw_rows("peaked"), row], axis=0))
    for seed in range(16):
        batch = sampling_batch(
            2,
            temperature=jnp.ones(2, jnp.float32),
            seeds=jnp.asarray([seed, seed + 100], jnp.uint32),
            positions=jnp.asarray([seed, seed], jnp.int32),
        )
        together = np.asarray(patched(logits, batch)[0])
        alone_batch = SamplingBatch(*(None if field is None else field[:1] for field in batch))
        alone = np.asarray(patched(logits[:1], alone_batch)[0])
        assert int(alone[0]) == int(together[0]), seed


def test_uniforms_made_in_part_are_those_made_whole() -> None:
    """A draw makes its later proposals' numbers only when it needs them:
    they are the same as when all are made at once, and differ by lane,
    row, position and seed."""
    seeds = jnp.asarray([1, 1, 2], jnp.uint32)
    positions = jnp.asarray([5, 6, 5], jnp.int32)
    whole = np.asarray(uniforms(seeds, positions, jnp.int32(0), 515))
    part = np.asarray(uniforms(seeds, positions, jnp.int32(0), 515, (256, 515)))
    np.testing.assert_array_equal(whole[:, 256:], part)
    assert len(np.unique(whole)) > 0.99 * whole.size
    assert whole.min() >= 0.0 and whole.max() < 1.0


def test_an_exact_draw_is_the_rows_own_whatever_the_batch_width() -> None:
    """A row that ends in the exact pass draws the same token alone as in a
    batch wider than DRAW_ROWS, whose groups of rows the exact pass weighs
    in turn, the last overlapping the one before (rows drawn twice)."""
    width = DRAW_ROWS + 4
    rows = [_draw_rows(("flat", "peaked", "spiky")[i % 3]) for i in range(width)]
    logits = jnp.asarray(np.stack(rows, axis=0))
    batch = sampling_batch(
        width,
        temperature=jnp.full(width, 1.0, jnp.float32),
        seeds=jnp.arange(width, dtype=jnp.uint32) + 40,
        positions=jnp.arange(width, dtype=jnp.int32),
    )
    together = np.asarray(_SAMPLE(logits, batch)[0])
    for i in range(0, width, 3):  # the flat rows: the exact pass
        alone_batch = SamplingBatch(
            *(None if field is None else field[i : i + 1] for field in batch)
        )
        alone = np.asarray(jax.jit(sample)(logits[i : i + 1], alone_batch)[0])
        assert int(alone[0]) == int(together[i]), i


def test_a_rows_draw_is_its_own_whatever_the_batch() -> None:
    """A temperature row draws the same token alone as beside other rows,
    whether those are greedy or drawing (and whether they are refused)."""
    rows = [_draw_rows(kind) for kind in ("flat", "peaked", "spiky", "flat")]
    logits = jnp.asarray(np.stack(rows, axis=0))
    batch = sampling_batch(
        4,
        temperature=jnp.asarray([1.0, 0.0, 0.7, 1.0], jnp.float32),
        seeds=jnp.asarray([3, 4, 5, 6], jnp.uint32),
        positions=jnp.asarray([10, 11, 12, 13], jnp.int32),
    )
    together = np.asarray(jax.jit(sample)(logits, batch)[0])
    for i in range(4):
        alone_batch = SamplingBatch(
            *(None if field is None else field[i : i + 1] for field in batch)
        )
        alone = np.asarray(jax.jit(sample)(logits[i : i + 1], alone_batch)[0])
        assert int(alone[0]) == int(together[i]), i
    assert int(together[1]) == int(np.argmax(rows[1]))
