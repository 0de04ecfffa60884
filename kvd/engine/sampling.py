"""Choosing the next token on the device: greedy, temperature, top-k, top-p.

Per-sequence parameters ride along as arrays, so one compiled step serves a
batch that mixes greedy and sampled requests. Randomness is reproducible per
request: it comes from the request's seed and the token's position (hashed
for temperature draws, a folded threefry key for top-k/top-p), so a sequence
samples the same tokens whatever it is batched with and however often it is
preempted and resumed.

Greedy choice and temperature draws read the logits once, for the maxima of
their blocks or columns: greedy is a columnwise argmax (``first_argmax``),
and a temperature draw is exact rejection sampling over blocks
(``draw_by_blocks``), which computes exponentials for a few blocks only.

Top-k and top-p are exact over the whole vocabulary, as vLLM applies them
(top-k, then top-p over what it leaves). A full sort of a 262,144-token
vocabulary per sequence per step costs more than the rest of the step on a
CPU, so the cut is made among the ``CANDIDATES`` most likely tokens whenever
it falls there (top-k up to that many; a nucleus they hold, judged with the
whole vocabulary's normaliser); a row whose cut falls beyond them (a larger
top-k, a flat distribution) is cut by thresholds found by bisection over the
whole vocabulary.

Before any of that, as vLLM orders them: logit biases are added, the end
tokens and stop ids of a row short of its ``min_tokens`` are masked, the
repetition, frequency and presence penalties are applied (from each row's
token history: counted on the device, one scatter for the batch), a
structured output's grammar masks what it does not allow, and after
the temperature, ``min_p`` drops what is less likely than its share of the
best token. When no row of the batch asks for any of them, the choice reads
the logits where they are. The logprobs returned are the model's own
(before these adjustments).
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
    # [S] int32: the token at ``positions - 1`` where the host does not have it
    # yet (an overlapped step: the previous step sampled it), else -1.
    newest: jax.Array | None = None
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
    zeros unless some row asked) from logits ``[S, V]``, a row per sequence,
    as the head's product lays them out. (A vocabulary-major sampler made
    XLA:CPU transpose oneDNN's logits into a copy before every choice: 9 ms
    of an 85 ms decode step at 32 rows, against about 1 ms for the choice.)
    ``end_ids``: the model's end tokens (EOS, end of turn), masked with a
    row's stop ids until its ``min_end``. Whether a token ends its
    generation is the scheduler's decision, not made here.

    Branches that no sequence of the batch needs (adjustments no row asks
    for, an argmax when every row draws, random draws when all are greedy,
    free draws when all truncate, logprobs no row asked for) are skipped at
    run time with ``lax.cond``: one compiled program, no wasted work. The
    choice is compiled on unadjusted logits, so that a batch with no
    adjustment reads the logits in place (a branch passing them through
    would copy them), and on adjusted ones (``_choose_adjusted``).
    """

    tokens = _choose_adjusted(logits, params, end_ids, adjusted_rows(params))
    top = min(MAX_TOP_LOGPROBS, logits.shape[1])

    def chosen_logprobs(asked: jax.Array, rows: jax.Array) -> jax.Array:
        picked = asked[jnp.arange(rows.shape[0]), tokens[rows]]
        return picked - jax.nn.logsumexp(asked, axis=1)

    def alternatives(asked: jax.Array, rows: jax.Array) -> tuple[jax.Array, jax.Array]:
        values, ids = jax.lax.top_k(asked, top)  # [P, K], best first
        normaliser = jax.nn.logsumexp(asked, axis=1)
        return ids.astype(jnp.int32), values - normaliser[:, None]

    logprobs = _for_rows_asking(params.want_logprobs, logits, chosen_logprobs)
    top_ids, top_logprobs = _for_rows_asking(params.top_count > 0, logits, alternatives)
    return tokens, logprobs, top_ids, top_logprobs


def _choose(logits: jax.Array, params: SamplingBatch) -> jax.Array:
    """The token [S] of each row of ``logits`` (already adjusted)."""
    greedy = params.temperature == 0.0
    none = jnp.zeros(logits.shape[0], jnp.int32)
    # A batch that draws every row never reads the logits for an argmax,
    # nor a greedy one draws. Each is compiled once: a program's every
    # branch, taken or not, costs XLA:CPU time at each execution.
    argmax = jax.lax.cond(jnp.any(greedy), lambda: first_argmax(logits), lambda: none)
    drawn = jax.lax.cond(jnp.all(greedy), lambda: none, lambda: _draw(logits, params))
    return jnp.where(greedy, argmax, drawn)


ADJUSTED_ROWS = (8,)  # rows adjusted apart from the batch when only a few ask
APART_BYTES = 8 << 20  # logits of a batch worth adjusting apart (below: copied)


def _choose_adjusted(
    logits: jax.Array, params: SamplingBatch, end_ids: tuple[int, ...], rows: jax.Array
) -> jax.Array:
    """``_choose`` over ``adjusted_logits`` (``rows``: ``adjusted_rows``).
    Adjusting changes the logits in place, and the program's logits are
    also read as they are (the logprobs, the batch's other rows), so
    XLA:CPU copies them first (32 rows of a 262,144-token vocabulary: 1.5
    ms, on one thread, and more where the copy's pages are new). So a
    batch with no row adjusted chooses from the logits where they are (a
    branch that returned them unchanged would copy them too). When at most
    ``ADJUSTED_ROWS[-1]`` rows are adjusted, those rows are gathered apart
    (in the smallest width of ``ADJUSTED_ROWS`` that holds them), adjusted
    and chosen from, and the rest keep the batch's choice from the logits
    where they are; a row chooses the same token either way. More, and the
    whole batch is adjusted and chosen from. The choice from the logits
    where they are is compiled once, shared by the first two; each width
    is one more choice to compile (about 2.5 s at 32 rows), so there are
    few, and none where the batch's logits are under ``APART_BYTES`` (a
    copy of them costs less than a millisecond)."""
    seqs = logits.shape[0]
    worth = logits.size * logits.dtype.itemsize >= APART_BYTES
    widths = [width for width in ADJUSTED_ROWS if width < seqs] if worth else []
    count = jnp.sum(rows)
    # 0: no row adjusted; 1 to len(widths): apart, in that width; then every row.
    which = jnp.where(count == 0, 0, 1 + jnp.searchsorted(jnp.asarray(widths + [seqs]), count))
    every = len(widths) + 1
    plain = jax.lax.cond(
        which == every,
        lambda: jnp.zeros(seqs, jnp.int32),
        lambda: _choose(logits, params),
    )

    def apart(width: int) -> Any:
        def run() -> jax.Array:
            (ids,) = jnp.nonzero(rows, size=width, fill_value=seqs)  # padding: dropped
            at = jnp.minimum(ids, seqs - 1)
            own = jax.tree.map(lambda field: field[at], params)
            picked = _choose(adjusted_logits(logits[at], own, end_ids), own)
            return plain.at[ids].set(picked, mode="drop")

        return run

    def whole() -> jax.Array:
        return _choose(adjusted_logits(logits, params, end_ids), params)

    return jax.lax.switch(which, [lambda: plain] + [apart(width) for width in widths] + [whole])


BLOCK = 256  # vocabulary entries per block of ``block_maxima``


def block_size(vocab: int) -> int:
    """Entries per block for a vocabulary of ``vocab``: ``BLOCK``, or the
    largest power of two below it that divides ``vocab`` (1 at worst)."""
    return _divisor(vocab, BLOCK)


def block_maxima(values: jax.Array, size: int | None = None) -> jax.Array:
    """The largest value of each block of ``size`` (default
    ``block_size(V)``) consecutive vocabulary entries of ``values [S, V]``:
    ``[S, V / size]``, one read of the logits. Temperature draws and
    ``top_candidates`` start from such maxima, and never read the whole
    vocabulary again. The barrier keeps it computed once: XLA:CPU otherwise
    fuses the reduction into each consumer and reads the logits again per
    element (a 30 ms argmax at batch 32)."""
    seqs, vocab = values.shape
    size = size or block_size(vocab)
    maxima = jnp.max(values.reshape(seqs, vocab // size, size), axis=2)
    return jax.lax.optimization_barrier(maxima)


COLUMNS = 2048  # columns of ``first_argmax``'s strided maxima


def first_argmax(values: jax.Array) -> jax.Array:
    """``argmax(values, axis=1)`` (int32; the first of equal maxima), from
    one read of the vocabulary. Row s is seen as ``V / C`` rows of ``C =
    COLUMNS`` entries (fewer where C does not divide V), and the maximum of
    each column (entries j, j + C, j + 2C, ...) is taken: element by
    element across whole rows, with no reduction inside a vector, where
    maxima of consecutive entries need one per block (on the AMD EPYC, 32
    rows of 262,144 logits, alternated 60 times: 1.15-1.34x a pass that
    only reads them, against 1.33-1.59x with blocks of 256).
    The first column holding the largest value, then the first entry of
    that column holding it, is the first index holding it unless another
    column holds it too: rows with such a tie take the first equal entry of
    the whole row, a second pass made only when a row of the batch has
    one. (argmax's own paired (value, index) reduce runs element by element
    on XLA:CPU, 30 times slower.) An index no value matches (a NaN maximum)
    is the last token's, so it stays in range."""
    seqs, vocab = values.shape
    columns = _divisor(vocab, COLUMNS)
    grid = values.reshape(seqs, vocab // columns, columns)
    # The barrier keeps the pass computed once (see ``block_maxima``).
    maxima = jax.lax.optimization_barrier(jnp.max(grid, axis=1))  # [S, C]
    best = jnp.max(maxima, axis=1)
    holds = maxima == best[:, None]
    column = _first_where(holds, columns - 1)
    entries = jnp.take_along_axis(grid, column[:, None, None], axis=2)[..., 0]
    first = _first_where(entries == best[:, None], vocab // columns - 1) * columns + column
    tied = jnp.sum(holds, axis=1) > 1

    def untie() -> jax.Array:
        return jnp.where(tied, _first_where(values == best[:, None], vocab - 1), first)

    return jax.lax.cond(jnp.any(tied), untie, lambda: first)


def _first_where(found: jax.Array, missing: int) -> jax.Array:
    """Per row of ``found [S, N]``, the first index that is True (int32),
    ``missing`` where none is."""
    ids = jax.lax.broadcasted_iota(jnp.int32, found.shape, 1)
    return jnp.min(jnp.where(found, ids, missing), axis=1)


def _block_values(values: jax.Array, blocks: jax.Array, size: int) -> jax.Array:
    """``values [S, V]`` of block ``blocks[s]`` (``[S]`` or ``[S, K]``) of each
    row s: ``[S, B]`` or ``[S, K, B]``. Gathered apart (the barrier): a
    gather XLA:CPU fuses into a reduction runs about 15 times slower."""
    seqs = values.shape[0]
    rows = jnp.arange(seqs).reshape(seqs, *([1] * blocks.ndim))
    entries = blocks[..., None] * size + jnp.arange(size)
    return jax.lax.optimization_barrier(values[rows, entries])


ROW_BUCKETS = (1, 4, 8)  # rows gathered apart when only a few ask
PENALIZED_ROWS = 4  # penalized rows whose histories are applied at a time


def _for_rows_asking(asking: jax.Array, logits: jax.Array, compute: Any) -> Any:
    """``compute(asked [P, V], rows [P])`` over the logits of the rows that
    ask, its results scattered back to every row (zeros for the rest). A
    normaliser or a top-k over the vocabulary costs by the rows it reads, so
    those rows are gathered apart, P the smallest of ``ROW_BUCKETS`` (or the
    batch) that holds them (``rows`` padded with the batch size, out of
    range); the batch's width reads them in place; nothing is read when no
    row asks."""
    seqs = logits.shape[0]
    buckets = [b for b in ROW_BUCKETS if b < seqs] + [seqs]

    def for_rows(width: int) -> Any:
        def run() -> Any:
            if width == seqs:  # every row, read in place (not copied by a gather)
                out = compute(logits, jnp.arange(seqs))
                return jax.tree.map(
                    lambda x: jnp.where(asking.reshape(-1, *([1] * (x.ndim - 1))), x, 0), out
                )
            (rows,) = jnp.nonzero(asking, size=width, fill_value=seqs)
            out = compute(logits[jnp.minimum(rows, seqs - 1)], rows)
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


def _penalized(params: SamplingBatch) -> jax.Array:
    """Which rows [S] have a repetition, frequency or presence penalty."""
    return (params.presence != 0) | (params.frequency != 0) | (params.repetition != 1)


def adjusted_rows(params: SamplingBatch) -> jax.Array:
    """Which rows [S] have their logits adjusted (``adjusted_logits``): a
    logit bias, end tokens masked short of ``min_tokens``, a penalty, a
    grammar's mask."""
    early = params.positions < params.min_end
    rows = jnp.any(params.bias_ids >= 0, axis=1) | early | _penalized(params)
    if params.allowed is not None:
        rows |= jnp.any(params.allowed != -1, axis=1)
    return rows


def adjusted_logits(
    logits: jax.Array, params: SamplingBatch, end_ids: tuple[int, ...] = ()
) -> jax.Array:
    """The logits ``[S, V]`` the choice is made from, before the temperature:
    logit biases added, end tokens and stop ids masked for rows short of
    their ``min_tokens``, then the penalties and a grammar's mask. The
    biases and the mask are scatters whose padding is dropped, and the
    penalties a loop of as many trips as penalized rows: done in place, with
    nothing to skip (a ``lax.cond`` that passed the logits through unchanged
    would copy them)."""
    seqs, vocab = logits.shape
    rows = jnp.arange(seqs)[:, None]
    ids = jnp.where(params.bias_ids < 0, vocab, params.bias_ids)  # padding: dropped
    logits = logits.at[rows, ids].add(params.biases, mode="drop")
    early = params.positions < params.min_end
    ends = jnp.broadcast_to(jnp.asarray(end_ids, jnp.int32), (seqs, len(end_ids)))
    ids = jnp.concatenate([params.stop_ids, ends], axis=1)
    ids = jnp.where((ids < 0) | ~early[:, None], vocab, ids)  # dropped
    logits = logits.at[rows, ids].set(-jnp.inf, mode="drop")
    penalized = _penalized(params)
    logits = _penalize_rows(logits, params, penalized)
    allowed = params.allowed
    if allowed is None:
        return logits
    return jax.lax.cond(jnp.any(allowed != -1), lambda: _constrain(logits, allowed), lambda: logits)


def _constrain(logits: jax.Array, allowed: jax.Array) -> jax.Array:
    """Tokens a row's bitmask does not allow get -inf: the bits unpacked in
    the logits' order, one elementwise pass."""
    seqs, vocab = logits.shape
    shifts = jnp.arange(32, dtype=jnp.int32)[None, None, :]
    bits = (allowed[:, :, None] >> shifts) & 1  # [S, W, 32]
    bits = bits.reshape(seqs, -1)[:, :vocab]
    return jnp.where(bits != 0, logits, -jnp.inf)


def _penalize_rows(logits: jax.Array, params: SamplingBatch, penalized: jax.Array) -> jax.Array:
    """The penalties of the ``penalized`` rows, ``PENALIZED_ROWS`` of them at a
    time in a loop over the logits: the gathers and scatters read those rows'
    histories only, and the logits are changed in place (XLA copies a
    ``[S, V]`` operand that a multi-way branch would change)."""
    seqs = logits.shape[0]
    width = min(PENALIZED_ROWS, seqs)
    groups = -(-seqs // width)
    (rows,) = jnp.nonzero(penalized, size=groups * width, fill_value=seqs)

    def one_group(i: jax.Array, logits: jax.Array) -> jax.Array:
        return _penalize(logits, params, jax.lax.dynamic_slice(rows, (i * width,), (width,)))

    trips = (jnp.sum(penalized) + width - 1) // width
    return jax.lax.fori_loop(0, trips, one_group, logits)


def _penalize(logits: jax.Array, params: SamplingBatch, rows: jax.Array) -> jax.Array:
    """vLLM's penalties over logits ``[S, V]``, for ``rows``
    (out of range: padding): a token seen in the prompt or the output has a
    positive logit divided by the repetition penalty and a negative one
    multiplied; then each generated occurrence takes the frequency penalty
    off, and having occurred at all the presence penalty. Sparse: gathers and
    scatters at those rows' history tokens below their ``positions``, never a
    dense ``[S, V]`` count, nor the other rows' histories."""
    seqs, vocab = logits.shape
    valid = rows < seqs
    at_row = jnp.minimum(rows, seqs - 1)
    history = params.history[at_row]  # [P, H]
    if params.newest is not None:  # a token still on the device joins its row's history
        newest, last = params.newest[at_row], jnp.maximum(params.positions[at_row] - 1, 0)
        gathered = jnp.arange(history.shape[0])
        history = history.at[gathered, last].set(
            jnp.where(newest >= 0, newest, history[gathered, last]), mode="drop"
        )
    where = jnp.arange(history.shape[1])[None, :]
    known = (where < params.positions[at_row][:, None]) & valid[:, None]
    generated = known & (where >= params.prompt_end[at_row][:, None])
    row = rows[:, None]  # [P, 1]; out of range: dropped
    seen = jnp.where(known, history, vocab)  # [P, H]; vocab: dropped
    out = jnp.where(generated, history, vocab)
    # Duplicates write the same value: each token is changed once.
    at = logits.at[row, seen].get(mode="fill", fill_value=0.0)
    repetition = params.repetition[at_row][:, None]
    logits = logits.at[row, seen].set(
        jnp.where(at > 0, at / repetition, at * repetition), mode="drop"
    )
    # Duplicates add up: the frequency penalty once per occurrence.
    frequency = params.frequency[at_row][:, None]
    logits = logits.at[row, out].add(jnp.broadcast_to(-frequency, out.shape), mode="drop")
    at = logits.at[row, out].get(mode="fill", fill_value=0.0)
    return logits.at[row, out].set(at - params.presence[at_row][:, None], mode="drop")


def _min_p_floor(best: jax.Array, min_p: jax.Array) -> jax.Array:
    """Per row, the scaled logit below which ``min_p`` drops a token (less
    likely than ``min_p`` times the best token, whose scaled logit is
    ``best``); -inf for rows with 0."""
    return jnp.where(min_p > 0, best + jnp.log(jnp.maximum(min_p, 1e-30)), -jnp.inf)


def _cut(scaled: jax.Array, floor: jax.Array) -> jax.Array:
    """Scaled logits [R, N] below their row's ``floor`` set to -inf."""
    return jnp.where(scaled < floor[:, None], -jnp.inf, scaled)


def _draw(logits: jax.Array, params: SamplingBatch) -> jax.Array:
    """Sampled tokens [S] from logits [S, V] (after ``adjusted_logits``)."""
    # A greedy row's draw is thrown away: it must not ask for a truncation.
    truncating = ((params.top_k > 0) | (params.top_p < 1.0)) & (params.temperature > 0)

    def truncated() -> jax.Array:
        keys = jax.vmap(lambda seed, pos: jax.random.fold_in(jax.random.key(seed), pos))(
            params.seeds, params.positions
        )
        # The temperature and min_p are applied where the logits are read:
        # the candidates, the whole vocabulary's normaliser, the rows cut
        # over the whole vocabulary. Written out scaled, the logits of 32 rows
        # were 32 MiB more to write and read each step.
        temperature = jnp.maximum(params.temperature, MIN_TEMPERATURE)
        tokens, exact, floor = _among_candidates(logits, temperature, params, keys)
        beyond = truncating & ~exact
        wide = jax.lax.cond(
            jnp.any(beyond),
            lambda: _beyond_candidates(logits, temperature, floor, params, beyond),
            lambda: jnp.zeros_like(tokens),
        )
        return jnp.where(exact, tokens, wide)

    drawing = (params.temperature > 0) & ~truncating
    free = jax.lax.cond(
        jnp.any(drawing),
        lambda: draw_by_blocks(
            logits,
            params.temperature,
            params.min_p,
            params.seeds,
            params.positions,
            drawing,
        ),
        lambda: jnp.zeros_like(params.top_k),
    )
    cut = jax.lax.cond(jnp.any(truncating), truncated, lambda: jnp.zeros_like(params.top_k))
    return jnp.where(truncating, cut, free)


DRAW_BLOCK = 32  # vocabulary entries per block a temperature draw bounds
BLOCKS_PER_GROUP = 8  # blocks per group, the unit a proposal first chooses
CANDIDATE_GROUPS = 8  # groups per row whose blocks' exact masses the proposal holds
PROPOSALS = 128  # proposals per row, at most, before the exact pass
EARLY_PROPOSALS = 64  # of them, made first; the rest only when a row kept none
RUNS = 16  # runs of consecutive blocks the exact pass first weighs, at most
DRAW_ROWS = 8  # rows whose every block the exact pass weighs in one reduction
SEARCH_RUN = 32  # entries of a running sum one comparison of ``_search`` covers


def _divisor(count: int, size: int) -> int:
    """``size`` (a power of two), or the largest power of two below it
    that divides ``count`` (1 at worst)."""
    while count % size:
        size //= 2
    return size


def draw_by_blocks(
    logits: jax.Array,
    temperature: jax.Array,
    min_p: jax.Array,
    seeds: jax.Array,
    positions: jax.Array,
    rows: jax.Array,
) -> jax.Array:
    """Tokens [S] drawn exactly from softmax(logits / temperature) (after
    min_p) for the ``rows`` asked (others: 0).

    Rejection sampling over blocks of ``DRAW_BLOCK`` entries, from one read
    of the logits: their blocks' maxima. No entry of a block weighs more
    than its largest, so a block proposed in proportion to its size times
    that weight (its bound), one of its entries picked uniformly and kept
    with probability its weight over the largest's, gives every token
    exactly its weight over the total: one logit read a proposal. The
    ``CANDIDATE_GROUPS`` groups of ``BLOCKS_PER_GROUP`` blocks with the
    largest maxima, where a peaked row's mass lies, offer their blocks'
    exact masses instead, always kept, the entry then drawn by its weight.
    A proposal is kept at least one time in 32 whatever the logits, and
    about one time in eight on the 270M's at temperature 1 (half the rows
    keep one of their first four). Group g holds blocks g, g + groups, ...
    (strided), so that the groups' maxima and sums are taken element by
    element (contiguous groups, whose candidates held more of the mass,
    made the draw slower).

    ``EARLY_PROPOSALS`` proposals per row are made at once, each a group by
    the groups' bounds, a block of it by theirs, then an entry; the row
    takes its first kept one. Only when a row of the batch kept none are
    the rest of ``PROPOSALS`` made (on the 270M's logits at temperature 1,
    about one row in 430 needs more than 64, one in 80 at 1.5). A row with
    none kept at all draws from every entry's exact weight
    (``exact_draw``). Each row's random numbers come from its seed and
    position (``uniforms``), a proposal's wherever it is made: what a row
    draws depends on its logits and those alone."""
    seqs, vocab = logits.shape
    size = _divisor(vocab, DRAW_BLOCK)
    maxima = block_maxima(logits, size)  # [S, blocks]
    blocks = vocab // size
    per_group = _divisor(blocks, BLOCKS_PER_GROUP)
    groups = blocks // per_group
    # Group g holds blocks g, g + groups, g + 2 x groups, ...: its maximum
    # and its bounds' sum are taken element by element across rows of
    # ``groups`` blocks, where consecutive blocks need a reduction inside a vector.
    group_maxima = _across(maxima, per_group, jnp.maximum)
    inverse = 1.0 / jnp.maximum(temperature, MIN_TEMPERATURE)  # [S]
    best = jnp.max(group_maxima, axis=1)  # [S]
    # min_p drops what is less likely than its share of the best token.
    floor = _min_p_floor(jnp.zeros_like(min_p), min_p)  # scaled relative to the best
    scale = best, inverse, floor

    count = min(CANDIDATE_GROUPS, groups)
    candidates = jax.lax.top_k(group_maxima, count)[1]  # [S, C]
    stride = groups * jnp.arange(per_group)
    held = (candidates[..., None] + stride).reshape(seqs, -1)  # [S, C x blocks]
    held_weights = _weights(_block_values(logits, held, size), scale)  # [S, C x blocks, size]
    row = jnp.arange(seqs)[:, None]
    # A block whose best is under min_p's cut has no weight: never proposed.
    bound = (size * _weights(maxima, scale)).at[row, held].set(held_weights.sum(axis=2))
    # Summed apart: XLA:CPU fused the sum into the running sum's product, 0.5 ms.
    group_bound = jax.lax.optimization_barrier(_across(bound, per_group, jnp.add))
    by_group = running_sum(group_bound)  # [S, groups]

    def propose(proposed: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(whether a proposal was kept [S], the first kept one's token [S])
        from ``proposed [S, P, 4]``: a proposal's four uniform numbers."""
        made = proposed.shape[1]
        group = _search(by_group, proposed[..., 0] * by_group[:, -1:])  # [S, P]
        members = group[..., None] + stride  # [S, P, blocks of the group]
        offers = jax.lax.optimization_barrier(bound[row[..., None], members])
        cumulative = running_sum(offers.reshape(-1, per_group)).reshape(offers.shape)
        within = _falls_on(cumulative, proposed[..., 1] * cumulative[..., -1])
        block = group + groups * within
        offered = jnp.take_along_axis(offers, within[..., None], axis=2)[..., 0]
        # A block of a candidate group is offered by its exact mass, so kept;
        # any other offers one of its entries, uniformly, kept by the entry's
        # weight over the largest the block's maximum allows (its bound over
        # its size): each entry is then drawn by its weight, from one logit.
        slot = jnp.minimum((proposed[..., 2] * size).astype(jnp.int32), size - 1)
        weight = _weights(jax.lax.optimization_barrier(logits[row, block * size + slot]), scale)
        is_exact = jnp.any(group[..., None] == candidates[:, None, :], axis=2)  # [S, P]
        kept = (offered > 0) & (is_exact | (proposed[..., 3] * offered < size * weight))
        first = _first_where(kept, made)  # [S]
        taken = jnp.minimum(first, made - 1)[:, None]

        def at_first(values: jax.Array) -> jax.Array:
            return jnp.take_along_axis(values, taken, axis=1)[:, 0]

        chosen = at_first(block)
        # A kept candidate block's entry, by the weights its exact mass summed.
        held_at = jnp.argmax(held == chosen[:, None], axis=1)
        inside = _pick(held_weights[row[:, 0], held_at], at_first(proposed[..., 2]))
        entry = jnp.where(at_first(is_exact), inside, at_first(slot))
        return first < made, chosen * size + entry

    lanes = 4 * PROPOSALS

    def proposals(first: int, last: int) -> jax.Array:
        """The uniform numbers [S, P, 4] of proposals ``first`` to ``last`` - 1."""
        draws = uniforms(seeds, positions, jnp.int32(0), lanes + 3, (4 * first, 4 * last))
        return draws.reshape(seqs, last - first, 4)

    # Most rows keep one of their first few proposals: the rest are made
    # only when a row of the batch has kept none of them.
    early = min(EARLY_PROPOSALS, PROPOSALS)
    kept, tokens = propose(proposals(0, early))

    def later() -> tuple[jax.Array, jax.Array]:
        kept_later, drawn = propose(proposals(early, PROPOSALS))
        return kept | kept_later, jnp.where(kept, tokens, drawn)

    if early < PROPOSALS:
        kept, tokens = jax.lax.cond(jnp.all(kept | ~rows), lambda: (kept, tokens), later)
    done = kept | ~rows

    def exact_pass() -> jax.Array:
        draws = uniforms(seeds, positions, jnp.int32(0), lanes + 3, (lanes, lanes + 3))
        drawn = exact_draw(logits, scale, size * per_group, draws)
        return jnp.where(done, tokens, drawn)

    return jax.lax.cond(jnp.all(done), lambda: tokens, exact_pass)


def _across(values: jax.Array, parts: int, combine: Any) -> jax.Array:
    """``values [S, parts x N]`` seen as ``parts`` slices of N, combined
    element by element (``[S, N]``): one loop of XLA:CPU, where a
    reduction over the middle axis of ``[S, parts, N]`` went to a library
    kernel about ten times slower at these sizes."""
    width = values.shape[1] // parts
    out = values[:, :width]
    for part in range(1, parts):
        out = combine(out, values[:, part * width : (part + 1) * width])
    return out


def _falls_on(cumulative: jax.Array, targets: jax.Array) -> jax.Array:
    """Per running sum ``cumulative [..., N]``, the index its ``targets [...]``
    falls on: how many entries are at most it, clipped to N - 1."""
    below = jnp.sum(cumulative <= targets[..., None], axis=-1)
    return jnp.minimum(below, cumulative.shape[-1] - 1)


def _search(cumulative: jax.Array, targets: jax.Array) -> jax.Array:
    """Per row of a running sum ``cumulative [S, N]``, how many of its entries
    are at most each of ``targets [S, P]`` (clipped to N - 1): the index each
    target falls on. The ends of runs of ``SEARCH_RUN`` entries first, then
    the entries of the run found, so a target is compared with about
    2 x sqrt(N) entries, not N."""
    seqs, n = cumulative.shape
    run = _divisor(n, SEARCH_RUN)
    ends = cumulative[:, run - 1 :: run]  # [S, N / run]
    before = jnp.sum(ends[:, None, :] <= targets[..., None], axis=2)  # whole runs at most it
    start = jnp.minimum(before, n // run - 1)
    # The run found ends past the target, unless it is the last run.
    return start * run + _falls_on(_block_values(cumulative, start, run), targets)


def _weights(values: jax.Array, scale: tuple[jax.Array, ...]) -> jax.Array:
    """Unnormalised probabilities of ``values [S, ...]``: ``scale`` is (best
    logit, 1 / temperature, min_p's floor), one per row. min_p's cut is made
    after the exponential, the form XLA:CPU vectorises in the exact pass's
    reductions (32 rows of the 270M's logits: 2.3 ms against 3.0 with the
    cut before it; 8 rows: 0.8 against 1.0)."""
    best, inverse, floor = scale
    shape = [best.shape[0]] + [1] * (values.ndim - 1)
    scaled = (values - best.reshape(shape)) * inverse.reshape(shape)
    return jnp.where(scaled >= floor.reshape(shape), jnp.exp(scaled), 0.0)


def exact_draw(
    logits: jax.Array, scale: tuple[jax.Array, ...], size: int, draws: jax.Array
) -> jax.Array:
    """A token [S] per row of ``logits [S, V]``, drawn by its exact weight
    (``scale``: as ``_weights`` takes it), with ``draws [S, 3]``: one of
    ``RUNS`` runs of blocks of ``size`` by the runs' masses, a block of the
    run by theirs, an entry of the block by its weight.

    Every block's mass comes from one reduction over ``DRAW_ROWS`` rows at a
    time (the last group overlapping the one before when they do not divide
    the batch: its rows are drawn twice, the same way). Over more rows at
    once XLA:CPU computes the exponentials one at a time (32 rows of the
    270M's 262,144 logits: 9.1 ms, against 1.8 in groups of 8 and 2.3 for a
    loop over the runs of the whole batch; 64 rows: 3.7 against 4.6). A row
    is summed the same way whatever its batch, so it draws the same token
    from the same seed and position."""
    seqs, vocab = logits.shape
    blocks = vocab // size
    runs = RUNS
    while blocks % runs:
        runs //= 2

    def group(rows: jax.Array, scale: tuple[jax.Array, ...], draws: jax.Array) -> jax.Array:
        width = rows.shape[0]
        weight = _weights(rows, scale).reshape(width, blocks, size)
        by_run = weight.sum(axis=2).reshape(width, runs, blocks // runs)  # [G, runs, blocks]
        chosen = _pick(by_run.sum(axis=2), draws[:, 0])
        in_run = jnp.take_along_axis(by_run, chosen[:, None, None], axis=1)[:, 0]
        block = chosen * (blocks // runs) + _pick(in_run, draws[:, 1])
        inside = _weights(_block_values(rows, block, size), scale)
        return block * size + _pick(inside, draws[:, 2])

    return _in_row_groups(
        lambda rows, best, inverse, floor, draws: group(rows, (best, inverse, floor), draws),
        jnp.int32,
        logits,
        *scale,
        draws,
    )


def _in_row_groups(compute: Any, dtype: Any, *arrays: jax.Array) -> jax.Array:
    """``compute(*arrays)`` (a value per row of ``arrays [S, ...]``) over
    ``DRAW_ROWS`` rows at a time, the last group overlapping the one before
    when they do not divide the rows (its rows computed twice, the same
    way): over more rows at once XLA:CPU computes the exponentials one at a
    time. A row's value does not depend on its batch."""
    seqs = arrays[0].shape[0]
    width = min(DRAW_ROWS, seqs)
    if width == seqs:
        return compute(*arrays)  # type: ignore[no-any-return]

    def one_group(i: jax.Array, out: jax.Array) -> jax.Array:
        start = jnp.minimum(i * width, seqs - width)
        rows = [jax.lax.dynamic_slice_in_dim(array, start, width, 0) for array in arrays]
        return jax.lax.dynamic_update_slice_in_dim(out, compute(*rows), start, 0)

    groups = -(-seqs // width)
    return jax.lax.fori_loop(0, groups, one_group, jnp.zeros(seqs, dtype))


def _pick(weights: jax.Array, draws: jax.Array) -> jax.Array:
    """Per row of ``weights [S, N]`` (non-negative, some positive), the index
    a uniform ``draws [S]`` falls on along their running sum: each index by
    its weight. One of no weight is never picked (a rounding in the running
    sum could otherwise land on it): the first weighted index past the
    target, else the last weighted one."""
    count = weights.shape[1]
    cumulative = running_sum(weights)
    target = draws * cumulative[:, -1]
    weighted = weights > 0
    past = _first_where((cumulative > target[:, None]) & weighted, count)
    ids = jnp.arange(count)[None, :]
    last = jnp.max(jnp.where(weighted, ids, 0), axis=1)
    return jnp.where(past < count, past, last)


def _mix(x: jax.Array) -> jax.Array:
    """A 32-bit integer hash with full avalanche (Wellons' lowbias32)."""
    x ^= x >> 16
    x *= jnp.uint32(0x7FEB352D)
    x ^= x >> 15
    x *= jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def uniforms(
    seeds: jax.Array,
    positions: jax.Array,
    number: jax.Array,
    count: int,
    lanes: tuple[int, int] | None = None,
) -> jax.Array:
    """``count`` numbers per row, uniform in [0, 1) on a grid of 2^-24, from
    a hash of the row's seed, the position of the token it samples,
    ``number`` and the lane: a counter-based generator of a few integer
    operations per number, reproducible whatever the batch. (JAX's
    threefry key derivation runs as a loop of small steps on XLA:CPU, about
    0.1 ms a call: more than a whole draw.) ``lanes``: (start, stop), only
    those of the ``count`` numbers, the same as sliced from all of them."""
    start, stop = lanes or (0, count)
    lane = jnp.arange(start, stop, dtype=jnp.uint32)[None, :]
    seeded = _mix(seeds.astype(jnp.uint32) ^ jnp.uint32(0x9E3779B9))
    row = _mix(seeded ^ positions.astype(jnp.uint32))
    bits = _mix(row[:, None] ^ _mix(number.astype(jnp.uint32) * jnp.uint32(count) + lane + 1))
    return (bits >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)


RUN = 32  # entries summed by one triangular product in ``running_sum``


def running_sum(values: jax.Array) -> jax.Array:
    """``jnp.cumsum(values, axis=-1)`` for ``[S, N]``, as products with
    triangular matrices: within runs of ``RUN`` entries, then the runs'
    totals. XLA:CPU's cumulative sum is a scan of many small operations,
    several times slower at the sizes a draw sums (256 to 4,096)."""
    seqs, n = values.shape
    run = RUN if n % RUN == 0 else n
    runs = values.reshape(seqs, n // run, run)
    within = runs @ jnp.triu(jnp.ones((run, run), values.dtype))
    totals = within[:, :, -1]
    before = totals @ jnp.triu(jnp.ones((n // run, n // run), values.dtype), 1)
    return (within + before[:, :, None]).reshape(seqs, n)


FINE = 16  # entries per block of ``top_candidates``' second stage


def top_candidates(values: jax.Array, count: int) -> tuple[jax.Array, jax.Array]:
    """``jax.lax.top_k(values, count)`` for ``values [S, V]``, in stages: the
    ``count`` best tokens lie in the ``count`` blocks with the largest maxima
    (each of those maxima is a token at least as good as the count-th
    best), so those blocks are gathered, in vocabulary order, and the same
    is done again with blocks of ``FINE`` entries before the last top-k.
    Equal values at the count-th place may be represented by other tokens
    of that value than ``top_k`` would keep. (The 270M's 262,144 logits, 32
    rows, 256 candidates: 6.0 ms against 11.6 for one top-k.)"""
    seqs, vocab = values.shape
    size = block_size(vocab)
    if vocab // size <= count or size <= FINE:
        return jax.lax.top_k(values, count)
    maxima = block_maxima(values)
    blocks = jnp.sort(jax.lax.top_k(maxima, count)[1], axis=1)  # [S, C]
    gathered = _block_values(values, blocks, size).reshape(seqs, count * size)
    fine = jnp.max(gathered.reshape(seqs, -1, FINE), axis=2)
    within = jnp.sort(jax.lax.top_k(fine, count)[1], axis=1)  # [S, C]
    position = (within[..., None] * FINE + jnp.arange(FINE)).reshape(seqs, count * FINE)
    top_values, best = jax.lax.top_k(jnp.take_along_axis(gathered, position, axis=1), count)
    at = jnp.take_along_axis(position, best, axis=1)  # within ``gathered``
    tokens = jnp.take_along_axis(blocks, at // size, axis=1) * size + at % size
    return top_values, tokens


def _among_candidates(
    logits: jax.Array, temperature: jax.Array, params: SamplingBatch, keys: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(tokens [S], exact [S], min_p's floor [S]): top-k, then top-p over what
    top-k leaves, cut within the ``CANDIDATES`` best tokens of the logits
    scaled by ``temperature`` [S] (and cut by min_p). A row is exact when its
    cut falls among them: top-k at most that many, or a nucleus whose mass
    (under the whole vocabulary's normaliser) they already hold."""
    candidates = min(CANDIDATES, logits.shape[1])
    # A positive temperature keeps the order: the best logits are the best scaled.
    top_logits, top_index = top_candidates(logits, candidates)  # [S, C] best first
    top_values = top_logits / temperature[:, None]
    floor = _min_p_floor(top_values[:, 0], params.min_p)
    top_values = _cut(top_values, floor)
    rank = jnp.arange(candidates)[None, :]
    by_k = params.top_k > 0
    k = jnp.where(by_k, jnp.minimum(params.top_k, candidates), candidates)
    keep = rank < k[:, None]
    # Top-p is over the distribution top-k leaves (renormalised), as vLLM
    # and HF apply them; without top-k, over the whole vocabulary.
    # The whole vocabulary's normaliser (a pass of exponentials) only when a
    # row cuts by top-p alone.
    whole = jax.lax.cond(
        jnp.any(~by_k & (params.top_p < 1.0)),
        lambda: _log_normaliser(logits, temperature, floor),
        lambda: jnp.zeros(logits.shape[0], top_values.dtype),
    )
    normaliser = jnp.where(
        by_k, jax.nn.logsumexp(jnp.where(keep, top_values, -jnp.inf), axis=-1), whole
    )
    probs = jnp.where(keep, jnp.exp(top_values - normaliser[:, None]), 0.0)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of the better candidates
    keep &= (before < params.top_p[:, None]) | (rank == 0)  # the best always stays
    exact = jnp.where(by_k, params.top_k <= candidates, probs.sum(axis=-1) >= params.top_p)
    row_logits = jnp.where(keep, top_values, -jnp.inf)
    choice = jax.vmap(jax.random.categorical)(keys, row_logits)
    tokens = jnp.take_along_axis(top_index, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return tokens, exact, floor


def _log_normaliser(logits: jax.Array, temperature: jax.Array, floor: jax.Array) -> jax.Array:
    """Per row, the log of the sum of the exponentials of the logits scaled
    by ``temperature`` and cut at ``floor``: one reduction over
    ``DRAW_ROWS`` rows at a time, as ``exact_draw`` weighs them (over 32 rows
    at once XLA:CPU computes the exponentials one at a time: 9 ms against
    about 2 for the 270M's logits)."""

    def of(rows: jax.Array, temperature: jax.Array, floor: jax.Array) -> jax.Array:
        return jax.nn.logsumexp(_cut(rows / temperature[:, None], floor), axis=1)

    return _in_row_groups(of, logits.dtype, logits, temperature, floor)


def exact_keep(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Which tokens top-k then top-p keep, over the whole vocabulary: a
    boolean [S, V] from scaled logits [S, V], without sorting it.

    Each cut is a threshold on the logits, found by bisection over their
    order-preserving 32-bit keys (32 passes over the vocabulary each): the
    k-th best logit, then the least logit whose better-or-equal tokens hold
    ``top_p`` of what top-k left. Ties at a threshold all stay.
    """
    x = scaled
    keys = _order_keys(x)
    vocab = x.shape[1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    lowest = jnp.min(keys, axis=-1)
    # Each cut is 32 passes over the vocabulary: made only if some row asks for it.
    k_cut = jax.lax.cond(
        jnp.any(k < vocab),
        lambda: _largest_key(keys, lowest, lambda t: jnp.sum(keys >= t[:, None], axis=-1) >= k),
        lambda: lowest,
    )
    in_k = keys >= k_cut[:, None]
    normaliser = jax.nn.logsumexp(jnp.where(in_k, x, -jnp.inf), axis=-1)
    probs = jnp.where(in_k, jnp.exp(x - normaliser[:, None]), 0.0)

    def holds_p(t: jax.Array) -> jax.Array:
        return jnp.sum(jnp.where(keys >= t[:, None], probs, 0.0), axis=-1) >= top_p

    p_cut = jax.lax.cond(
        jnp.any(top_p < 1.0),
        lambda: jnp.where(top_p < 1.0, _largest_key(keys, k_cut, holds_p), k_cut),
        lambda: k_cut,
    )
    return keys >= jnp.maximum(k_cut, p_cut)[:, None]


def _beyond_candidates(
    logits: jax.Array,
    temperature: jax.Array,
    floor: jax.Array,
    params: SamplingBatch,
    beyond: jax.Array,
) -> jax.Array:
    """Tokens [S] drawn exactly from the whole vocabulary's top-k/top-p set
    (Gumbel-max over the kept tokens) of the logits scaled by
    ``temperature`` and cut at min_p's ``floor`` (per row), for the rows in
    ``beyond``, the ones the candidates cannot serve: gathered
    ``BEYOND_ROWS`` at a time, so the cost follows how many need it, not the
    batch."""
    rows_total, vocab = logits.shape
    group = min(rows_total, BEYOND_ROWS)
    # The rows that need it first, then padding past the end (dropped on scatter).
    order = jnp.concatenate(
        [
            jnp.nonzero(beyond, size=rows_total, fill_value=rows_total)[0],
            jnp.full(group, rows_total, jnp.int32),
        ]
    ).astype(jnp.int32)

    def one_group(i: jax.Array, out: jax.Array) -> jax.Array:
        rows = jax.lax.dynamic_slice(order, (i * group,), (group,))
        safe = jnp.minimum(rows, rows_total - 1)
        sub = _cut(logits[safe] / temperature[safe][:, None], floor[safe])  # [G, V]
        keep = exact_keep(sub, params.top_k[safe], params.top_p[safe])
        # Counter-based uniforms (a few integer operations a number), not
        # threefry's: 2.4 ms against 1.1 for 4 rows of 262,144. (A row cut
        # here never draws by blocks, whose numbers are number 0's.)
        draws = uniforms(params.seeds[safe], params.positions[safe], jnp.int32(1), vocab)
        gumbel = -jnp.log(-jnp.log(draws))
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
