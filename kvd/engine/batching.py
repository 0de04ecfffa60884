"""The host side of an engine step: KV manager state into padded int32 arrays.

The scheduler decides which sequences run and allocates their pages through
the KV manager; this turns that into one ``StepBatch`` padded to fixed
buckets, so a step after warm-up never compiles.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from typing import Any

import jax
import numpy as np

from kvd import faults
from kvd.engine.model import StepBatch
from kvd.engine.sampling import MAX_LOGIT_BIAS, MAX_STOP_IDS, SamplingParams
from kvd.kv.layout import PageLayout
from kvd.kv.sequence import Sequence
from kvd.sched.executor import ParamsLookup, SequenceFault


def bucket(n: int, buckets: Seq[int]) -> int:
    """The smallest bucket that holds ``n``."""
    for size in buckets:
        if n <= size:
            return size
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


def sliding_ring(layout: PageLayout, step_tokens: int) -> int:
    """Entries of a sliding group's block table: the blocks one step's queries
    of a sequence can see (``step_tokens`` of them, the last ``window`` keys
    before each), so a ring of this many entries never overwrites a block a
    query still needs. ``ceil((window - 1) / block) + 1`` for a decode; a
    prefill chunk adds its own length. 0: the layout has no sliding groups."""
    windows = {g.window for g in layout.groups if g.window is not None}
    if not windows:
        return 0
    return -(-(max(windows) - 1 + step_tokens) // layout.block_size) + 1


def group_rings(layout: PageLayout, ring: int) -> np.ndarray[Any, Any]:
    """Per page group, the modulus that maps a block to its table entry: the
    sliding ring, or one no block reaches (global tables are not rings)."""
    return np.asarray(
        [ring if ring and g.window is not None else NOT_A_RING for g in layout.groups], np.int32
    )


NOT_A_RING = 1 << 30


def powers_of_two(lo: int, hi: int) -> tuple[int, ...]:
    sizes, size = [], lo
    while size < hi:
        sizes.append(size)
        size *= 2
    sizes.append(hi)
    return tuple(sizes)


# A sequence's sampling row. Ints: top_k, seed, position, logprobs wanted,
# the position from which end tokens may be sampled (min_tokens), how many
# alternatives' logprobs, where the prompt ends, how many alternatives of the
# prompt's own logprobs (-1: not asked), stop ids.
# Floats: temperature, top_p, min_p, the presence, frequency and repetition
# penalties.
# Logit biases live apart (``SequenceRows.bias``, a row of MAX_LOGIT_BIAS
# token ids then as many f32 biases as their bits; -1 ids where unused): a
# step sends them only when one of its rows has some, so the rows a step
# copies every step are 24 ints and 6 floats, not 2.5 KB each.
SAMPLING_MIN_END = 4
SAMPLING_TOP = 5
SAMPLING_PROMPT = 6
SAMPLING_SCORE = 7
SAMPLING_STOP = 8
SAMPLING_INTS = SAMPLING_STOP + MAX_STOP_IDS
SAMPLING_PENALTIES = 3  # presence, frequency, repetition
SAMPLING_FLOATS = 6
BIAS_WIDTH = 2 * MAX_LOGIT_BIAS  # a bias row: token ids, then the biases' bits
NEUTRAL_PENALTIES = (0.0, 0.0, 1.0)


def _neutral_bias(rows: int) -> np.ndarray[Any, Any]:
    """``rows`` bias rows that bias nothing: -1 ids, zero biases."""
    bias = np.zeros((rows, BIAS_WIDTH), np.int32)
    bias[:, :MAX_LOGIT_BIAS] = -1
    return bias


def _any_of(flags: np.ndarray[Any, Any], rows: np.ndarray[Any, Any]) -> bool:
    """Whether ``flags`` holds for one of ``rows``: first over the whole
    array, one contiguous pass (most steps: no row of any sequence asks),
    and only then gathered (a gather of scattered rows costs several times
    more on the caches a device step leaves)."""
    return bool(flags.any()) and bool(flags[rows].any())


def _grown(old: np.ndarray[Any, Any], rows: int, new: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """``new`` (``rows`` long, the neutral value) with ``old``'s rows first."""
    new[: len(old)] = old
    return new


def write_table_row(
    out: np.ndarray[Any, Any], seq: Sequence, rings: np.ndarray[Any, Any], ring_groups: list[int]
) -> None:
    """``seq``'s block tables into ``out`` ``[G, W]``: global groups in full,
    ``ring_groups`` as rings holding their newest ``rings[g]`` blocks."""
    blocks = seq.num_blocks
    out[:, blocks:] = 0
    if blocks:
        out[:, :blocks] = seq.tables
    for g in ring_groups:
        ring = int(rings[g])
        live = np.arange(max(seq.sliding_start, blocks - ring), blocks)
        out[g] = 0
        out[g, live % ring] = seq.tables[g][blocks - len(live) : blocks]


class SequenceRows:
    """What a step needs of each sequence that does not change from token to
    token, kept as rows of persistent arrays (as vLLM's input batch keeps its
    per-request state): block tables, rewritten only when the sequence's
    ``table_version`` stamp moves, and sampling parameters, written when a
    sequence first runs with them. A step then gathers rows by index instead of
    converting Python lists and parameter objects for every sequence.

    A sequence's row is its KV column slot + 1; row 0 stays null: an all-null
    table (padding reads only the null page) and greedy sampling without stop ids.

    Penalties need the tokens so far: rows whose sequence has a penalty keep
    them in ``history`` (``history_width`` each, allocated when a first
    sequence asks), appended to as the sequence grows.

    Sliding groups' tables are rings (``rings[g]`` entries, block b at
    ``b % rings[g]``; see ``sliding_ring``). Released blocks are not written
    back as null there: the attention never reads an entry outside the blocks
    its queries see, and by then a newer block may own it.
    """

    def __init__(
        self,
        groups: int,
        width: int,
        rings: np.ndarray[Any, Any] | None = None,
        history_width: int = 0,
    ) -> None:
        self.groups, self.width = groups, width
        self.history_width = history_width
        self.history: np.ndarray[Any, Any] | None = None  # [rows, history_width] token ids
        self.filled = np.zeros(1, np.int64)  # tokens of each row's history written
        self.rings = rings if rings is not None else np.full(groups, NOT_A_RING, np.int32)
        self._ring_groups = [g for g in range(groups) if self.rings[g] < width]
        self.capacity = 0
        self.tables = np.zeros((groups, 1, width), np.int32)
        self.ints = np.zeros((1, SAMPLING_INTS), np.int32)
        self.floats = np.zeros((1, SAMPLING_FLOATS), np.float32)
        # Logit biases ([rows, BIAS_WIDTH], allocated when a first sequence
        # asks), and per row whether it has some, penalties, or top logprobs:
        # what a step asks of its rows, one gather each.
        self.bias: np.ndarray[Any, Any] | None = None
        self.biased = np.zeros(1, np.bool_)
        self.penalties = np.zeros(1, np.bool_)
        self.tops = np.zeros(1, np.bool_)
        self.stamps = np.zeros(1, np.int64)  # the table version each row holds
        # The last step's gathered sampling rows: steady decode asks for the
        # same rows step after step.
        self._gathered: tuple[bytes, np.ndarray[Any, Any], np.ndarray[Any, Any]] | None = None
        self.serials = np.zeros(1, np.int64)  # the sequence whose sampling each row holds
        self._seeds = np.random.default_rng()
        self._grow(64)

    def _grow(self, capacity: int) -> None:
        rows = capacity + 1
        tables = np.zeros((self.groups, rows, self.width), np.int32)
        tables[:, : self.tables.shape[1]] = self.tables
        ints = np.zeros((rows, SAMPLING_INTS), np.int32)
        ints[:, SAMPLING_STOP:] = -1
        ints[: len(self.ints)] = self.ints
        floats = np.zeros((rows, SAMPLING_FLOATS), np.float32)
        floats[:, 1] = 1.0  # top_p off
        floats[:, SAMPLING_PENALTIES : SAMPLING_PENALTIES + 3] = NEUTRAL_PENALTIES
        floats[: len(self.floats)] = self.floats
        if self.bias is not None:
            self.bias = _grown(self.bias, rows, _neutral_bias(rows))
        self.biased = _grown(self.biased, rows, np.zeros(rows, np.bool_))
        self.penalties = _grown(self.penalties, rows, np.zeros(rows, np.bool_))
        self.tops = _grown(self.tops, rows, np.zeros(rows, np.bool_))
        filled = np.zeros(rows, np.int64)
        filled[: len(self.filled)] = self.filled
        self.filled = filled
        if self.history is not None:
            history = np.full((rows, self.history_width), -1, np.int32)
            history[: len(self.history)] = self.history
            self.history = history
        stamps = np.full(rows, -1, np.int64)
        stamps[: len(self.stamps)] = self.stamps
        stamps[0] = 0
        serials = np.full(rows, -1, np.int64)
        serials[: len(self.serials)] = self.serials
        serials[0] = 0
        self.tables, self.ints, self.floats = tables, ints, floats
        self.stamps, self.serials = stamps, serials
        self._gathered = None
        self.capacity = capacity

    def prepare(
        self,
        seqs: Seq[Sequence],
        slots: np.ndarray[Any, Any],
        params: ParamsLookup,
        versions: np.ndarray[Any, Any],
        serials: np.ndarray[Any, Any],
        edits: list[tuple[int, int, int, int]] | None = None,
    ) -> np.ndarray[Any, Any]:
        """The rows of ``seqs`` (at column ``slots``; their tables' ``versions``,
        their ``serials``), brought up to date: the KV manager's logged
        ``edits`` applied (and the list emptied), tables rewritten where their
        version moved, sampling where the row has a new sequence (a sequence's
        parameters are read when it first runs)."""
        rows = slots + 1
        if len(rows) and int(rows.max()) > self.capacity:
            self._grow(max(2 * self.capacity, int(rows.max())))
        if edits:
            self.apply(edits)
        for i in np.flatnonzero(self.stamps[rows] != versions).tolist():
            self._write_tables(int(rows[i]), seqs[i], int(versions[i]))
        for i in np.flatnonzero(self.serials[rows] != serials).tolist():
            if params[i] is not None:
                try:
                    if faults.fire("sequence") == "raise":
                        raise faults.InjectedFault("injected: a sequence's inputs")
                    self._write_sampling(int(rows[i]), params[i], len(seqs[i].tokens))  # type: ignore[arg-type]
                    self.filled[rows[i]] = 0
                except (ValueError, TypeError, OverflowError, faults.InjectedFault) as exc:
                    # Its own parameters: the rows written so far are valid
                    # for the next step, which runs without it.
                    raise SequenceFault(i, exc) from exc
                self.serials[rows[i]] = serials[i]
        return rows

    def apply(self, edits: list[tuple[int, int, int, int]]) -> None:
        """Patch single table entries, (slot, group, block, page) each, in the
        order logged; then forget them."""
        most = max(edit[0] for edit in edits) + 1
        if most > self.capacity:
            self._grow(max(2 * self.capacity, most))
        tables, rings = self.tables, self.rings
        # In order: a later edit of an entry wins. Only growth logs a page into a
        # sliding group (its newest block), so a ring entry is never given back
        # to an older block.
        for slot, group, block, page in edits:
            ring = rings[group]
            if ring >= self.width:
                tables[group, slot + 1, block] = page
            elif page:
                tables[group, slot + 1, block % ring] = page
        edits.clear()

    def _write_tables(self, row: int, seq: Sequence, version: int) -> None:
        write_table_row(self.tables[:, row], seq, self.rings, self._ring_groups)
        self.stamps[row] = version

    def _write_sampling(self, row: int, params: SamplingParams, length: int) -> None:
        """``length``: the sequence's, at its first step (min_tokens count from it)."""
        ints, floats = self.ints[row], self.floats[row]
        self._gathered = None
        # A request without a seed draws one here, once: its key still moves with
        # every position, and a resumed request keeps sampling the same stream.
        seed = params.seed if params.seed is not None else int(self._seeds.integers(2**32))
        ints[0] = params.top_k
        ints[1] = np.uint32(seed).view(np.int32)
        ints[2] = 0  # the position, filled per step
        ints[3] = params.logprobs
        if params.resumed_output > length:
            raise ValueError("resumed_output exceeds the sequence")
        prompt = length - params.resumed_output
        ints[SAMPLING_MIN_END] = prompt + params.min_tokens if params.min_tokens else 0
        ints[SAMPLING_TOP] = params.top_logprobs
        ints[SAMPLING_PROMPT] = prompt
        ints[SAMPLING_SCORE] = -1 if params.prompt_logprobs is None else params.prompt_logprobs
        ints[SAMPLING_STOP:] = -1
        ints[SAMPLING_STOP : SAMPLING_STOP + len(params.stop_token_ids)] = params.stop_token_ids
        floats[0] = params.temperature
        floats[1] = params.top_p
        floats[2] = params.min_p
        floats[SAMPLING_PENALTIES : SAMPLING_PENALTIES + 3] = (
            params.presence_penalty,
            params.frequency_penalty,
            params.repetition_penalty,
        )
        self.penalties[row] = bool(
            (floats[SAMPLING_PENALTIES : SAMPLING_PENALTIES + 3] != NEUTRAL_PENALTIES).any()
        )
        self.biased[row] = bool(params.logit_bias)
        self.tops[row] = params.top_logprobs > 0
        if params.logit_bias and self.bias is None:
            self.bias = _neutral_bias(len(self.ints))
        if self.bias is not None:  # no earlier sequence's biases
            self.bias[row, :MAX_LOGIT_BIAS] = -1
            self.bias[row, MAX_LOGIT_BIAS:] = 0
        if params.logit_bias:
            assert self.bias is not None
            ids, biases = zip(*params.logit_bias, strict=True)
            self.bias[row, : len(ids)] = ids
            values = np.asarray(biases, np.float32).view(np.int32)
            self.bias[row, MAX_LOGIT_BIAS : MAX_LOGIT_BIAS + len(ids)] = values

    def sampling(
        self, rows: np.ndarray[Any, Any], positions: np.ndarray[Any, Any]
    ) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        """Packed sampling arrays for ``rows`` (padded with row 0): (ints, floats).

        The floats are handed out as gathered, and never written after: the
        same array may go to several steps in a row, one of them still in
        flight. The ints carry each row's position, so each step gets a copy."""
        key = rows.tobytes()
        if self._gathered is None or self._gathered[0] != key:
            self._gathered = key, self.ints[rows], self.floats[rows].ravel()
        ints = self._gathered[1].copy()
        ints[: len(positions), 2] = positions
        return ints.ravel(), self._gathered[2]

    def penalized(self, rows: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """Which of ``rows`` have a penalty (bool per row)."""
        return self.penalties[rows]

    def want_top(self, rows: np.ndarray[Any, Any]) -> bool:
        """Whether one of ``rows`` asks for its alternatives' logprobs."""
        return _any_of(self.tops, rows)

    def any_penalized(self, rows: np.ndarray[Any, Any]) -> bool:
        """Whether one of ``rows`` has a penalty."""
        return _any_of(self.penalties, rows)

    def biases(self, rows: np.ndarray[Any, Any], count: int) -> np.ndarray[Any, Any] | None:
        """The logit bias rows of ``rows`` (a sequence bucket's, its first
        ``count`` the step's sequences), or None when none of them has a bias."""
        if self.bias is None or not _any_of(self.biased, rows[:count]):
            return None
        return self.bias[rows]

    def histories(
        self, rows: np.ndarray[Any, Any], seqs: Seq[Sequence], ends: np.ndarray[Any, Any]
    ) -> np.ndarray[Any, Any]:
        """The token histories of ``rows`` ``[len(rows), history_width]`` (-1
        past each end), brought up to ``ends`` for the penalized rows of
        ``seqs`` (the first ``len(seqs)`` of ``rows``): only the tokens a row
        has not written yet are copied, and only known ones: a newest token a
        step in flight sampled stays -1 here (the head reads it on the
        device), and is copied once known."""
        if self.history is None:
            self.history = np.full((len(self.ints), self.history_width), -1, np.int32)
        history, filled = self.history, self.filled
        for i in np.flatnonzero(self.penalized(rows[: len(seqs)])).tolist():
            row, end = int(rows[i]), int(ends[i])
            known = min(end, seqs[i].known_tokens)
            start = int(filled[row])
            if start < known:
                history[row, start:known] = seqs[i].tokens[start:known]
                filled[row] = known
            history[row, known:end] = -1  # not an older sequence's token
        return history[rows]


def build_step_batch(
    work: Seq[tuple[Sequence, int]],
    layout: PageLayout,
    num_tokens: int,
    num_seqs: int,
    width: int,
    ring: int = 0,
) -> StepBatch:
    """Arrays for computing ``n`` more tokens of each sequence (pages allocated).

    ``num_tokens``, ``num_seqs`` and ``width`` are the padded bucket sizes;
    ``ring``: the sliding groups' table entries (0: full tables).
    """
    rings = group_rings(layout, ring)
    ring_groups = [g for g in range(layout.num_groups) if rings[g] < width]
    tables = np.zeros((layout.num_groups, num_seqs, width), np.int32)
    for row, (seq, _) in enumerate(work):
        write_table_row(tables[:, row], seq, rings, ring_groups)
    tokens = [t for seq, n in work for t in seq.tokens[seq.num_computed : seq.num_computed + n]]
    starts = [seq.num_computed for seq, _ in work]
    lengths = [n for _, n in work]
    return assemble_step_batch(
        tokens, starts, lengths, tables, layout.block_size, num_tokens, rings
    )


def assemble_step_batch(
    tokens: Seq[int] | np.ndarray[Any, Any],
    starts: Seq[int] | np.ndarray[Any, Any],
    lengths: Seq[int],
    tables: np.ndarray[Any, Any],
    block_size: int,
    num_tokens: int,
    rings: np.ndarray[Any, Any] | None = None,
) -> StepBatch:
    """A StepBatch from a step's flattened tokens, each sequence's first
    position and token count, and its block tables ``[G, S, W]`` (row i for
    sequence i; ``rings``: each group's ring modulus, see ``group_rings``).
    Padding tokens have position -1 (attention gives them nothing to see),
    write into the null page and, when a spare row exists, point at an
    all-null table row; their outputs are never used."""
    num_seqs = tables.shape[1]
    count = len(lengths)
    total = len(tokens)
    token_array = np.zeros(num_tokens, np.int32)
    token_array[:total] = tokens
    positions = np.full(num_tokens, -1, np.int32)
    seq_index = np.full(num_tokens, count if count < num_seqs else 0, np.int32)
    if total == count:  # all decodes: one token each
        positions[:count] = starts
        seq_index[:count] = np.arange(count, dtype=np.int32)
        ends = np.arange(count, dtype=np.int32)
    else:
        length_array = np.asarray(lengths, np.int32)
        ends = np.cumsum(length_array) - 1
        first = np.repeat(ends + 1 - length_array, length_array)
        positions[:total] = (
            np.repeat(np.asarray(starts, np.int32), length_array)
            + np.arange(total, dtype=np.int32)
            - first
        )
        seq_index[:total] = np.repeat(np.arange(count, dtype=np.int32), length_array)
    blocks = np.maximum(positions, 0) // block_size
    write_pages = _write_pages(tables, seq_index, blocks, rings)  # [Gp, T]
    write_pages[:, total:] = 0  # padding writes into the null page
    sample_index = np.zeros(num_seqs, np.int32)
    sample_index[:count] = ends
    return StepBatch(
        tokens=token_array,
        positions=positions,
        seq_index=seq_index,
        write_pages=write_pages,
        write_offsets=np.maximum(positions, 0) % block_size,
        tables=tables,
        sample_index=sample_index,
    )


def pack_decode_step(
    tokens: np.ndarray[Any, Any],
    starts: np.ndarray[Any, Any],
    tables: np.ndarray[Any, Any],
    block_size: int,
    num_tokens: int,
    rings: np.ndarray[Any, Any] | None = None,
    tail: int = 0,
) -> np.ndarray[Any, Any]:
    """``pack(assemble_step_batch(...))`` for a step of decodes only (one token
    per sequence, sequence i's at row i), written straight into the flat buffer,
    followed by ``tail`` zeros for the caller's own (no second copy to append them).

    Every step runs this, right after the model call has flushed the CPU's
    caches, when each numpy call costs several times its usual fixed price: so
    it makes as few as it can.
    """
    groups, num_seqs, width = tables.shape
    count = len(starts)
    t = num_tokens
    size = 4 * t + groups * t + groups * num_seqs * width + num_seqs
    flat = np.zeros(size + tail, np.int32)
    rows = np.arange(count, dtype=np.int32)
    flat[:count] = tokens  # tokens
    flat[t + count : 2 * t] = -1  # padding positions
    flat[t : t + count] = starts  # positions
    if count < num_seqs:
        flat[2 * t + count : 3 * t] = count  # padding reads the null row after the last
    flat[2 * t : 2 * t + count] = rows  # seq_index
    pages = flat[3 * t : 3 * t + groups * t].reshape(groups, t)
    pages[:, :count] = _write_pages(tables, rows, starts // block_size, rings)  # write_pages
    at = 3 * t + groups * t
    flat[at : at + count] = starts % block_size  # write_offsets
    at += t
    flat[at : at + tables.size] = tables.ravel()
    at += tables.size
    flat[at : at + count] = rows  # sample_index
    return flat


def _write_pages(
    tables: np.ndarray[Any, Any],
    rows: np.ndarray[Any, Any],
    blocks: np.ndarray[Any, Any],
    rings: np.ndarray[Any, Any] | None,
) -> np.ndarray[Any, Any]:
    """The page of each token's block in every group ``[G, T]``, through rings."""
    if rings is None:
        return tables[:, rows, blocks]  # type: ignore[no-any-return]
    groups = np.arange(tables.shape[0])[:, None]
    return tables[groups, rows[None, :], blocks[None, :] % rings[:, None]]  # type: ignore[no-any-return]


def pack(arrays: Iterable[Any]) -> np.ndarray[Any, Any]:
    """Host arrays of one dtype flattened into one buffer: one transfer, not seven."""
    return np.concatenate([np.ravel(a) for a in arrays])


def unpack(flat: jax.Array, shapes: Seq[tuple[int, ...]]) -> list[jax.Array]:
    """Inside jit: the arrays ``pack`` flattened, by their static shapes."""
    out, at = [], 0
    for shape in shapes:
        size = math.prod(shape)
        out.append(flat[at : at + size].reshape(shape))
        at += size
    return out


def batch_shapes(tokens: int, seqs: int, width: int, groups: int) -> list[tuple[int, ...]]:
    """The shapes of a StepBatch's fields, in field order."""
    return [
        (tokens,),
        (tokens,),
        (tokens,),
        (groups, tokens),
        (tokens,),
        (groups, seqs, width),
        (seqs,),
    ]
