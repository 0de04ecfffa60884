"""Growing a sequence: what an allocation would take (``demand``), whether it
fits the idle pages and the tenant's budget, and taking the pages, with the
fast paths a decode step uses (room in the last block; a new block for every
decode at once when nobody competes)."""

from __future__ import annotations

from collections import deque
from itertools import repeat
from typing import Any

import numpy as np

from kvd.kv.columns import (
    ALLOCATED,
    BLOCKS,
    COMPUTED,
    LENGTH,
    RESIDENT,
    StepColumns,
)
from kvd.kv.events import CPU
from kvd.kv.prefix import PrefixCache
from kvd.kv.records import Demand, KVError, PrefixHit
from kvd.kv.registry import SequenceRegistry
from kvd.kv.sequence import Residency, Sequence


class Allocator:
    """Changes: the pages sequences hold (``pool.take``/``touch``), their tables,
    block counts, allocated counts and residency from waiting to resident; the
    host cache's claims (a reload); the registry's prefix counters and the
    public prefixes' hit counts."""

    def __init__(self, registry: SequenceRegistry, prefix: PrefixCache) -> None:
        self.registry = registry
        self.prefix = prefix

    def demand(self, seq: Sequence, num_tokens: int, hit: PrefixHit | None = None) -> Demand:
        """What ``allocate(seq, num_tokens, hit)`` would take; changes nothing."""
        computed, blocks = self._start_point(seq, num_tokens, hit)
        needed_blocks = -(-(computed + num_tokens) // self.registry.block_size)
        fresh = max(0, needed_blocks - blocks) * self.registry.num_groups
        reused = charged = 0
        if hit is not None:
            fresh += len(hit.reloads)  # host-cache blocks come back into fresh pages
            charged += len(hit.reloads)
            holders, public = self.registry.pool.holders, self.registry.pool.public
            for table in hit.pages:
                for page in table:
                    if page and holders[page] is None:
                        reused += 1
                        charged += not public[page]
        return Demand(fresh, reused, fresh + charged)

    def _start_point(
        self, seq: Sequence, num_tokens: int, hit: PrefixHit | None
    ) -> tuple[int, int]:
        self.registry.own(seq)
        if num_tokens < 1:
            raise KVError("allocate at least one token")
        if seq.residency is Residency.WAITING:
            computed = hit.num_tokens if hit is not None else 0
            blocks = hit.num_blocks if hit is not None else 0
        elif seq.residency is Residency.RESIDENT:
            if hit is not None:
                raise KVError("a prefix hit applies only to a waiting sequence")
            computed, blocks = seq.num_computed, seq.num_blocks
        else:
            raise KVError(f"sequence {seq.seq_id} is {seq.residency.value}")
        if computed + num_tokens > len(seq.tokens):
            raise KVError(
                f"sequence {seq.seq_id} has {len(seq.tokens)} tokens; cannot compute "
                f"{num_tokens} more after {computed}"
            )
        return computed, blocks

    def can_allocate(self, seq: Sequence, num_tokens: int, hit: PrefixHit | None = None) -> bool:
        demand = self.demand(seq, num_tokens, hit)
        return self.registry.fits(seq.tenant, demand)

    def extend_in_place(self, seq: Sequence, num_tokens: int) -> bool:
        """The decode fast path: room for ``num_tokens`` more tokens of a resident
        sequence when its last block has room (no page, no budget involved).
        False means the caller needs the full ``demand`` / ``allocate`` path."""
        new = seq.num_computed + num_tokens
        if (
            seq.residency is Residency.RESIDENT
            and num_tokens >= 1
            and new <= seq.num_blocks * self.registry.block_size
            and new <= len(seq.tokens)
            and self.registry.sequences.get(seq.seq_id) is seq
        ):
            seq.num_allocated = new
            return True
        return False

    def allocate(self, seq: Sequence, num_tokens: int, hit: PrefixHit | None = None) -> None:
        """Reference pages for the next ``num_tokens`` tokens (after ``hit``, if any).

        Raises KVError, changing nothing, if the pages or the budget are not there.
        """
        refused = self.try_allocate(seq, num_tokens, hit)
        if refused is not None:
            registry = self.registry
            raise KVError(
                f"cannot allocate {refused.idle_pages} pages for tenant {seq.tenant!r}: "
                f"{registry.pool.num_idle()} idle, "
                f"headroom {registry.ledger.headroom(seq.tenant)}"
            )

    def try_allocate(
        self, seq: Sequence, num_tokens: int, hit: PrefixHit | None = None
    ) -> Demand | None:
        """``allocate`` if the pages and the budget are there (None); otherwise
        change nothing and return the demand that did not fit, for an eviction plan."""
        if hit is None and seq.residency is Residency.RESIDENT:
            return self._grow(seq, num_tokens)
        demand = self.demand(seq, num_tokens, hit)
        if hit is not None:
            if hit.seq_id != seq.seq_id:
                raise KVError(f"prefix hit of sequence {hit.seq_id} given for {seq.seq_id}")
            if not self.registry.hit_is_current(hit):
                raise KVError("stale prefix hit: the cache or sharing changed since the lookup")
        if not self.registry.fits(seq.tenant, demand):
            return demand
        if seq.residency is Residency.WAITING:
            self._start(seq, hit)
        needed = -(-(seq.num_computed + num_tokens) // self.registry.block_size) - seq.num_blocks
        if needed > 0:
            pages = self.registry.pool.take(seq.tenant, needed * self.registry.num_groups)
            for g, table in enumerate(seq.tables):
                table += pages[g * needed : (g + 1) * needed]
            seq.num_blocks += needed
            seq.table_version = self.registry.stamp()
        seq.num_allocated = seq.num_computed + num_tokens
        return None

    def _grow(self, seq: Sequence, num_tokens: int) -> Demand | None:
        """``try_allocate`` for a resident sequence: fresh pages only, no hit.
        (A decode crossing into a new block comes here; it is 1 in 16 of them.)"""
        self.registry.own(seq)
        new = seq.num_computed + num_tokens
        if num_tokens < 1 or new > len(seq.tokens):
            raise KVError(
                f"sequence {seq.seq_id} has {len(seq.tokens)} tokens; cannot compute "
                f"{num_tokens} more after {seq.num_computed}"
            )
        needed = -(-new // self.registry.block_size) - seq.num_blocks
        if needed > 0:
            fresh = needed * self.registry.num_groups
            if fresh > self.registry.pool.num_idle() or fresh > self.registry.ledger.headroom(
                seq.tenant
            ):
                return Demand(fresh, 0, fresh)
            pages = self.registry.pool.take(seq.tenant, fresh)
            for g, table in enumerate(seq.tables):
                table += pages[g * needed : (g + 1) * needed]
            seq.num_blocks += needed
            seq.table_version = self.registry.stamp()
        seq.num_allocated = new
        return None

    def _start(self, seq: Sequence, hit: PrefixHit | None) -> None:
        if seq.scope is None:
            self.prefix.ensure_scope(seq)
        seq.residency = Residency.RESIDENT
        # The hit rate counts each request once, as its own cached_tokens does:
        # a preempted sequence re-finding its own blocks is not a prefix hit.
        first = seq.starts == 0
        seq.starts += 1
        if first:
            self.registry.prefix_query_tokens += len(seq.tokens)
        if hit is None or hit.num_blocks == 0:
            seq.cached_tokens = 0
            return
        touch, tenant = self.registry.pool.touch, seq.tenant
        for table, pages in zip(seq.tables, hit.pages, strict=True):
            for page in pages:
                if page:
                    touch(page, tenant)
            table += pages
        if hit.reloads:
            self._reload(seq, hit)
        seq.num_blocks = hit.num_blocks
        seq.table_version = self.registry.stamp()
        seq.num_computed = seq.num_allocated = seq.cached_tokens = hit.num_tokens
        seq.sliding_start = hit.sliding_start
        seq.registered = hit.num_blocks
        if not first:
            return
        self.registry.prefix_hit_tokens += hit.num_tokens
        self.registry.host_hit_tokens += hit.reload_blocks * self.registry.block_size
        name = hit.scope.public_prefix
        if name is not None and name in self.registry.public:
            served = min(hit.num_blocks, hit.scope.public_blocks) * self.registry.block_size
            self.registry.public.hits[name] += served

    def _reload(self, seq: Sequence, hit: PrefixHit) -> None:
        """Fresh pages for the hit's host-cache blocks, queued to be copied in,
        and back in the device's cache under their keys. The blocks leave the
        host cache before pages are taken, so the evictions taking them may cause
        cannot drop them."""
        assert seq.scope is not None
        hashes = self.prefix.extend_hashes(seq, hit.num_blocks)
        keys = [(g, hashes[block]) for g, block in hit.reloads]
        claimed = [self.registry.host.claim(key) for key in keys]
        pages = self.registry.pool.take(seq.tenant, len(keys))
        live = self.registry.public.live_ids()
        pool = self.registry.pool
        for (g, block), key, held, page in zip(hit.reloads, keys, claimed, pages, strict=True):
            seq.tables[g][block] = page
            self.registry.host.copy_in(held, page)
            public = held.public & live if held.public is not None else None
            parent = self.prefix.parent_key(g, hashes, block)
            registered = (held.public is None or bool(public)) and pool.register(
                page, key, public or None, parent
            )
            if pool.events is not None:
                if registered:
                    pool.events.reloaded(key)
                else:  # left the host cache, not findable on the device
                    pool.events.removed(key, CPU)
            if not registered:
                pool.lost(key)

    def extend_decodes(
        self,
        seqs: list[Sequence],
        slots: np.ndarray[Any, Any] | None = None,
        step: StepColumns | None = None,
    ) -> list[int]:
        """Room for one more token of every sequence that is one token from
        done (a decode), without the general allocation path; returns the
        indices of the sequences left for that path.

        Decodes whose token lands in a block they hold always get room. Decodes
        whose next token starts a new block get one each only if all the
        others are such decodes and the idle pages and every tenant's budget
        suffice for all of them: then nothing competes for the pages, and no
        order among them could change the outcome. Otherwise they are left,
        with the rest, to the caller's ordered path (priority, eviction).
        """
        if not seqs:
            return []
        if slots is None:
            slots = self.registry.slots_of(seqs)
        before = self.registry.columns.matrix[:, slots] if step is None else step.matrix
        computed = before[COMPUTED]
        matrix = self.registry.columns.matrix
        new = computed + 1
        decode = (before[RESIDENT] == 1) & (before[LENGTH] == new)
        capacity = before[BLOCKS] * self.registry.block_size
        fits = decode & (computed < capacity)
        if fits.all():  # most steps: every token lands in a block its sequence holds
            matrix[ALLOCATED, slots] = new
            return []
        left = np.flatnonzero(~fits)
        all_at_boundary = bool((decode[left] & (computed[left] == capacity[left])).all())
        if (
            len(left)
            and all_at_boundary
            and self._grow_by_one_block([seqs[i] for i in left], slots[left])
        ):
            fits[left] = True
            left = left[:0]
        matrix[ALLOCATED, slots] = np.where(fits, new, before[ALLOCATED])
        return left.tolist()  # type: ignore[no-any-return]

    def _grow_by_one_block(self, seqs: list[Sequence], slots: np.ndarray[Any, Any]) -> bool:
        """A new block for each of ``seqs`` (at ``slots``), if the idle pages and
        every tenant's budget allow all of them; otherwise change nothing and
        return False. Pages are taken a tenant at a time, and the block counts
        advanced as one array operation: every ``block_size`` steps each
        decoding sequence comes here."""
        registry = self.registry
        groups = registry.num_groups
        by_tenant: dict[str, list[Sequence]] = {}
        for seq in seqs:
            by_tenant.setdefault(seq.tenant, []).append(seq)
        if len(seqs) * groups > registry.pool.num_idle() or any(
            len(own) * groups > registry.ledger.headroom(tenant)
            for tenant, own in by_tenant.items()
        ):
            return False
        take, edits = registry.pool.take, registry.table_edits
        for tenant, own in by_tenant.items():
            pages = take(tenant, len(own) * groups)
            for i, seq in enumerate(own):
                mine = pages[i * groups : (i + 1) * groups]
                deque(map(list.append, seq.tables, mine), maxlen=0)
                if edits is not None:
                    block = len(seq.tables[0]) - 1
                    edits += zip(repeat(seq.slot), range(groups), repeat(block), mine)
                else:
                    seq.table_version = registry.stamp()
        registry.columns.matrix[BLOCKS, slots] += 1
        return True
