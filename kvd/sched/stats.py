"""What the scheduler reports: per tenant and for the whole pool."""

from __future__ import annotations

import msgspec


class TenantStats(msgspec.Struct):
    running: int = 0
    waiting: int = 0
    swapped: int = 0
    pages_used: int = 0
    pages_reserved: int = 0
    pages_cap: int | None = None
    surplus_pages: int = 0
    host_swap_pages: int = 0  # host pages its swapped-out sequences hold
    host_cached_pages: int = 0  # host-cache pages its cached blocks hold
    service: float = 0.0
    preempted_recompute: int = 0
    preempted_swap: int = 0
    rate_limited: int = 0
    finished: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


class SchedulerStats(msgspec.Struct):
    steps: int
    running: int
    waiting: int
    swapped: int
    free_pages: int
    cached_pages: int
    used_pages: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    preempted_recompute: int
    preempted_swap: int
    tenants: dict[str, TenantStats]
    prefill_tokens_per_s: float | None
    copy_bytes_per_s: float | None
    crossover_tokens: int | None
    host_pages: int = 0  # the host budget: swap and the host cache (0: no host cache)
    host_cached_pages: int = 0
    host_swap_pages: int = 0
    host_hit_tokens: int = 0  # of prefix_hit_tokens, copied back from the host cache
    host_offloads: int = 0
    host_evictions: int = 0
