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

A prefix hit stays valid until a cached block leaves the device or the host
cache, or the host cache hands one back (the registry's ``cache_epoch()``
moves) or the sharing configuration changes (``generation`` moves: a policy
switch or a public-prefix change), so
lookup, check and allocate belong in one scheduling decision; ``allocate``
refuses a stale hit (``hit_is_current``).

Sliding-window groups (lazy windows): a block is allocated only when a token
lands in it, and released as soon as no future query can see it: a query at
position q sees keys in (q - window, q], so after ``c`` tokens are computed
every block wholly below ``c - window + 1`` goes back to the pool (into the
LRU cache if it is full, so a later request with the same prefix can still
use it). A short sequence therefore never pays the eager window floor.

The manager is composed of parts, one concept per module, that share one
record, ``registry.py`` (the pool, the ledger, the host cache, the live
sequences), each saying which of its fields it changes: ``prefix.py`` (lookup
and caching), ``allocation.py`` (growing), ``commit.py`` (commits, sliding,
release), ``swap.py`` (to host memory and back); ``hostcache.py`` keeps
cached blocks in host memory after eviction, and ``invariants.py`` checks the
whole. The manager holds the parts, forwards their interface, and owns live
configuration (tenants, sharing, the host cache's size) and reporting. Code
outside ``kvd.kv`` asks the manager (``step_columns``, ``stats``, ``tenant``
and the methods below) and never reads the registry's parts: ``registry``
is for the parts and for tests that inspect them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvd.kv.allocation import Allocator
from kvd.kv.columns import StepColumns
from kvd.kv.commit import Committer
from kvd.kv.events import CPU, FULL_ATTENTION, GPU, SLIDING_WINDOW, GroupSpec, KVEventLog
from kvd.kv.events import PrivateBlocks as PrivateBlocks
from kvd.kv.geometry import AttentionKind
from kvd.kv.hostcache import HostCopy
from kvd.kv.invariants import check_invariants
from kvd.kv.layout import PageLayout
from kvd.kv.ledger import BudgetMode, TenantBudget
from kvd.kv.prefix import PrefixCache
from kvd.kv.records import Demand, KVError, KVStats, PageCopy, PrefixHit, TenantKV
from kvd.kv.registry import SequenceRegistry
from kvd.kv.scope import SharingPolicy
from kvd.kv.swap import Swapper

__all__ = [
    "Demand",
    "KVError",
    "KVManager",
    "KVStats",
    "PageCopy",
    "PrefixHit",
    "StepColumns",
    "TenantKV",
]


class KVManager:
    def __init__(
        self,
        layout: PageLayout,
        num_pages: int,
        *,
        mode: BudgetMode = BudgetMode.RESERVE,
        policy: SharingPolicy = SharingPolicy.PUBLIC,
    ) -> None:
        self.registry = registry = SequenceRegistry(layout, num_pages, mode=mode, policy=policy)
        self.prefix_cache = prefix = PrefixCache(registry)
        self.allocator = allocator = Allocator(registry, prefix)
        self.committer = committer = Committer(registry, prefix)
        self.swapper = swapper = Swapper(registry, prefix)
        self.layout = layout
        self.block_size = layout.block_size
        self.num_pages = num_pages  # the pool's pages, the null page included
        # The parts' interface, bound once (a step calls several of these).
        self.add_sequence = registry.add_sequence
        self.append_tokens = registry.append_tokens
        self.append_decoded = registry.append_decoded
        self.append_pending = registry.append_pending
        self.resolve_pending = registry.resolve_pending
        self.drop_pending = registry.drop_pending
        self.slots_of = registry.slots_of
        self.fits = registry.fits
        self.hit_is_current = registry.hit_is_current
        self.log_table_edits = registry.log_table_edits
        self.lookup = prefix.lookup
        self.demand = allocator.demand
        self.can_allocate = allocator.can_allocate
        self.allocate = allocator.allocate
        self.try_allocate = allocator.try_allocate
        self.extend_in_place = allocator.extend_in_place
        self.extend_decodes = allocator.extend_decodes
        self.commit = committer.commit
        self.commit_batch = committer.commit_batch
        self.commit_decodes = committer.commit_decodes
        self.release = committer.release
        self.finish = committer.finish
        self.shared_prefix_tokens = swapper.shared_prefix_tokens
        self.swap_out_pages = swapper.swap_out_pages
        self.begin_swap_out = swapper.begin_swap_out
        self.abort_swap_out = swapper.abort_swap_out
        self.finish_swap_out = swapper.finish_swap_out
        self.swap_in_demand = swapper.swap_in_demand
        self.swap_in = swapper.swap_in

    @property
    def mode(self) -> BudgetMode:
        return self.registry.ledger.mode

    @property
    def slot_capacity(self) -> int:
        """Slots the columns hold now (a sequence's ``slot`` is below it; it grows)."""
        return self.registry.columns.capacity

    def step_columns(self, slots: np.ndarray[Any, Any]) -> StepColumns:
        """The column fields of the sequences at ``slots`` (``slots_of``), gathered once."""
        return StepColumns(self.registry.columns.matrix[:, slots])

    def public_prefixes(self) -> list[str]:
        return [name for name, _ in self.registry.public.items()]

    def referenced_pages(self) -> int:
        """Device pages some live sequence holds (0 once everything finished)."""
        return self.registry.pool.num_referenced()

    def most_pages(self, tenant: str) -> tuple[int, str]:
        """(the most pages ``tenant`` may ever hold in this mode, what sets it)."""
        return self.registry.ledger.most(tenant)

    def tenant(self, name: str) -> TenantKV | None:
        """``name``'s pages now (None: not a tenant of the ledger)."""
        ledger = self.registry.ledger
        account = ledger.accounts.get(name)
        if account is None:
            return None
        return TenantKV(
            charged_pages=account.used,
            reserved_pages=account.reservation,
            cap_pages=account.cap,
            surplus_pages=ledger.surplus(name),
            host_cached_pages=self.registry.host.used.get(name, 0),
        )

    # -- the host budget, which swapped-out sequences share with the host cache

    def host_cache_pages(self) -> int:
        """The host cache's budget in pages (0: no host cache)."""
        host = self.registry.host
        return host.total if host.enabled else 0

    def make_host_room(self, pages: int) -> None:
        """Drop cached host blocks (least recently used first) until ``pages``
        more pages of the host budget are free for swapped-out sequences."""
        self.registry.host.make_room(pages)

    def set_host_swap_held(self, pages: int) -> None:
        """Swapped-out sequences hold ``pages`` of the host budget."""
        self.registry.host.swap_held = pages

    def take_host_copies(self) -> list[HostCopy]:
        """The page copies the host cache queued since the last call, in order
        (the caller performs them before the next engine step)."""
        return self.registry.host.take_copies()

    def lose_host_copies(self, rows: set[int]) -> int:
        """The copies out to ``rows`` failed: their blocks leave the host cache."""
        return self.registry.host.lose(rows)

    @property
    def policy(self) -> SharingPolicy:
        return self.registry.policy

    @property
    def generation(self) -> int:
        return self.registry.generation

    @property
    def prefix_query_tokens(self) -> int:
        return self.registry.prefix_query_tokens

    @property
    def prefix_hit_tokens(self) -> int:
        return self.registry.prefix_hit_tokens

    @property
    def host_hit_tokens(self) -> int:
        return self.registry.host_hit_tokens

    @property
    def table_edits(self) -> list[tuple[int, int, int, int]] | None:
        return self.registry.table_edits

    @classmethod
    def for_pool_bytes(cls, layout: PageLayout, pool_bytes: int, **kwargs: object) -> KVManager:
        return cls(layout, layout.num_pages(pool_bytes), **kwargs)  # type: ignore[arg-type]

    def set_tenant(self, name: str, budget: TenantBudget) -> None:
        self.registry.ledger.set_tenant(name, budget)
        self.registry.host.add_account(name)

    def remove_tenant(self, name: str) -> None:
        """Forget a tenant; its blocks on the host cache go with it (its idle
        device pages stay cached until evicted, and are then not kept)."""
        if any(s.tenant == name for s in self.registry.sequences.values()):
            raise KVError(f"tenant {name!r} still has sequences")
        self.registry.ledger.remove_tenant(name)
        self.registry.host.remove_account(name)

    def enable_host_cache(self, pages: int) -> None:
        """Keep evicted cached pages in a host budget of ``pages`` pages (shared
        with swapped-out sequences); 0 turns the host cache off and empties it."""
        if pages < 0:
            raise ValueError("a host cache cannot hold fewer than 0 pages")
        self.registry.host.resize(pages)
        self.registry.pool.host = self.registry.host if pages > 0 else None
        if not pages:
            self.registry.host.drop_where()

    def enable_events(self, private_blocks: PrivateBlocks = PrivateBlocks.TOKEN_IDS) -> KVEventLog:
        """Log every block the device or the host cache starts or stops holding, as KV events
        (``kvd.kv.events``), from an empty cache: call it before any block is
        cached, or a subscriber misses those already held."""
        groups = [
            GroupSpec(SLIDING_WINDOW, g.window)
            if g.kind is AttentionKind.SLIDING
            else GroupSpec(FULL_ATTENTION)
            for g in self.layout.groups
        ]
        log = KVEventLog(self.block_size, groups, private_blocks)
        self.registry.pool.events = self.registry.host.events = log
        return log

    def set_host_quota(self, name: str, pages: int | None) -> int:
        """Most host-cache pages ``name``'s blocks may hold (None: the whole
        host cache); blocks past a lowered quota are dropped at once (returned)."""
        self.registry.ledger.tenant(name)  # raises BudgetError for an unknown tenant
        return self.registry.host.set_quota(name, pages)

    def set_mode(self, mode: BudgetMode) -> None:
        self.registry.ledger.set_mode(mode)

    def set_policy(self, policy: SharingPolicy) -> None:
        """Switch the sharing policy; it scopes every lookup from now on."""
        self.registry.policy = SharingPolicy(policy)
        self.registry.generation += 1

    def add_public_prefix(self, name: str, tokens: list[int]) -> None:
        """Register a public prefix; refused if its pages would break reservations."""
        if name in self.registry.public:
            raise ValueError(f"a public prefix named {name!r} already exists")
        if not tokens:
            raise ValueError("a public prefix needs at least one token")
        self.registry.ledger.set_public_bound(self._public_bound(extra=len(tokens)))
        self.registry.public.add(name, tokens)
        self.registry.generation += 1

    def remove_public_prefix(self, name: str) -> None:
        """Unregister a public prefix; its pages that no other prefix covers
        leave the cache (idle ones are freed, held ones become private)."""
        prefix_id = self.registry.public.remove(name)
        self.registry.pool.unpublish(prefix_id)
        self.registry.host.drop_where(public_id=prefix_id)
        self.registry.ledger.set_public_bound(self._public_bound())
        self.registry.generation += 1

    def _public_bound(self, extra: int = 0) -> int:
        lengths = [len(tokens) for _, tokens in self.registry.public.items()] + [extra]
        return sum(length // self.block_size for length in lengths) * self.layout.num_groups

    def findable_blocks(self) -> dict[str, int]:
        """Blocks the device's prefix cache can serve now, by attention kind
        (``global``, ``sliding``): distinct blocks, however many page groups of
        that kind hold one. A router indexing the events holds as many
        full-attention (global) blocks as this says."""
        kinds = [group.kind for group in self.layout.groups]
        found: dict[str, set[bytes]] = {str(kind): set() for kind in AttentionKind}
        for group, block_hash in self.registry.pool.index:
            found[str(kinds[group])].add(block_hash)
        return {kind: len(hashes) for kind, hashes in found.items()}

    def flush_cache(self) -> int:
        """Forget all cached pages nobody uses, on the device and the host cache; returns how
        many were dropped."""
        return self.registry.pool.flush() + self.registry.host.drop_where()

    def stats(self) -> KVStats:
        pool = self.registry.pool
        return KVStats(
            capacity_pages=pool.capacity,
            page_bytes=self.layout.page_bytes,
            block_size=self.block_size,
            free_pages=len(pool.free),
            cached_pages=len(pool.lru),
            referenced_pages=pool.num_referenced(),
            sequences=len(self.registry.sequences),
            prefix_query_tokens=self.prefix_query_tokens,
            prefix_hit_tokens=self.prefix_hit_tokens,
            cache_evictions=pool.evictions,
            policy=self.policy.value,
            mode=self.registry.ledger.mode.value,
            reserved_pages=self.registry.ledger.total_reserved(),
            host_pages=self.registry.host.total,
            host_cached_pages=len(self.registry.host),
            host_swap_pages=self.registry.host.swap_held,
            host_hit_tokens=self.host_hit_tokens,
            host_offloads=self.registry.host.offloaded,
            host_evictions=self.registry.host.evictions,
        )

    def check_invariants(self) -> None:
        """Refcounts equal block-table references; tables are consistent;
        the host cache's charges and quotas hold, and it shares no key with
        the device."""
        check_invariants(self.registry)
        self.registry.host.check_invariants()
        assert not self.registry.host.blocks.keys() & self.registry.pool.index.keys(), (
            "a block in both"
        )
        events = self.registry.pool.events
        if events is not None:  # subscribers were told what the pool and host cache hold
            assert events.held(GPU) == self.registry.pool.index.keys(), (
                "events disagree with the pool"
            )
            assert events.held(CPU) == self.registry.host.blocks.keys(), (
                "events disagree with the host"
            )
