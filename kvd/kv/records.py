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
    host_pages: int = 0  # the host budget (swap and the host cache), 0: no host cache
    host_cached_pages: int = 0
    host_swap_pages: int = 0
    host_hit_tokens: int = 0  # of prefix_hit_tokens, served from the host cache
    host_offloads: int = 0
    host_evictions: int = 0
