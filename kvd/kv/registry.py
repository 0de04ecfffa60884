"""The KV manager's shared record: the pool, the ledger, the host cache, the
sharing configuration, and the live sequences with their columns; adding
sequences and their tokens.

Every part of the KV manager (``prefix.py``, ``allocation.py``,
``commit.py``, ``swap.py``) holds this one record and says, in its own
docstring, which of its fields it may change. Only the manager itself
(``manager.py``) changes the configuration: ``policy``, ``generation`` and
``public``."""

from __future__ import annotations

import itertools
import operator
from collections import deque
from collections.abc import Iterable
from typing import Any

import numpy as np

from kvd.kv.columns import (
    LAST_TOKEN,
    LENGTH,
    PENDING,
    PLACEHOLDER,
    SERIAL,
    SequenceColumns,
)
from kvd.kv.geometry import AttentionKind
from kvd.kv.hostcache import HostCache
from kvd.kv.layout import PageLayout
from kvd.kv.ledger import SHARED_ACCOUNT, BudgetMode, Ledger
from kvd.kv.pool import PagePool
from kvd.kv.records import Demand, KVError, PrefixHit
from kvd.kv.scope import PublicPrefixes, SharingPolicy
from kvd.kv.sequence import Sequence


class SequenceRegistry:
    def __init__(
        self,
        layout: PageLayout,
        num_pages: int,
        *,
        mode: BudgetMode = BudgetMode.RESERVE,
        policy: SharingPolicy = SharingPolicy.PUBLIC,
    ) -> None:
        self.layout = layout
        self.block_size = layout.block_size
        self.ledger = Ledger(num_pages - 1, mode)
        self.pool = PagePool(num_pages, self.ledger)
        self.host = HostCache(0)  # off until ``enable_host_cache``
        self.host.add_account(SHARED_ACCOUNT)
        self.host.on_drop = self.pool.lost  # the device blocks that chained on it may go
        self.policy = SharingPolicy(policy)
        self.public = PublicPrefixes()
        self.sequences: dict[int, Sequence] = {}
        self.columns = SequenceColumns()
        self.stamps = itertools.count(1)  # table versions, unique across sequences
        # Single-entry table changes, (slot, group, block, page), for a device-side
        # copy of the tables that ``log_table_edits`` asked for (None: not kept).
        # The two per-block events of a decode (a new block, a block sliding
        # out) are logged instead of moving ``table_version``, so that copy is
        # patched in place rather than rewritten row by row.
        self.table_edits: list[tuple[int, int, int, int]] | None = None
        self.num_groups = layout.num_groups
        self.global_groups = tuple(g.index for g in layout.groups_of(AttentionKind.GLOBAL))
        self.sliding_groups = tuple(g.index for g in layout.groups_of(AttentionKind.SLIDING))
        self.window = layout.geometry.window if self.sliding_groups else None
        self._arrivals = 0
        self.generation = 0  # bumped by every change of who may share what
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.host_hit_tokens = 0

    def stamp(self) -> int:
        """A new table version (a sequence's tables changed, or it is new)."""
        return next(self.stamps)

    def cache_epoch(self) -> int:
        """Moves whenever a cached block leaves the device or the host cache or the host cache
        hands one back: a prefix hit from an older epoch may name it."""
        return self.pool.evictions + self.host.evictions + self.host.reloaded

    def hit_is_current(self, hit: PrefixHit) -> bool:
        """Nothing a prefix hit names has left the device or the host cache, and sharing is as it
        was, since the lookup that made it."""
        return hit.epoch == self.cache_epoch() and hit.generation == self.generation

    def fits(self, tenant: str, demand: Demand) -> bool:
        """Idle pages suffice, and new charges (if any) stay within the budget.

        A tenant over its budget (after a live cut) may still fill the blocks
        it holds: only new charges are refused.
        """
        return demand.idle_pages <= self.pool.num_idle() and (
            demand.charges == 0 or demand.charges <= self.ledger.headroom(tenant)
        )

    def log_table_edits(self) -> list[tuple[int, int, int, int]]:
        """Start logging single-entry table edits (see ``table_edits``); the
        caller drains the returned list as it applies them."""
        if self.table_edits is None:
            self.table_edits = []
        return self.table_edits

    def add_sequence(
        self,
        seq_id: int,
        tenant: str,
        tokens: Iterable[int],
        *,
        tier: int = 0,
        cache_salt: str | None = None,
    ) -> Sequence:
        if seq_id in self.sequences:
            raise KVError(f"sequence {seq_id} already exists")
        self.ledger.tenant(tenant)  # raises BudgetError for an unknown tenant
        token_list = list(tokens)
        if not token_list:
            raise KVError("a sequence needs at least one token")
        self._arrivals += 1
        seq = Sequence(
            seq_id,
            tenant,
            token_list,
            tier,
            self._arrivals,
            cache_salt,
            self.num_groups,
            self.columns,
        )
        seq.table_version = self.stamp()
        self.columns.set(SERIAL, seq.slot, self.stamp())
        self.sequences[seq_id] = seq
        return seq

    def own(self, seq: Sequence) -> None:
        """Refuse a Sequence this manager does not hold (finished, or another's)."""
        if self.sequences.get(seq.seq_id) is not seq:
            raise KVError(f"sequence {seq.seq_id} is not live in this KV manager")

    def append_tokens(self, seq: Sequence, tokens: Iterable[int]) -> None:
        self.own(seq)
        seq.extend_tokens(tokens)

    def append_decoded(
        self,
        seqs: list[Sequence],
        tokens: list[int],
        slots: np.ndarray[Any, Any] | None = None,
        lengths: np.ndarray[Any, Any] | None = None,
    ) -> None:
        """One sampled token for each of ``seqs`` (``append_tokens`` for a whole
        step). ``slots`` and ``lengths`` (their ``slots_of`` and token counts),
        if the caller has them from this step."""
        if slots is None:
            slots = self.slots_of(seqs)
        if lengths is None:
            lengths = self.columns.matrix[LENGTH, slots]
        deque(map(list.append, [seq.tokens for seq in seqs], tokens), maxlen=0)
        matrix = self.columns.matrix
        matrix[LENGTH, slots] = lengths + 1
        matrix[LAST_TOKEN, slots] = tokens

    def append_pending(
        self, seqs: list[Sequence], slots: np.ndarray[Any, Any], lengths: np.ndarray[Any, Any]
    ) -> None:
        """A placeholder token for each of ``seqs``, sampled by a step just
        dispatched (``lengths``: their token counts before it): the next step
        can be planned around it, and ``resolve_pending`` writes its value."""
        lists = [seq.tokens for seq in seqs]
        deque(map(list.append, lists, itertools.repeat(PLACEHOLDER)), maxlen=0)
        matrix = self.columns.matrix
        matrix[LENGTH, slots] = lengths + 1
        matrix[LAST_TOKEN, slots] = PLACEHOLDER
        matrix[PENDING, slots] += 1

    def resolve_pending(
        self,
        seqs: list[Sequence],
        tokens: list[int],
        slots: np.ndarray[Any, Any],
        lengths: np.ndarray[Any, Any],
    ) -> None:
        """The values of placeholders ``append_pending`` wrote at ``lengths``
        (the oldest pending token of each of ``seqs``)."""
        for seq, at, token in zip(seqs, lengths.tolist(), tokens, strict=True):
            seq.tokens[at] = token
        matrix = self.columns.matrix
        last = matrix[LENGTH, slots] == lengths + 1
        matrix[LAST_TOKEN, slots[last]] = np.asarray(tokens, np.int64)[last]
        matrix[PENDING, slots] -= 1

    def drop_pending(self, seq: Sequence) -> None:
        """Forget ``seq``'s placeholders (it ends before their steps are read)."""
        pending = seq.pending
        if pending:
            del seq.tokens[-pending:]
            seq.pending = 0
            self.columns.set(LENGTH, seq.slot, len(seq.tokens))
            self.columns.set(LAST_TOKEN, seq.slot, seq.tokens[-1] if seq.tokens else 0)

    def slots_of(self, seqs: list[Sequence]) -> np.ndarray[Any, Any]:
        """The column slots of live sequences of this manager (KVError otherwise)."""
        slots = np.fromiter([seq.slot for seq in seqs], np.int64, len(seqs))
        owner = self.columns.owner
        try:
            owned = all(map(operator.is_, map(owner.__getitem__, slots.tolist()), seqs))
        except IndexError:  # a slot of another manager's columns
            owned = False
        if not owned:
            stranger = next(seq for seq in seqs if self.sequences.get(seq.seq_id) is not seq)
            raise KVError(f"sequence {stranger.seq_id} is not live in this KV manager")
        return slots

    def first_needed_block(self, position: int) -> int:
        """The first block a query at ``position`` sees in a sliding group."""
        assert self.window is not None
        return max(0, (position - self.window + 1) // self.block_size)
