"""The KV manager: sequences' block tables over the one paged pool.

It is sans-IO and synchronous. The scheduler drives it per step::

    hit = kv.lookup(seq)                      # pure: what the prefix cache holds
    if kv.can_allocate(seq, n, hit):          # pure: idle pages and budget allow it
        kv.allocate(seq, n, hit)              # commit: pages referenced and charged
    ... engine step writes K/V for those n tokens ...
    kv.commit(seq, n)                         # full blocks cached, windows slide
                                              # (decode steps: cached when the sequence
                                              # releases its pages)
    kv.append_tokens(seq, [sampled])
    kv.finish(seq)                            # pages back to the pool

A prefix hit stays valid until a cached page is evicted (``pool.evictions``
moves) or the sharing configuration changes (``generation`` moves: a policy
switch or a public-prefix change), so lookup, check and allocate belong in one
scheduling decision; ``allocate`` refuses a stale hit.

Sliding-window groups (lazy windows): a block is allocated only when a token
lands in it, and released as soon as no future query can see it: a query at
position q sees keys in (q - window, q], so after ``c`` tokens are computed
every block wholly below ``c - window + 1`` goes back to the pool (into the
LRU cache if it is full, so a later request with the same prefix can still
use it). A short sequence therefore never pays the eager window floor.
"""

from __future__ import annotations

import itertools
import operator
from collections import deque
from collections.abc import Iterable
from typing import Any

import msgspec
import numpy as np

from kvd.kv.columns import (
    ALLOCATED,
    BLOCKS,
    COMPUTED,
    LAST_TOKEN,
    LENGTH,
    RESIDENT,
    SERIAL,
    SLIDING_START,
    SequenceColumns,
)
from kvd.kv.geometry import AttentionKind
from kvd.kv.layout import PageLayout
from kvd.kv.ledger import BudgetMode, Ledger, TenantBudget
from kvd.kv.pool import NULL_PAGE, PagePool
from kvd.kv.scope import PublicPrefixes, Scope, SharingPolicy, chain_hashes, resolve_scope
from kvd.kv.sequence import KVState, Sequence


class KVError(RuntimeError):
    """A KV operation that is not allowed in the sequence's or pool's state."""


class PrefixHit(msgspec.Struct, frozen=True):
    """What the prefix cache can serve a waiting sequence, as of ``epoch``.

    ``pages[g]`` lists group g's pages for blocks ``[0, num_blocks)``, with the
    null page where a sliding group needs no page (below ``sliding_start``).
    """

    seq_id: int
    num_blocks: int
    num_tokens: int
    sliding_start: int
    pages: tuple[tuple[int, ...], ...]
    epoch: int  # cache evictions at lookup time
    generation: int  # sharing configuration at lookup time
    scope: Scope


class Demand(msgspec.Struct, frozen=True):
    """What an allocation would take: idle pages, and new charges to the tenant."""

    fresh_pages: int  # pages taken from idle with new content
    reused_idle: int  # cached idle pages a hit revives
    charges: int  # pages newly charged to the requesting tenant

    @property
    def idle_pages(self) -> int:
        return self.fresh_pages + self.reused_idle


class PageCopy(msgspec.Struct, frozen=True):
    """One page to move between device and host for swapping."""

    group: int
    block: int
    page: int


class KVStats(msgspec.Struct, frozen=True):
    capacity_pages: int
    page_bytes: int
    block_size: int
    free_pages: int
    cached_pages: int
    referenced_pages: int
    sequences: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    cache_evictions: int
    policy: str
    mode: str


class KVManager:
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
        self.policy = SharingPolicy(policy)
        self.public = PublicPrefixes()
        self.sequences: dict[int, Sequence] = {}
        self.columns = SequenceColumns()
        self._stamps = itertools.count(1)  # table versions, unique across sequences
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

    @classmethod
    def for_pool_bytes(cls, layout: PageLayout, pool_bytes: int, **kwargs: object) -> KVManager:
        return cls(layout, layout.num_pages(pool_bytes), **kwargs)  # type: ignore[arg-type]

    def log_table_edits(self) -> list[tuple[int, int, int, int]]:
        """Start logging single-entry table edits (see ``table_edits``); the
        caller drains the returned list as it applies them."""
        if self.table_edits is None:
            self.table_edits = []
        return self.table_edits

    # -- configuration, live -------------------------------------------------

    def set_tenant(self, name: str, budget: TenantBudget) -> None:
        self.ledger.set_tenant(name, budget)

    def remove_tenant(self, name: str) -> None:
        if any(s.tenant == name for s in self.sequences.values()):
            raise KVError(f"tenant {name!r} still has sequences")
        self.ledger.remove_tenant(name)

    def set_mode(self, mode: BudgetMode) -> None:
        self.ledger.set_mode(mode)

    def set_policy(self, policy: SharingPolicy) -> None:
        """Switch the sharing policy; it scopes every lookup from now on."""
        self.policy = SharingPolicy(policy)
        self.generation += 1

    def add_public_prefix(self, name: str, tokens: list[int]) -> None:
        """Register a public prefix; refused if its pages would break reservations."""
        if name in self.public:
            raise ValueError(f"a public prefix named {name!r} already exists")
        if not tokens:
            raise ValueError("a public prefix needs at least one token")
        self.ledger.set_public_bound(self._public_bound(extra=len(tokens)))
        self.public.add(name, tokens)
        self.generation += 1

    def remove_public_prefix(self, name: str) -> None:
        """Unregister a public prefix; its pages that no other prefix covers
        leave the cache (idle ones are freed, held ones become private)."""
        self.pool.unpublish(self.public.remove(name))
        self.ledger.set_public_bound(self._public_bound())
        self.generation += 1

    def _public_bound(self, extra: int = 0) -> int:
        lengths = [len(tokens) for _, tokens in self.public.items()] + [extra]
        return sum(length // self.block_size for length in lengths) * self.num_groups

    def flush_cache(self) -> int:
        """Forget all cached pages nobody uses; returns how many were freed."""
        return self.pool.flush()

    # -- sequences -----------------------------------------------------------

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
        seq.table_version = next(self._stamps)
        self.columns.set(SERIAL, seq.slot, next(self._stamps))
        self.sequences[seq_id] = seq
        return seq

    def _own(self, seq: Sequence) -> None:
        """Refuse a Sequence this manager does not hold (finished, or another's)."""
        if self.sequences.get(seq.seq_id) is not seq:
            raise KVError(f"sequence {seq.seq_id} is not live in this KV manager")

    def append_tokens(self, seq: Sequence, tokens: Iterable[int]) -> None:
        self._own(seq)
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

    def finish(self, seq: Sequence) -> None:
        """Release every page and forget the sequence."""
        self._own(seq)
        if seq.state is KVState.SWAPPING_OUT:
            raise KVError("finish a swap-out before removing the sequence")
        self.release(seq)
        seq.state = KVState.RELEASED
        del self.sequences[seq.seq_id]
        seq.detach()

    def release(self, seq: Sequence) -> None:
        """Drop every page (preemption by recompute, or the end of a sequence).

        The tokens are kept; the sequence waits to be prefilled again, and its
        full blocks stay cached, tail first in the LRU, so a re-prefill finds
        as much of itself as the pool could keep.
        """
        self._own(seq)
        if seq.state is KVState.SWAPPING_OUT:
            raise KVError("finish a swap-out before releasing the sequence")
        self._drop_all(seq)
        seq.num_blocks = 0
        seq.num_computed = seq.num_allocated = 0
        seq.sliding_start = 0
        seq.registered = 0
        seq.swapped_blocks = None
        seq.state = KVState.WAITING

    def _drop_all(self, seq: Sequence) -> None:
        self._register_pending(seq)  # what decode steps filled stays findable
        drop, tenant = self.pool.drop, seq.tenant
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
        seq.table_version = next(self._stamps)

    # -- prefix lookup ---------------------------------------------------------

    def _ensure_scope(self, seq: Sequence) -> Scope:
        scope = resolve_scope(
            self.policy, seq.tenant, seq.cache_salt, seq.tokens, self.block_size, self.public
        )
        if scope != seq.scope:
            seq.scope = scope
            seq.hashes = []
        return scope

    def _extend_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        hashes = seq.hashes
        if len(hashes) < num_blocks:
            assert seq.scope is not None
            parent = hashes[-1] if hashes else None
            hashes += chain_hashes(
                seq.tokens, self.block_size, seq.scope, len(hashes), num_blocks, parent
            )
        return hashes

    def first_needed_block(self, position: int) -> int:
        """The first block a query at ``position`` sees in a sliding group."""
        assert self.window is not None
        return max(0, (position - self.window + 1) // self.block_size)

    def lookup(self, seq: Sequence) -> PrefixHit:
        """The longest prefix of a waiting sequence whose KV is resident.

        Only full blocks count, and at least one token is left to compute (its
        logits are needed). Global groups need every block of the hit; sliding
        groups only the blocks the first uncomputed token can see. The hit is
        the longest length that satisfies every group (as vLLM intersects
        full-attention and sliding-window hits).
        """
        self._own(seq)
        if seq.state is not KVState.WAITING:
            raise KVError(f"sequence {seq.seq_id} is {seq.state.value}, not waiting")
        scope = self._ensure_scope(seq)
        max_blocks = (len(seq.tokens) - 1) // self.block_size
        hashes = self._extend_hashes(seq, max_blocks)
        index = self.pool.index
        hit = 0
        for block in range(max_blocks):
            h = hashes[block]
            if not all((g, h) in index for g in self.global_groups):
                break
            hit += 1
        sliding_start = 0
        if self.sliding_groups:
            hit = self._sliding_hit(hashes, hit)
            sliding_start = self.first_needed_block(hit * self.block_size)
        pages = tuple(
            tuple(
                index[(g, hashes[b])] if (b >= sliding_start or g in self.global_groups) else 0
                for b in range(hit)
            )
            for g in range(self.num_groups)
        )
        return PrefixHit(
            seq.seq_id,
            hit,
            hit * self.block_size,
            sliding_start,
            pages,
            self.pool.evictions,
            self.generation,
            scope,
        )

    def _sliding_hit(self, hashes: list[bytes], limit: int) -> int:
        """Longest hit <= limit whose in-window blocks are cached in every sliding group."""
        index = self.pool.index
        hit = limit
        while hit > 0:
            first = self.first_needed_block(hit * self.block_size)
            missing = None
            for block in range(hit - 1, first - 1, -1):
                h = hashes[block]
                if not all((g, h) in index for g in self.sliding_groups):
                    missing = block
                    break
            if missing is None:
                return hit
            hit = missing  # any longer hit would need the missing block too
        return 0

    # -- allocation ------------------------------------------------------------

    def demand(self, seq: Sequence, num_tokens: int, hit: PrefixHit | None = None) -> Demand:
        """What ``allocate(seq, num_tokens, hit)`` would take; changes nothing."""
        computed, blocks = self._start_point(seq, num_tokens, hit)
        needed_blocks = -(-(computed + num_tokens) // self.block_size)
        fresh = max(0, needed_blocks - blocks) * self.num_groups
        reused = charged = 0
        if hit is not None:
            holders, public = self.pool.holders, self.pool.public
            for table in hit.pages:
                for page in table:
                    if page and holders[page] is None:
                        reused += 1
                        charged += not public[page]
        return Demand(fresh, reused, fresh + charged)

    def _start_point(
        self, seq: Sequence, num_tokens: int, hit: PrefixHit | None
    ) -> tuple[int, int]:
        self._own(seq)
        if num_tokens < 1:
            raise KVError("allocate at least one token")
        if seq.state is KVState.WAITING:
            computed = hit.num_tokens if hit is not None else 0
            blocks = hit.num_blocks if hit is not None else 0
        elif seq.state is KVState.RESIDENT:
            if hit is not None:
                raise KVError("a prefix hit applies only to a waiting sequence")
            computed, blocks = seq.num_computed, seq.num_blocks
        else:
            raise KVError(f"sequence {seq.seq_id} is {seq.state.value}")
        if computed + num_tokens > len(seq.tokens):
            raise KVError(
                f"sequence {seq.seq_id} has {len(seq.tokens)} tokens; cannot compute "
                f"{num_tokens} more after {computed}"
            )
        return computed, blocks

    def can_allocate(self, seq: Sequence, num_tokens: int, hit: PrefixHit | None = None) -> bool:
        demand = self.demand(seq, num_tokens, hit)
        return self.fits(seq.tenant, demand)

    def fits(self, tenant: str, demand: Demand) -> bool:
        """Idle pages suffice, and new charges (if any) stay within the budget.

        A tenant over its budget (after a live cut) may still fill the blocks
        it holds: only new charges are refused.
        """
        return demand.idle_pages <= self.pool.num_idle() and (
            demand.charges == 0 or demand.charges <= self.ledger.headroom(tenant)
        )

    def extend_in_place(self, seq: Sequence, num_tokens: int) -> bool:
        """The decode fast path: slots for ``num_tokens`` more tokens of a resident
        sequence when its last block has room (no page, no budget involved).
        False means the caller needs the full ``demand`` / ``allocate`` path."""
        new = seq.num_computed + num_tokens
        if (
            seq.state is KVState.RESIDENT
            and num_tokens >= 1
            and new <= seq.num_blocks * self.block_size
            and new <= len(seq.tokens)
            and self.sequences.get(seq.seq_id) is seq
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
            raise KVError(
                f"cannot allocate {refused.idle_pages} pages for tenant {seq.tenant!r}: "
                f"{self.pool.num_idle()} idle, headroom {self.ledger.headroom(seq.tenant)}"
            )

    def try_allocate(
        self, seq: Sequence, num_tokens: int, hit: PrefixHit | None = None
    ) -> Demand | None:
        """``allocate`` if the pages and the budget are there (None); otherwise
        change nothing and return the demand that did not fit, for an eviction plan."""
        if hit is None and seq.state is KVState.RESIDENT:
            return self._grow(seq, num_tokens)
        demand = self.demand(seq, num_tokens, hit)
        if hit is not None:
            if hit.seq_id != seq.seq_id:
                raise KVError(f"prefix hit of sequence {hit.seq_id} given for {seq.seq_id}")
            if hit.epoch != self.pool.evictions or hit.generation != self.generation:
                raise KVError("stale prefix hit: the cache or sharing changed since the lookup")
        if not self.fits(seq.tenant, demand):
            return demand
        if seq.state is KVState.WAITING:
            self._start(seq, hit)
        needed = -(-(seq.num_computed + num_tokens) // self.block_size) - seq.num_blocks
        if needed > 0:
            pages = self.pool.take(seq.tenant, needed * self.num_groups)
            for g, table in enumerate(seq.tables):
                table += pages[g * needed : (g + 1) * needed]
            seq.num_blocks += needed
            seq.table_version = next(self._stamps)
        seq.num_allocated = seq.num_computed + num_tokens
        return None

    def _grow(self, seq: Sequence, num_tokens: int) -> Demand | None:
        """``try_allocate`` for a resident sequence: fresh pages only, no hit.
        (A decode crossing into a new block comes here; it is 1 in 16 of them.)"""
        self._own(seq)
        new = seq.num_computed + num_tokens
        if num_tokens < 1 or new > len(seq.tokens):
            raise KVError(
                f"sequence {seq.seq_id} has {len(seq.tokens)} tokens; cannot compute "
                f"{num_tokens} more after {seq.num_computed}"
            )
        needed = -(-new // self.block_size) - seq.num_blocks
        if needed > 0:
            fresh = needed * self.num_groups
            if fresh > self.pool.num_idle() or fresh > self.ledger.headroom(seq.tenant):
                return Demand(fresh, 0, fresh)
            pages = self.pool.take(seq.tenant, fresh)
            for g, table in enumerate(seq.tables):
                table += pages[g * needed : (g + 1) * needed]
            seq.num_blocks += needed
            seq.table_version = next(self._stamps)
        seq.num_allocated = new
        return None

    def _start(self, seq: Sequence, hit: PrefixHit | None) -> None:
        if seq.scope is None:
            self._ensure_scope(seq)
        seq.state = KVState.RESIDENT
        # The hit rate counts each request once, as its own cached_tokens does:
        # a preempted sequence re-finding its own blocks is not a prefix hit.
        first = seq.starts == 0
        seq.starts += 1
        if first:
            self.prefix_query_tokens += len(seq.tokens)
        if hit is None or hit.num_blocks == 0:
            seq.cached_tokens = 0
            return
        touch, tenant = self.pool.touch, seq.tenant
        for table, pages in zip(seq.tables, hit.pages, strict=True):
            for page in pages:
                if page:
                    touch(page, tenant)
            table += pages
        seq.num_blocks = hit.num_blocks
        seq.table_version = next(self._stamps)
        seq.num_computed = seq.num_allocated = seq.cached_tokens = hit.num_tokens
        seq.sliding_start = hit.sliding_start
        seq.registered = hit.num_blocks
        if not first:
            return
        self.prefix_hit_tokens += hit.num_tokens
        name = hit.scope.public_prefix
        if name is not None and name in self.public:
            served = min(hit.num_blocks, hit.scope.public_blocks) * self.block_size
            self.public.hits[name] += served

    def commit(self, seq: Sequence, num_tokens: int) -> None:
        """The engine wrote K/V for the next ``num_tokens`` tokens.

        Newly full blocks enter the prefix cache; sliding groups release the
        blocks no future query can see.
        """
        self._own(seq)
        if seq.state is not KVState.RESIDENT:
            raise KVError(f"sequence {seq.seq_id} is {seq.state.value}, not resident")
        old = seq.num_computed
        new = old + num_tokens
        if num_tokens < 1 or new > seq.num_allocated:
            raise KVError(f"cannot commit {num_tokens} tokens to sequence {seq.seq_id}")
        seq.num_computed = new
        bs = self.block_size
        if new // bs > seq.registered:
            self._register_blocks(seq, seq.registered, new // bs)
        if self.window is not None and new - self.window + 1 >= (seq.sliding_start + 1) * bs:
            self._slide(seq, self.first_needed_block(new))

    def commit_batch(
        self,
        seqs: list[Sequence],
        counts: list[int],
        slots: np.ndarray[Any, Any] | None = None,
    ) -> None:
        """``commit`` for a whole step: ``counts[i]`` tokens of ``seqs[i]``
        (``slots``: their ``slots_of``, if the caller has it from this step).

        The counters move as arrays; only the sequences that fill a block or
        move their window past one do Python work. All or nothing: a bad entry
        raises before anything changes.
        """
        if not seqs:
            return
        if slots is None:
            slots = self.slots_of(seqs)
        block = self.columns.matrix[:, slots]
        counts_array = np.asarray(counts, np.int64)
        old = block[COMPUTED]
        new = old + counts_array
        bad = (block[RESIDENT] != 1) | (counts_array < 1) | (new > block[ALLOCATED])
        if bad.any() or len(set(slots.tolist())) != len(seqs):
            for seq, count in zip(seqs, counts, strict=True):  # the precise error
                if seq.state is not KVState.RESIDENT:
                    raise KVError(f"sequence {seq.seq_id} is {seq.state.value}, not resident")
                if count < 1 or seq.num_computed + count > seq.num_allocated:
                    raise KVError(f"cannot commit {count} tokens to sequence {seq.seq_id}")
            raise KVError("a sequence appears twice in one commit")
        self.columns.matrix[COMPUTED, slots] = new
        bs = self.block_size
        for i in np.flatnonzero(new // bs > old // bs).tolist():
            seq = seqs[i]
            self._register_blocks(seq, seq.registered, int(new[i]) // bs)
        self._slide_moved(seqs, block, new)

    def commit_decodes(
        self, seqs: list[Sequence], slots: np.ndarray[Any, Any], block: np.ndarray[Any, Any]
    ) -> None:
        """``commit_batch`` of one token each, for ``seqs`` at ``slots`` whose
        columns before the step are ``block`` (``columns.matrix[:, slots]``)."""
        computed = block[COMPUTED]
        new = computed + 1
        # Resident (1), with a slot allocated for the token: the product is >= 1.
        if int(((block[ALLOCATED] - computed) * block[RESIDENT]).min()) < 1 or len(
            set(slots.tolist())
        ) != len(seqs):
            self.commit_batch(seqs, [1] * len(seqs), slots)  # raises the precise error
            return
        self.columns.matrix[COMPUTED, slots] = new
        # The blocks decodes fill enter the prefix cache when the sequence lets go
        # of its pages (``_drop_all``), as SGLang inserts a request's output when
        # it finishes: hashing and indexing one block per sequence every
        # ``block_size`` steps would be a large share of a decode step's host time.
        self._slide_moved(seqs, block, new)

    def extend_decodes(
        self, seqs: list[Sequence], slots: np.ndarray[Any, Any] | None = None
    ) -> list[int]:
        """Slots for one more token of every sequence that is one token from
        done (a decode), without the general allocation path; returns the
        indices of the sequences left for that path.

        Decodes whose slot lies in a block they hold always get it. Decodes
        whose next token starts a new block get one each only if all the
        others are such decodes and the idle pages and every tenant's budget
        suffice for all of them: then nothing competes for the pages, and no
        order among them could change the outcome. Otherwise they are left,
        with the rest, to the caller's ordered path (priority, eviction).
        """
        if not seqs:
            return []
        if slots is None:
            slots = self.slots_of(seqs)
        block = self.columns.matrix[:, slots]
        computed = block[COMPUTED]
        decode = (block[RESIDENT] == 1) & (block[LENGTH] == computed + 1)
        capacity = block[BLOCKS] * self.block_size
        fits = decode & (computed < capacity)
        left = np.flatnonzero(~fits)
        all_at_boundary = bool((decode[left] & (computed[left] == capacity[left])).all())
        if len(left) and all_at_boundary and self._grow_by_one_block([seqs[i] for i in left]):
            fits[left] = True
            left = left[:0]
        matrix = self.columns.matrix
        matrix[ALLOCATED, slots] = np.where(fits, computed + 1, block[ALLOCATED])
        return left.tolist()  # type: ignore[no-any-return]

    def _grow_by_one_block(self, seqs: list[Sequence]) -> bool:
        """A new block for each of ``seqs``, if the idle pages and every tenant's
        budget allow all of them; otherwise change nothing and return False."""
        groups = self.num_groups
        per_tenant: dict[str, int] = {}
        for seq in seqs:
            per_tenant[seq.tenant] = per_tenant.get(seq.tenant, 0) + groups
        if len(seqs) * groups > self.pool.num_idle() or any(
            pages > self.ledger.headroom(tenant) for tenant, pages in per_tenant.items()
        ):
            return False
        take, edits = self.pool.take, self.table_edits
        for seq in seqs:
            block = seq.num_blocks
            pages = take(seq.tenant, groups)
            for g, (table, page) in enumerate(zip(seq.tables, pages, strict=True)):
                table.append(page)
                if edits is not None:
                    edits.append((seq.slot, g, block, page))
            seq.num_blocks = block + 1
            if edits is None:
                seq.table_version = next(self._stamps)
        return True

    def _slide_moved(
        self, seqs: list[Sequence], block: np.ndarray[Any, Any], new: np.ndarray[Any, Any]
    ) -> None:
        """After a batched commit to ``new`` computed tokens (``block``: the
        columns before it), slide the windows that moved past a block."""
        if self.window is None:
            return
        moved = new - self.window + 1 >= (block[SLIDING_START] + 1) * self.block_size
        for i in np.flatnonzero(moved).tolist():
            self._slide(seqs[i], self.first_needed_block(int(new[i])))

    def _register_pending(self, seq: Sequence) -> None:
        """Offer the cache every full computed block not offered yet."""
        computed_blocks = seq.num_computed // self.block_size
        if computed_blocks > seq.registered and seq.tables[0]:
            self._register_blocks(seq, seq.registered, computed_blocks)

    def _register_blocks(self, seq: Sequence, start: int, stop: int) -> None:
        seq.registered = max(seq.registered, stop)
        scope = seq.scope if seq.scope is not None else self._ensure_scope(seq)
        hashes = self._extend_hashes(seq, stop)
        register = self.pool.register
        if not scope.public_matches:  # no public prefix in this chain: every page stays private
            for block in range(start, stop):
                key_hash = hashes[block]
                for g, table in enumerate(seq.tables):
                    page = table[block]
                    if page:
                        register(page, (g, key_hash), None)
            return
        live = self.public.live_ids() if scope.public_blocks > start else frozenset()
        for block in range(start, stop):
            public = None
            if block < scope.public_blocks:
                # Only registrations still live may make a page public; a block of
                # a prefix removed (or replaced) since the lookup stays uncached.
                public = scope.prefixes_covering(block) & live
                if not public:
                    continue
            key_hash = hashes[block]
            for g, table in enumerate(seq.tables):
                page = table[block]
                if page:
                    register(page, (g, key_hash), public)

    def _slide(self, seq: Sequence, first_needed: int) -> None:
        drop, tenant, edits = self.pool.drop, seq.tenant, self.table_edits
        for block in range(first_needed - 1, seq.sliding_start - 1, -1):
            for g in self.sliding_groups:
                table = seq.tables[g]
                page = table[block]
                if page:
                    drop(page, tenant)
                    table[block] = NULL_PAGE
                    if edits is not None:
                        edits.append((seq.slot, g, block, NULL_PAGE))
        seq.sliding_start = first_needed
        if edits is None:
            seq.table_version = next(self._stamps)

    # -- swapping ----------------------------------------------------------------

    def _shared(self, page: int) -> bool:
        """Held by someone else too, or public: copying it out frees nothing."""
        holders = self.pool.holders[page]
        return self.pool.public[page] is not None or (
            holders is not None and sum(holders.values()) > 1
        )

    def begin_swap_out(self, seq: Sequence) -> list[PageCopy]:
        """The pages to copy to host: the sequence's private pages. They stay
        held until ``finish_swap_out``; shared and public pages are not copied
        and stay held through the swap, so they stay shared (and charged as
        they were)."""
        self._own(seq)
        if seq.state is not KVState.RESIDENT:
            raise KVError(f"sequence {seq.seq_id} is {seq.state.value}, not resident")
        seq.state = KVState.SWAPPING_OUT
        return [
            PageCopy(g, block, page)
            for g, table in enumerate(seq.tables)
            for block, page in enumerate(table)
            if page and not self._shared(page)
        ]

    def shared_prefix_tokens(self, seq: Sequence) -> int:
        """Computed tokens at the start of ``seq`` whose pages others also hold
        (or that are public): a recompute would find them in the prefix cache."""
        blocks = 0
        tables = [seq.tables[g] for g in self.global_groups]
        for block in range(seq.num_computed // self.block_size):
            if not all(table[block] and self._shared(table[block]) for table in tables):
                break
            blocks += 1
        return blocks * self.block_size

    def swap_out_pages(self, seq: Sequence) -> int:
        """Pages a swap-out of a resident ``seq`` would copy (and free)."""
        return sum(1 for page in seq.held_pages() if not self._shared(page))

    def finish_swap_out(self, seq: Sequence) -> None:
        """The copies ``begin_swap_out`` listed are on the host: free those
        pages, remember which blocks they were; the pages not copied stay held."""
        self._own(seq)
        if seq.state is not KVState.SWAPPING_OUT:
            raise KVError(f"sequence {seq.seq_id} is {seq.state.value}, not swapping out")
        # Decided before registering pending blocks, which can make a page public.
        copied = {
            (g, block)
            for g, table in enumerate(seq.tables)
            for block, page in enumerate(table)
            if page and not self._shared(page)
        }
        self._register_pending(seq)
        swapped: list[list[int]] = [[] for _ in seq.tables]
        kept: list[dict[int, int]] = [{} for _ in seq.tables]
        drop, tenant = self.pool.drop, seq.tenant
        for g, table in enumerate(seq.tables):
            for block in range(len(table) - 1, -1, -1):
                page = table[block]
                if not page:
                    continue
                if (g, block) in copied:
                    swapped[g].append(block)
                    drop(page, tenant)
                else:
                    kept[g][block] = page
            swapped[g].reverse()
            table.clear()
        seq.table_version = next(self._stamps)
        seq.swapped_blocks = swapped
        seq.kept = kept
        seq.state = KVState.SWAPPED

    def swap_in_demand(self, seq: Sequence) -> Demand:
        self._own(seq)
        if seq.state is not KVState.SWAPPED or seq.swapped_blocks is None:
            raise KVError(f"sequence {seq.seq_id} is {seq.state.value}, not swapped")
        pages = sum(len(blocks) for blocks in seq.swapped_blocks)
        return Demand(pages, 0, pages)

    def can_swap_in(self, seq: Sequence) -> bool:
        return self.fits(seq.tenant, self.swap_in_demand(seq))

    def swap_in(self, seq: Sequence) -> list[PageCopy]:
        """New pages for a swapped sequence; the caller copies host data into them
        before the next engine step. Full blocks re-enter the prefix cache."""
        demand = self.swap_in_demand(seq)
        if not self.fits(seq.tenant, demand):
            raise KVError(f"cannot swap in sequence {seq.seq_id}: not enough pages or budget")
        assert seq.swapped_blocks is not None and seq.kept is not None
        pages = iter(self.pool.take(seq.tenant, demand.fresh_pages))
        copies: list[PageCopy] = []
        for g, (blocks, kept) in enumerate(zip(seq.swapped_blocks, seq.kept, strict=True)):
            table = [NULL_PAGE] * seq.num_blocks
            for block in blocks:
                table[block] = page = next(pages)
                copies.append(PageCopy(g, block, page))
            for block, page in kept.items():
                table[block] = page
            seq.tables[g] = table
        seq.table_version = next(self._stamps)
        seq.swapped_blocks = None
        seq.kept = None
        seq.state = KVState.RESIDENT
        seq.num_allocated = seq.num_computed
        self._register_blocks(seq, 0, seq.num_computed // self.block_size)
        return copies

    # -- reporting ---------------------------------------------------------------

    def stats(self) -> KVStats:
        pool = self.pool
        return KVStats(
            capacity_pages=pool.capacity,
            page_bytes=self.layout.page_bytes,
            block_size=self.block_size,
            free_pages=len(pool.free),
            cached_pages=len(pool.lru),
            referenced_pages=pool.num_referenced(),
            sequences=len(self.sequences),
            prefix_query_tokens=self.prefix_query_tokens,
            prefix_hit_tokens=self.prefix_hit_tokens,
            cache_evictions=pool.evictions,
            policy=self.policy.value,
            mode=self.ledger.mode.value,
        )

    def check_invariants(self) -> None:
        """Refcounts equal block-table references; tables are consistent."""
        self.pool.check_invariants()
        refs: dict[int, dict[str, int]] = {}
        for seq in self.sequences.values():
            if seq.state in (KVState.RESIDENT, KVState.SWAPPING_OUT):
                assert all(len(t) == seq.num_blocks for t in seq.tables), seq
                assert seq.num_computed <= seq.num_blocks * self.block_size, seq
                # No block beyond what the known tokens need: waste is at most
                # one partly-filled block per group.
                assert seq.num_blocks <= -(-len(seq.tokens) // self.block_size), seq
            else:
                assert not any(seq.tables), seq
            for g in self.sliding_groups:
                assert not any(seq.tables[g][: seq.sliding_start]), seq
            for page in seq.held_pages():
                per = refs.setdefault(page, {})
                per[seq.tenant] = per.get(seq.tenant, 0) + 1
        for page in range(1, self.pool.num_pages):
            assert (self.pool.holders[page] or {}) == refs.get(page, {}), page
        columns = self.columns
        assert columns.live() == len(self.sequences)
        for seq in self.sequences.values():
            assert columns.owner[seq.slot] is seq, seq
            assert columns.get(LENGTH, seq.slot) == len(seq.tokens), seq
            last = seq.tokens[-1] if seq.tokens else 0
            assert columns.get(LAST_TOKEN, seq.slot) == last, seq
            assert columns.get(RESIDENT, seq.slot) == (seq.state is KVState.RESIDENT), seq
