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

from kvd.engine.model import StepBatch
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


class TableCache:
    """Block tables kept as rows of one int32 array, rewritten only when a
    sequence's tables change (its ``table_version`` moves): a decode step then
    gathers rows instead of converting every table from Python lists."""

    def __init__(self, groups: int, rows: int, width: int) -> None:
        self.array = np.zeros((groups, rows + 1, width), np.int32)  # row 0 stays null
        self._rows: dict[int, tuple[int, int, Sequence]] = {}  # seq id -> (row, version, seq)
        self._free = list(range(rows, 0, -1))

    def row(self, seq: Sequence) -> int:
        entry = self._rows.get(seq.seq_id)
        if entry is not None and entry[2] is seq:
            row, version, _ = entry
            if version == seq.table_version:
                return row
        else:
            if entry is not None:  # the id was reused by a new sequence
                self._free.append(entry[0])
            if not self._free:
                self._reclaim()
            row = self._free.pop()
        blocks = seq.num_blocks
        self.array[:, row, :] = 0
        if blocks:
            self.array[:, row, :blocks] = seq.tables
        self._rows[seq.seq_id] = (row, seq.table_version, seq)
        return row

    def _reclaim(self) -> None:
        from kvd.kv.sequence import KVState

        for seq_id, (row, _, seq) in list(self._rows.items()):
            if seq.state is not KVState.RESIDENT:
                del self._rows[seq_id]
                self._free.append(row)
        if not self._free:
            raise RuntimeError("more resident sequences than table rows")


def build_step_batch(
    work: Seq[tuple[Sequence, int]],
    layout: PageLayout,
    num_tokens: int,
    num_seqs: int,
    width: int,
    cache: TableCache | None = None,
) -> StepBatch:
    """Arrays for computing ``n`` more tokens of each sequence (pages allocated).

    ``num_tokens``, ``num_seqs`` and ``width`` are the padded bucket sizes.
    Padding tokens write into the null page and, when a spare row exists,
    read an all-null table row; their outputs are never used.
    """
    bs = layout.block_size
    count = len(work)
    lengths = np.fromiter((n for _, n in work), np.int32, count)
    starts = np.fromiter((seq.num_computed for seq, _ in work), np.int32, count)
    total = int(lengths.sum())
    tokens = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    seq_index = np.full(num_tokens, count if count < num_seqs else 0, np.int32)
    if total == count:  # all decodes: one token each
        tokens[:count] = [seq.tokens[seq.num_computed] for seq, _ in work]
        positions[:count] = starts
        seq_index[:count] = np.arange(count, dtype=np.int32)
    else:
        tokens[:total] = [
            t for seq, n in work for t in seq.tokens[seq.num_computed : seq.num_computed + n]
        ]
        first = np.repeat(np.cumsum(lengths) - lengths, lengths)
        positions[:total] = np.repeat(starts, lengths) + np.arange(total, dtype=np.int32) - first
        seq_index[:total] = np.repeat(np.arange(count, dtype=np.int32), lengths)
    if cache is not None:
        rows = np.zeros(num_seqs, np.int32)
        rows[:count] = [cache.row(seq) for seq, _ in work]
        tables = cache.array[:, rows, :width]
    else:
        tables = np.zeros((layout.num_groups, num_seqs, width), np.int32)
        for row, (seq, _) in enumerate(work):
            if seq.num_blocks:
                tables[:, row, : seq.num_blocks] = seq.tables
    write_pages = tables[:, seq_index, positions // bs]  # [Gp, T]
    write_pages[:, total:] = 0  # padding writes into the null page
    sample_index = np.zeros(num_seqs, np.int32)
    sample_index[:count] = np.cumsum(lengths) - 1
    return StepBatch(
        tokens=tokens,
        positions=positions,
        seq_index=seq_index,
        write_pages=write_pages,
        write_offsets=positions % bs,
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
