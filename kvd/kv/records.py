"""What the KV manager answers with: prefix hits, demands, page copies, stats."""

from __future__ import annotations

import msgspec

from kvd.kv.scope import Scope


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
    epoch: int  # cache evictions (the device and the host cache) and host reloads at lookup time
    generation: int  # sharing configuration at lookup time
    scope: Scope
    # (group, block) of the hit held by the host cache, not the device: copied
    # back into fresh pages when the hit is allocated (``pages`` has 0 there).
    reloads: tuple[tuple[int, int], ...] = ()

    @property
    def reload_blocks(self) -> int:
        """Blocks of the hit with at least one group on the host cache."""
        return len({block for _, block in self.reloads})


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
    """One snapshot of the pool and the host cache (``KVManager.stats``)."""

    capacity_pages: int  # allocatable device pages (the null page excluded)
    page_bytes: int  # bytes of one page: one block of one page group
    block_size: int  # tokens per block
    free_pages: int  # pages holding nothing
    cached_pages: int  # pages nobody references, kept for prefix hits (evictable)
    referenced_pages: int  # pages some live sequence's table holds
    sequences: int  # live sequences (running, waiting for pages, swapped out)
    prefix_query_tokens: int  # prompt tokens looked up in the prefix cache, ever
    prefix_hit_tokens: int  # of those, found cached (device or host cache)
    cache_evictions: int  # cached pages reclaimed for new work, ever
    policy: str  # the sharing policy
    mode: str  # the budget mode
    reserved_pages: int = 0  # the tenants' reservations, summed
    host_pages: int = 0  # the host budget (swap and the host cache), 0: no host cache
    host_cached_pages: int = 0  # host pages cached blocks hold
    host_swap_pages: int = 0  # host pages swapped-out sequences hold
    host_hit_tokens: int = 0  # of prefix_hit_tokens, served from the host cache
    host_offloads: int = 0  # blocks copied to the host cache on eviction, ever
    host_evictions: int = 0  # blocks the host cache dropped for room, ever


class TenantKV(msgspec.Struct, frozen=True):
    """One tenant's pages (``KVManager.tenant``)."""

    charged_pages: int  # device pages charged to the tenant now
    reserved_pages: int  # its reservation
    cap_pages: int | None  # its burst cap (None: none)
    surplus_pages: int  # charged pages above the guarantee: reclaimable
    host_cached_pages: int  # host-cache pages its cached blocks hold
