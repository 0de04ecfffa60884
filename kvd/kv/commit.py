"""After a step: computed tokens committed (full blocks cached, sliding
windows releasing what no future query sees), and sequences letting go of
their pages (a recompute's release, or the end)."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvd.kv.columns import (
    ALLOCATED,
    COMPUTED,
    RESIDENT,
    SLIDING_START,
    StepColumns,
)
from kvd.kv.pool import NULL_PAGE
from kvd.kv.prefix import PrefixCache
from kvd.kv.records import KVError
from kvd.kv.registry import SequenceRegistry
from kvd.kv.sequence import Residency, Sequence


class Committer:
    """Changes: sequences' computed counts, sliding starts and tables as
    windows slide; pages dropped back to the pool; a released sequence's
    residency (back to waiting) and a finished one's removal from the registry."""

    def __init__(self, registry: SequenceRegistry, prefix: PrefixCache) -> None:
        self.registry = registry
        self.prefix = prefix

    def commit(self, seq: Sequence, num_tokens: int) -> None:
        """The engine wrote K/V for the next ``num_tokens`` tokens.

        Newly full blocks enter the prefix cache; sliding groups release the
        blocks no future query can see.
        """
        self.registry.own(seq)
        if seq.residency is not Residency.RESIDENT:
            raise KVError(f"sequence {seq.seq_id} is {seq.residency.value}, not resident")
        old = seq.num_computed
        new = old + num_tokens
        if num_tokens < 1 or new > seq.num_allocated:
            raise KVError(f"cannot commit {num_tokens} tokens to sequence {seq.seq_id}")
        seq.num_computed = new
        bs = self.registry.block_size
        if new // bs > seq.registered:
            self.prefix.register_blocks(seq, seq.registered, new // bs)
        if (
            self.registry.window is not None
            and new - self.registry.window + 1 >= (seq.sliding_start + 1) * bs
        ):
            self._slide(seq, self.registry.first_needed_block(new))

    def commit_batch(
        self,
        seqs: list[Sequence],
        counts: list[int],
        slots: np.ndarray[Any, Any] | None = None,
    ) -> None:
        """``commit`` for a whole step: ``counts[i]`` tokens of ``seqs[i]``
        (``slots``: their ``slots_of``, if the caller has it from this step).

        The column fields move as arrays; only the sequences that fill a block or
        move their window past one do Python work. All or nothing: a bad entry
        raises before anything changes.
        """
        if not seqs:
            return
        if slots is None:
            slots = self.registry.slots_of(seqs)
        before = self.registry.columns.matrix[:, slots]
        counts_array = np.asarray(counts, np.int64)
        old = before[COMPUTED]
        new = old + counts_array
        bad = (before[RESIDENT] != 1) | (counts_array < 1) | (new > before[ALLOCATED])
        if bad.any() or _repeats(slots):
            for seq, count in zip(seqs, counts, strict=True):  # the precise error
                if seq.residency is not Residency.RESIDENT:
                    raise KVError(f"sequence {seq.seq_id} is {seq.residency.value}, not resident")
                if count < 1 or seq.num_computed + count > seq.num_allocated:
                    raise KVError(f"cannot commit {count} tokens to sequence {seq.seq_id}")
            raise KVError("a sequence appears twice in one commit")
        self.registry.columns.matrix[COMPUTED, slots] = new
        bs = self.registry.block_size
        for i in np.flatnonzero(new // bs > old // bs).tolist():
            seq = seqs[i]
            self.prefix.register_blocks(seq, seq.registered, int(new[i]) // bs)
        self._slide_moved(seqs, before, new)

    def commit_decodes(
        self, seqs: list[Sequence], slots: np.ndarray[Any, Any], step: StepColumns
    ) -> None:
        """``commit_batch`` of one token each, for ``seqs`` at ``slots`` whose
        columns before the step are ``step``."""
        before = step.matrix
        computed = before[COMPUTED]
        new = computed + 1
        # Resident (1), with room allocated for the token: the product is >= 1.
        if int(((before[ALLOCATED] - computed) * before[RESIDENT]).min()) < 1 or _repeats(slots):
            self.commit_batch(seqs, [1] * len(seqs), slots)  # raises the precise error
            return
        self.registry.columns.matrix[COMPUTED, slots] = new
        # The blocks decodes fill enter the prefix cache when the sequence lets go
        # of its pages (``_drop_all``), as SGLang inserts a request's output when
        # it finishes: hashing and indexing one block per sequence every
        # ``block_size`` steps would be a large share of a decode step's host time.
        self._slide_moved(seqs, before, new)

    def _slide_moved(
        self, seqs: list[Sequence], before: np.ndarray[Any, Any], new: np.ndarray[Any, Any]
    ) -> None:
        """After a batched commit to ``new`` computed tokens (``before``: the
        columns before it), slide the windows that moved past a block: every
        ``block_size`` steps each decoding sequence comes here, so the new
        window starts are computed and stored as arrays, and only the pages
        leaving are handled one by one."""
        registry = self.registry
        window = registry.window
        if window is None:
            return
        bs = registry.block_size
        starts = before[SLIDING_START]
        firsts = np.maximum(0, (new - window + 1) // bs)
        moved = np.flatnonzero(firsts > starts)
        if not len(moved):
            return
        firsts, starts = firsts[moved], starts[moved]
        for i, first, start in zip(moved.tolist(), firsts.tolist(), starts.tolist(), strict=True):
            self._release_window(seqs[i], first, start)
        registry.columns.matrix[SLIDING_START, [seqs[i].slot for i in moved.tolist()]] = firsts

    def _release_window(self, seq: Sequence, first_needed: int, start: int) -> None:
        """Drop the sliding groups' pages of blocks [start, first_needed) of
        ``seq`` (newest first), leaving its ``sliding_start`` to the caller."""
        registry = self.registry
        drop, tenant, edits = registry.pool.drop, seq.tenant, registry.table_edits
        tables = seq.tables
        for block in range(first_needed - 1, start - 1, -1):
            for g in registry.sliding_groups:
                table = tables[g]
                page = table[block]
                if page:
                    drop(page, tenant)
                    table[block] = NULL_PAGE
                    if edits is not None:
                        edits.append((seq.slot, g, block, NULL_PAGE))
        if edits is None:
            seq.table_version = registry.stamp()

    def _slide(self, seq: Sequence, first_needed: int) -> None:
        self._release_window(seq, first_needed, seq.sliding_start)
        seq.sliding_start = first_needed

    def release(self, seq: Sequence) -> None:
        """Drop every page (preemption by recompute, or the end of a sequence).

        The tokens are kept; the sequence waits to be prefilled again, and its
        full blocks stay cached, tail first in the LRU, so a re-prefill finds
        as much of itself as the pool could keep.
        """
        self.registry.own(seq)
        if seq.residency is Residency.SWAPPING_OUT:
            raise KVError("finish a swap-out before releasing the sequence")
        self._drop_all(seq)
        seq.num_blocks = 0
        seq.num_computed = seq.num_allocated = 0
        seq.sliding_start = 0
        seq.registered = 0
        seq.swapped_blocks = None
        seq.residency = Residency.WAITING

    def finish(self, seq: Sequence) -> None:
        """Release every page and forget the sequence."""
        self.registry.own(seq)
        if seq.residency is Residency.SWAPPING_OUT:
            raise KVError("finish a swap-out before removing the sequence")
        self.release(seq)
        seq.residency = Residency.RELEASED
        del self.registry.sequences[seq.seq_id]
        seq.detach()

    def _drop_all(self, seq: Sequence) -> None:
        self.prefix.register_pending(seq)  # what decode steps filled stays findable
        drop, tenant = self.registry.pool.drop, seq.tenant
        held_blocks = len(seq.tables[0])  # 0 once swapped out, num_blocks otherwise
        for block in range(held_blocks - 1, -1, -1):
            for table in seq.tables:
                page = table[block]
                if page:
                    drop(page, tenant)
        for table in seq.tables:
            table.clear()
        if seq.kept is not None:
            for group in seq.kept:
                for page in group.values():
                    drop(page, tenant)
            seq.kept = None
        seq.table_version = self.registry.stamp()


def _repeats(slots: np.ndarray[Any, Any]) -> bool:
    """Whether a slot appears twice: each position writes its index at its
    slot, and a slot written twice keeps only one of them. Two scattered
    writes and reads, where a sort or a set of the slots cost several times
    more on the caches a device step leaves."""
    if not len(slots):
        return False
    order = np.arange(len(slots))
    marks = np.empty(int(slots.max()) + 1, np.int64)
    marks[slots] = order
    return bool((marks[slots] != order).any())
