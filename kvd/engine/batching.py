"""The host side of an engine step: KV manager state into padded int32 arrays.

The scheduler decides which sequences run and allocates their pages through
the KV manager; this turns that into one ``StepBatch`` padded to fixed
buckets, so a step after warm-up never compiles.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from typing import Any

import jax
import numpy as np

from kvd.engine.model import StepBatch
from kvd.engine.sampling import MAX_STOP_IDS, SamplingParams
from kvd.kv.layout import PageLayout
from kvd.kv.sequence import Sequence


def bucket(n: int, buckets: Seq[int]) -> int:
    """The smallest bucket that holds ``n``."""
    for size in buckets:
        if n <= size:
            return size
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


def powers_of_two(lo: int, hi: int) -> tuple[int, ...]:
    sizes, size = [], lo
    while size < hi:
        sizes.append(size)
        size *= 2
    sizes.append(hi)
    return tuple(sizes)


# A sequence's sampling row: top_k, seed, position, logprobs wanted, stop ids;
# and temperature, top_p.
SAMPLING_STOP = 4
SAMPLING_INTS = SAMPLING_STOP + MAX_STOP_IDS
SAMPLING_FLOATS = 2


@dataclass
class CollectedStep:
    """What ``SequenceRows.collect`` gathers of a step's sequences, in order."""

    sequences: list[Sequence]
    rows: list[int]  # each one's row in SequenceRows
    tokens: list[int]  # the tokens to compute, flattened
    starts: list[int]  # each one's first position
    lengths: list[int]  # how many tokens each computes
    widest: int  # the most blocks any of them holds


class SequenceRows:
    """What a step needs of each sequence that does not change from token to
    token, kept as rows of persistent arrays (as vLLM's input batch keeps its
    per-request state): block tables, rewritten only when the sequence's
    ``table_version`` moves, and sampling parameters, written when a sequence
    first runs with them. A decode step then gathers rows by index instead of
    converting Python lists and parameter objects for every sequence.

    Row 0 stays null: an all-null table (padding reads only the null page) and
    greedy sampling without stop ids.
    """

    def __init__(self, groups: int, rows: int, width: int) -> None:
        self.tables = np.zeros((groups, rows + 1, width), np.int32)
        self.ints = np.zeros((rows + 1, SAMPLING_INTS), np.int32)
        self.ints[:, SAMPLING_STOP:] = -1
        self.floats = np.zeros((rows + 1, SAMPLING_FLOATS), np.float32)
        self.floats[:, 1] = 1.0  # top_p off
        # seq id -> (row, table version, the sequence, its sampling params)
        self._rows: dict[int, tuple[int, int, Sequence, SamplingParams | None]] = {}
        self._free = list(range(rows, 0, -1))
        self._seeds = np.random.default_rng()

    def collect(self, work: Seq[tuple[Sequence, int, SamplingParams | None]]) -> CollectedStep:
        """One pass over a step's sequences, writing the rows of new or changed ones."""
        get = self._rows.get
        step = CollectedStep([], [], [], [], [], 0)
        rows, tokens, starts, lengths = step.rows, step.tokens, step.starts, step.lengths
        widest = 0
        for seq, n, params in work:
            entry = get(seq.seq_id)
            if (
                entry is None
                or entry[2] is not seq
                or entry[1] != seq.table_version
                or entry[3] is not params
            ):
                rows.append(self._write(seq, params, entry))
            else:
                rows.append(entry[0])
            start = seq.num_computed
            if n == 1:
                tokens.append(seq.tokens[start])
            else:
                tokens += seq.tokens[start : start + n]
            starts.append(start)
            lengths.append(n)
            if seq.num_blocks > widest:
                widest = seq.num_blocks
        step.sequences = [seq for seq, _, _ in work]
        step.widest = widest
        return step

    def _write(
        self,
        seq: Sequence,
        params: SamplingParams | None,
        entry: tuple[int, int, Sequence, SamplingParams | None] | None,
    ) -> int:
        if entry is not None and entry[2] is seq:
            row = entry[0]
        else:
            if entry is not None:  # the id was reused by a new sequence
                self._free.append(entry[0])
            if not self._free:
                self._reclaim()
            row = self._free.pop()
            entry = None
        if entry is None or entry[1] != seq.table_version:
            blocks = seq.num_blocks
            self.tables[:, row, :] = 0
            if blocks:
                self.tables[:, row, :blocks] = seq.tables
        if params is not None and (entry is None or entry[3] is not params):
            self._write_sampling(row, params)
        self._rows[seq.seq_id] = (row, seq.table_version, seq, params)
        return row

    def _write_sampling(self, row: int, params: SamplingParams) -> None:
        ints, floats = self.ints[row], self.floats[row]
        # A request without a seed draws one here, once: its key still moves with
        # every position, and a resumed request keeps sampling the same stream.
        seed = params.seed if params.seed is not None else int(self._seeds.integers(2**32))
        ints[0] = params.top_k
        ints[1] = np.uint32(seed).view(np.int32)
        ints[2] = 0  # the position, filled per step
        ints[3] = params.logprobs
        ints[SAMPLING_STOP:] = -1
        ints[SAMPLING_STOP : SAMPLING_STOP + len(params.stop_token_ids)] = params.stop_token_ids
        floats[0] = params.temperature
        floats[1] = params.top_p

    def _reclaim(self) -> None:
        from kvd.kv.sequence import KVState

        for seq_id, (row, _, seq, _) in list(self._rows.items()):
            if seq.state is not KVState.RESIDENT:
                del self._rows[seq_id]
                self._free.append(row)
        if not self._free:
            raise RuntimeError("more resident sequences than table rows")

    def sampling(
        self, rows: np.ndarray[Any, Any], positions: np.ndarray[Any, Any]
    ) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        """Packed sampling arrays for ``rows`` (padded with row 0): (ints, floats)."""
        ints = self.ints[rows]
        ints[: len(positions), 2] = positions
        return ints.ravel(), self.floats[rows].ravel()


def build_step_batch(
    work: Seq[tuple[Sequence, int]],
    layout: PageLayout,
    num_tokens: int,
    num_seqs: int,
    width: int,
) -> StepBatch:
    """Arrays for computing ``n`` more tokens of each sequence (pages allocated).

    ``num_tokens``, ``num_seqs`` and ``width`` are the padded bucket sizes.
    """
    tables = np.zeros((layout.num_groups, num_seqs, width), np.int32)
    for row, (seq, _) in enumerate(work):
        if seq.num_blocks:
            tables[:, row, : seq.num_blocks] = seq.tables
    tokens = [t for seq, n in work for t in seq.tokens[seq.num_computed : seq.num_computed + n]]
    starts = [seq.num_computed for seq, _ in work]
    lengths = [n for _, n in work]
    return assemble_step_batch(tokens, starts, lengths, tables, layout.block_size, num_tokens)


def assemble_step_batch(
    tokens: list[int],
    starts: list[int],
    lengths: list[int],
    tables: np.ndarray[Any, Any],
    block_size: int,
    num_tokens: int,
) -> StepBatch:
    """A StepBatch from a step's flattened tokens, each sequence's first
    position and token count, and its block tables ``[G, S, W]`` (row i for
    sequence i). Padding tokens write into the null page and, when a spare row
    exists, read an all-null table row; their outputs are never used."""
    num_seqs = tables.shape[1]
    count = len(lengths)
    total = len(tokens)
    token_array = np.zeros(num_tokens, np.int32)
    token_array[:total] = tokens
    positions = np.zeros(num_tokens, np.int32)
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
    write_pages = tables[:, seq_index, positions // block_size]  # [Gp, T]
    write_pages[:, total:] = 0  # padding writes into the null page
    sample_index = np.zeros(num_seqs, np.int32)
    sample_index[:count] = ends
    return StepBatch(
        tokens=token_array,
        positions=positions,
        seq_index=seq_index,
        write_pages=write_pages,
        write_offsets=positions % block_size,
        tables=tables,
        sample_index=sample_index,
    )


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
