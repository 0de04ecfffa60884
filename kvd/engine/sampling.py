"""Choosing the next token on the device: greedy, temperature, top-k, top-p.

Per-sequence parameters ride along as arrays, so one compiled step serves a
batch that mixes greedy and sampled requests. Randomness is reproducible per
request: the key is the request's seed folded with the token's position, so a
sequence samples the same tokens whatever it is batched with and however
often it is preempted and resumed.

Top-k and top-p are exact over the whole vocabulary, as vLLM applies them
(top-k, then top-p over what it leaves). A full sort of a 262,144-token
vocabulary per sequence per step costs more than the rest of the step on a
CPU, so the cut is made among the ``CANDIDATES`` most likely tokens whenever
it falls there (top-k up to that many; a nucleus they hold, judged with the
whole vocabulary's normaliser); a row whose cut falls beyond them (a larger
top-k, a flat distribution) is cut by thresholds found by bisection over the
whole vocabulary. Pure temperature sampling uses the whole vocabulary
(Gumbel-max).

Before any of that, as vLLM orders them: logit biases are added, the end
tokens and stop ids of a row short of its ``min_tokens`` are masked, the
repetition, frequency and presence penalties are applied (from each row's
token history: counted on the device, one scatter for the batch), a
structured output's grammar masks what it does not allow, and after
the temperature, ``min_p`` drops what is less likely than its share of the
best token. Each is skipped at run time when no row of the batch asks for
it. The logprobs returned are the model's own (before these adjustments).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from kvd.sched.sampling_params import (  # re-exported: the engine's names
    MAX_LOGIT_BIAS,
    MAX_STOP_IDS,
    MAX_TEMPERATURE,
    MAX_TOP_LOGPROBS,
    MIN_TEMPERATURE,
    SamplingParams,
)

CANDIDATES = 256
BEYOND_ROWS = 4  # rows cut over the whole vocabulary at a time
__all__ = [
    "MAX_LOGIT_BIAS",
    "MAX_STOP_IDS",
    "MAX_TOP_LOGPROBS",
    "MAX_TEMPERATURE",
    "MIN_TEMPERATURE",
    "SamplingParams",
    "adjusted_logits",
    "sample",
]


class SamplingBatch(NamedTuple):
    temperature: jax.Array  # [S] f32
    top_k: jax.Array  # [S] int32, 0 = off
    top_p: jax.Array  # [S] f32
    seeds: jax.Array  # [S] uint32
    positions: jax.Array  # [S] int32 position of the token being sampled
    stop_ids: jax.Array  # [S, MAX_STOP_IDS] int32, -1 padding
    want_logprobs: jax.Array  # [S] bool
    min_p: jax.Array  # [S] f32, 0 = off
    min_end: jax.Array  # [S] int32: end tokens and stop ids are masked below this position
    bias_ids: jax.Array  # [S, MAX_LOGIT_BIAS] int32, -1 padding
    biases: jax.Array  # [S, MAX_LOGIT_BIAS] f32
    top_count: jax.Array  # [S] int32: alternatives' logprobs wanted (0: none)
    prompt_end: jax.Array  # [S] int32: history positions below this are the prompt
    presence: jax.Array  # [S] f32, 0 = off
    frequency: jax.Array  # [S] f32, 0 = off
    repetition: jax.Array  # [S] f32, 1 = off
    history: jax.Array  # [S, H] int32: the tokens at positions 0.. (read below ``positions``)
    # [S, W] int32 token bitmasks (bit t % 32 of word t // 32: token t may be
    # sampled; all ones: a row without a grammar); None: no row has one.
    allowed: jax.Array | None = None


def sampling_batch(rows: int, **fields: Any) -> SamplingBatch:
    """A batch of ``rows`` greedy rows with nothing else asked, but ``fields``."""
    neutral = {
        "temperature": jnp.zeros(rows, jnp.float32),
        "top_k": jnp.zeros(rows, jnp.int32),
        "top_p": jnp.ones(rows, jnp.float32),
        "seeds": jnp.zeros(rows, jnp.uint32),
        "positions": jnp.zeros(rows, jnp.int32),
        "stop_ids": jnp.full((rows, MAX_STOP_IDS), -1, jnp.int32),
        "want_logprobs": jnp.zeros(rows, jnp.bool_),
        "min_p": jnp.zeros(rows, jnp.float32),
        "min_end": jnp.zeros(rows, jnp.int32),
        "bias_ids": jnp.full((rows, MAX_LOGIT_BIAS), -1, jnp.int32),
        "biases": jnp.zeros((rows, MAX_LOGIT_BIAS), jnp.float32),
        "top_count": jnp.zeros(rows, jnp.int32),
        "prompt_end": jnp.zeros(rows, jnp.int32),
        "presence": jnp.zeros(rows, jnp.float32),
        "frequency": jnp.zeros(rows, jnp.float32),
        "repetition": jnp.ones(rows, jnp.float32),
        "history": jnp.full((rows, 1), -1, jnp.int32),
    }
    return SamplingBatch(**(neutral | fields))


def sample(
    logits: jax.Array, params: SamplingBatch, end_ids: tuple[int, ...] = ()
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(tokens [S], logprobs of the chosen tokens [S], and the
    ``MAX_TOP_LOGPROBS`` most likely tokens [S, K] with their logprobs [S, K],
    zeros unless some row asked) from logits ``[V, S]``: vocabulary-major, as
    the head computes them fastest.
    ``end_ids``: the model's end tokens (EOS, end of turn), masked with a
    row's stop ids until its ``min_end``. Whether a token ends its
    generation is the scheduler's decision, not made here.

    Branches that no sequence of the batch needs (random draws when all are
    greedy, the whole-vocabulary draw when all truncate, logprobs no row
    asked for) are skipped at run time with ``lax.cond``: one compiled
    program, no wasted work.
    """
    model_logits = logits
    logits = adjusted_logits(logits, params, end_ids)
    greedy = first_argmax(logits)
    tokens = jax.lax.cond(
        jnp.all(params.temperature == 0.0),
        lambda: greedy,
        lambda: jnp.where(params.temperature == 0.0, greedy, _draw(logits, params)),
    )
    top = min(MAX_TOP_LOGPROBS, logits.shape[0])

    def chosen_logprobs(columns: jax.Array, rows: jax.Array) -> jax.Array:
        picked = columns[tokens[rows], jnp.arange(rows.shape[0])]
        return picked - jax.nn.logsumexp(columns, axis=0)

    def alternatives(columns: jax.Array, rows: jax.Array) -> tuple[jax.Array, jax.Array]:
        values, ids = jax.lax.top_k(columns.T, top)  # [P, K], best first
        normaliser = jax.nn.logsumexp(columns, axis=0)
        return ids.astype(jnp.int32), values - normaliser[:, None]

    logprobs = _for_rows_asking(params.want_logprobs, model_logits, chosen_logprobs)
    top_ids, top_logprobs = _for_rows_asking(params.top_count > 0, model_logits, alternatives)
    return tokens, logprobs, top_ids, top_logprobs


def first_argmax(values: jax.Array) -> jax.Array:
    """``argmax(values, axis=0)`` (int32; the first of equal maxima) as two
    plain reductions: the largest value, then the smallest index holding it.
    XLA:CPU runs argmax's paired (value, index) reduce element by element:
    1.1 ms per decode step for the 270M's 262,144 logits, one op on one
    thread, against well under 0.1 ms for these two. An index no value
    matches (a NaN maximum) is the last token's, so it stays in range."""
    best = jnp.max(values, axis=0)
    ids = jax.lax.broadcasted_iota(jnp.int32, values.shape, 0)
    return jnp.min(jnp.where(values == best, ids, values.shape[0] - 1), axis=0)


ROW_BUCKETS = (1, 4, 8)  # rows gathered apart when only a few ask
PENALIZED_ROWS = 4  # penalized rows whose histories are applied at a time


def _for_rows_asking(asking: jax.Array, logits: jax.Array, compute: Any) -> Any:
    """``compute(columns [V, P], rows [P])`` over the columns of the rows that
    ask, its results scattered back to every row (zeros for the rest). A
    normaliser or a top-k over the vocabulary costs by the rows it reads, so
    the columns are gathered apart, P the smallest of ``ROW_BUCKETS`` (or the
    batch) that holds them (``rows`` padded with the batch size, out of
    range); nothing is read when no row asks."""
    seqs = logits.shape[1]
    buckets = [b for b in ROW_BUCKETS if b < seqs] + [seqs]

    def for_rows(width: int) -> Any:
        def run() -> Any:
            (rows,) = jnp.nonzero(asking, size=width, fill_value=seqs)
            out = compute(logits[:, jnp.minimum(rows, seqs - 1)], rows)
            return jax.tree.map(
                lambda x: jnp.zeros((seqs, *x.shape[1:]), x.dtype).at[rows].set(x, mode="drop"),
                out,
            )

        return run

    def for_some() -> Any:
        bucket = jnp.searchsorted(jnp.asarray(buckets), jnp.sum(asking))
        return jax.lax.switch(bucket, [for_rows(b) for b in buckets])

    def for_none() -> Any:
        shapes = jax.eval_shape(for_rows(1))
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

    return jax.lax.cond(jnp.any(asking), for_some, for_none)


def adjusted_logits(
    logits: jax.Array, params: SamplingBatch, end_ids: tuple[int, ...] = ()
) -> jax.Array:
    """The logits ``[V, S]`` the choice is made from, before the temperature:
    logit biases added, end tokens and stop ids masked for rows short of
    their ``min_tokens``, then the penalties; each only when some row of the
    batch has it."""
    vocab, seqs = logits.shape
    rows = jnp.arange(seqs)

    def biased() -> jax.Array:
        ids = jnp.where(params.bias_ids < 0, vocab, params.bias_ids)  # padding: dropped
        return logits.at[ids.T, rows[None, :]].add(params.biases.T, mode="drop")

    logits = jax.lax.cond(jnp.any(params.bias_ids >= 0), biased, lambda: logits)
    early = params.positions < params.min_end

    def masked() -> jax.Array:
        ends = jnp.broadcast_to(jnp.asarray(end_ids, jnp.int32), (seqs, len(end_ids)))
        ids = jnp.concatenate([params.stop_ids, ends], axis=1)
        ids = jnp.where((ids < 0) | ~early[:, None], vocab, ids)  # dropped
        return logits.at[ids.T, rows[None, :]].set(-jnp.inf, mode="drop")

    logits = jax.lax.cond(jnp.any(early), masked, lambda: logits)
    penalized = (params.presence != 0) | (params.frequency != 0) | (params.repetition != 1)
    logits = jax.lax.cond(
        jnp.any(penalized), lambda: _penalize_rows(logits, params, penalized), lambda: logits
    )
    allowed = params.allowed
    if allowed is None:
        return logits
    return jax.lax.cond(jnp.any(allowed != -1), lambda: _constrain(logits, allowed), lambda: logits)


def _constrain(logits: jax.Array, allowed: jax.Array) -> jax.Array:
    """Tokens a row's bitmask does not allow get -inf: the bits unpacked in
    the logits' vocabulary-major order, one elementwise pass."""
    vocab = logits.shape[0]
    shifts = jnp.arange(32, dtype=jnp.int32)[None, :, None]
    bits = (allowed.T[:, None, :] >> shifts) & 1  # [W, 32, S]
    bits = bits.reshape(-1, logits.shape[1])[:vocab]
    return jnp.where(bits != 0, logits, -jnp.inf)


def _penalize_rows(logits: jax.Array, params: SamplingBatch, penalized: jax.Array) -> jax.Array:
    """The penalties of the ``penalized`` rows, ``PENALIZED_ROWS`` of them at a
    time in a loop over the logits: the gathers and scatters read those rows'
    histories only, and the logits are changed in place (XLA copies a
    ``[V, S]`` operand that a multi-way branch would change)."""
    seqs = logits.shape[1]
    width = min(PENALIZED_ROWS, seqs)
    groups = -(-seqs // width)
    (rows,) = jnp.nonzero(penalized, size=groups * width, fill_value=seqs)

    def one_group(i: jax.Array, logits: jax.Array) -> jax.Array:
        return _penalize(logits, params, jax.lax.dynamic_slice(rows, (i * width,), (width,)))

    trips = (jnp.sum(penalized) + width - 1) // width
    return jax.lax.fori_loop(0, trips, one_group, logits)


def _penalize(logits: jax.Array, params: SamplingBatch, rows: jax.Array) -> jax.Array:
    """vLLM's penalties over vocabulary-major logits ``[V, S]``, for ``rows``
    (out of range: padding): a token seen in the prompt or the output has a
    positive logit divided by the repetition penalty and a negative one
    multiplied; then each generated occurrence takes the frequency penalty
    off, and having occurred at all the presence penalty. Sparse: gathers and
    scatters at those rows' history tokens below their ``positions``, never a
    dense ``[V, S]`` count, nor the other rows' histories."""
    vocab, seqs = logits.shape
    valid = rows < seqs
    at_row = jnp.minimum(rows, seqs - 1)
    history = params.history[at_row]  # [P, H]
    where = jnp.arange(history.shape[1])[None, :]
    known = (where < params.positions[at_row][:, None]) & valid[:, None]
    generated = known & (where >= params.prompt_end[at_row][:, None])
    columns = rows[None, :]  # [1, P]; out of range: dropped
    seen = jnp.where(known, history, vocab).T  # [H, P]; vocab: dropped
    out = jnp.where(generated, history, vocab).T
    # Duplicates write the same value: each token is changed once.
    at = logits.at[seen, columns].get(mode="fill", fill_value=0.0)
    repetition = params.repetition[at_row][None, :]
    logits = logits.at[seen, columns].set(
        jnp.where(at > 0, at / repetition, at * repetition), mode="drop"
    )
    # Duplicates add up: the frequency penalty once per occurrence.
    frequency = params.frequency[at_row][None, :]
    logits = logits.at[out, columns].add(jnp.broadcast_to(-frequency, out.shape), mode="drop")
    at = logits.at[out, columns].get(mode="fill", fill_value=0.0)
    return logits.at[out, columns].set(at - params.presence[at_row][None, :], mode="drop")


def _min_p(scaled: jax.Array, min_p: jax.Array) -> jax.Array:
    """Scaled logits [V, S] less likely than ``min_p`` times the best token's
    probability set to -inf (rows with 0: unchanged)."""
    floor = jnp.max(scaled, axis=0) + jnp.log(jnp.maximum(min_p, 1e-30))
    return jnp.where((min_p > 0)[None, :] & (scaled < floor[None, :]), -jnp.inf, scaled)


def _draw(logits: jax.Array, params: SamplingBatch) -> jax.Array:
    """Sampled tokens [S] from vocabulary-major logits [V, S]."""
    keys = jax.vmap(lambda seed, pos: jax.random.fold_in(jax.random.key(seed), pos))(
        params.seeds, params.positions
    )
    vocab = logits.shape[0]
    scaled = logits / jnp.maximum(params.temperature, MIN_TEMPERATURE)[None, :]  # [V, S]
    scaled = jax.lax.cond(
        jnp.any(params.min_p > 0), lambda: _min_p(scaled, params.min_p), lambda: scaled
    )
    # A greedy row's draw is thrown away: it must not ask for a truncation.
    truncating = ((params.top_k > 0) | (params.top_p < 1.0)) & (params.temperature > 0)

    def whole_vocabulary() -> jax.Array:  # Gumbel-max over all V tokens
        gumbel = jax.vmap(lambda key: jax.random.gumbel(key, (vocab,)))(keys)  # [S, V]
        return first_argmax(scaled + gumbel.T)

    def truncated() -> jax.Array:
        tokens, exact = _among_candidates(scaled, params, keys)
        beyond = truncating & ~exact
        wide = jax.lax.cond(
            jnp.any(beyond),
            lambda: _beyond_candidates(scaled, params, keys, beyond),
            lambda: jnp.zeros_like(tokens),
        )
        return jnp.where(exact, tokens, wide)

    drawing = (params.temperature > 0) & ~truncating
    free = jax.lax.cond(jnp.any(drawing), whole_vocabulary, lambda: jnp.zeros_like(params.top_k))
    cut = jax.lax.cond(jnp.any(truncating), truncated, lambda: jnp.zeros_like(params.top_k))
    return jnp.where(truncating, cut, free)


def _among_candidates(
    scaled: jax.Array, params: SamplingBatch, keys: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """(tokens [S], exact [S]): top-k, then top-p over what top-k leaves, cut
    within the ``CANDIDATES`` best tokens. A row is exact when its cut falls
    among them: top-k at most that many, or a nucleus whose mass (under the
    whole vocabulary's normaliser) they already hold."""
    candidates = min(CANDIDATES, scaled.shape[0])
    top_values, top_index = jax.lax.top_k(scaled.T, candidates)  # [S, C] best first
    rank = jnp.arange(candidates)[None, :]
    by_k = params.top_k > 0
    k = jnp.where(by_k, jnp.minimum(params.top_k, candidates), candidates)
    keep = rank < k[:, None]
    # Top-p is over the distribution top-k leaves (renormalised), as vLLM
    # and HF apply them; without top-k, over the whole vocabulary.
    normaliser = jnp.where(
        by_k,
        jax.nn.logsumexp(jnp.where(keep, top_values, -jnp.inf), axis=-1),
        jax.nn.logsumexp(scaled, axis=0),
    )
    probs = jnp.where(keep, jnp.exp(top_values - normaliser[:, None]), 0.0)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of the better candidates
    keep &= (before < params.top_p[:, None]) | (rank == 0)  # the best always stays
    exact = jnp.where(by_k, params.top_k <= candidates, probs.sum(axis=-1) >= params.top_p)
    row_logits = jnp.where(keep, top_values, -jnp.inf)
    choice = jax.vmap(jax.random.categorical)(keys, row_logits)
    tokens = jnp.take_along_axis(top_index, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return tokens, exact


def exact_keep(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Which tokens top-k then top-p keep, over the whole vocabulary: a
    boolean [S, V] from scaled logits [V, S], without sorting it.

    Each cut is a threshold on the logits, found by bisection over their
    order-preserving 32-bit keys (32 passes over the vocabulary each): the
    k-th best logit, then the least logit whose better-or-equal tokens hold
    ``top_p`` of what top-k left. Ties at a threshold all stay.
    """
    x = scaled.T  # [S, V]
    keys = _order_keys(x)
    vocab = x.shape[1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    lowest = jnp.min(keys, axis=-1)
    k_cut = _largest_key(keys, lowest, lambda t: jnp.sum(keys >= t[:, None], axis=-1) >= k)
    in_k = keys >= k_cut[:, None]
    normaliser = jax.nn.logsumexp(jnp.where(in_k, x, -jnp.inf), axis=-1)
    probs = jnp.where(in_k, jnp.exp(x - normaliser[:, None]), 0.0)

    def holds_p(t: jax.Array) -> jax.Array:
        return jnp.sum(jnp.where(keys >= t[:, None], probs, 0.0), axis=-1) >= top_p

    p_cut = jnp.where(top_p < 1.0, _largest_key(keys, k_cut, holds_p), k_cut)
    return keys >= jnp.maximum(k_cut, p_cut)[:, None]


def _beyond_candidates(
    scaled: jax.Array, params: SamplingBatch, keys: jax.Array, beyond: jax.Array
) -> jax.Array:
    """Tokens [S] drawn exactly from the whole vocabulary's top-k/top-p set
    (Gumbel-max over the kept tokens) for the rows in ``beyond``, the rare
    ones the candidates cannot serve: gathered ``BEYOND_ROWS`` at a time, so
    the cost follows how many need it, not the batch."""
    rows_total = beyond.shape[0]
    group = min(rows_total, BEYOND_ROWS)
    # The rows that need it first, then padding past the end (dropped on scatter).
    order = jnp.concatenate(
        [
            jnp.nonzero(beyond, size=rows_total, fill_value=rows_total)[0],
            jnp.full(group, rows_total, jnp.int32),
        ]
    ).astype(jnp.int32)
    x = scaled.T  # [S, V]

    def one_group(i: jax.Array, out: jax.Array) -> jax.Array:
        rows = jax.lax.dynamic_slice(order, (i * group,), (group,))
        safe = jnp.minimum(rows, rows_total - 1)
        sub = x[safe]  # [G, V]
        keep = exact_keep(sub.T, params.top_k[safe], params.top_p[safe])
        gumbel = jax.vmap(lambda key: jax.random.gumbel(key, (sub.shape[1],)))(keys[safe])
        drawn = jnp.argmax(jnp.where(keep, sub + gumbel, -jnp.inf), axis=-1).astype(jnp.int32)
        return out.at[rows].set(drawn, mode="drop")

    groups = (jnp.sum(beyond) + group - 1) // group
    return jax.lax.fori_loop(0, groups, one_group, jnp.zeros(rows_total, jnp.int32))


def _order_keys(x: jax.Array) -> jax.Array:
    """uint32 keys in the order of the float32 values (IEEE bits, negatives
    flipped): a bisection over them is exact in 32 steps."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    negative = (bits >> 31) == 1
    return jnp.where(negative, ~bits, bits | jnp.uint32(0x80000000))


def _largest_key(keys: jax.Array, low: jax.Array, holds: Any) -> jax.Array:
    """Per row, the largest key t in [low, max key] with ``holds(t)``, for a
    predicate true at ``low`` and monotone (true, then false)."""
    high = jnp.max(keys, axis=-1)

    def step(_: int, bounds: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        lo, hi = bounds
        gap = hi - lo
        mid = lo + gap // 2 + (gap & 1)  # rounded up, so lo < mid whenever lo < hi
        ok = holds(mid) & (lo < hi)
        return jnp.where(ok, mid, lo), jnp.where(ok | (lo >= hi), hi, mid - 1)

    lo, _ = jax.lax.fori_loop(0, 32, step, (low, high))
    return lo
