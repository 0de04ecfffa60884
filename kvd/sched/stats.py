"""What the scheduler reports: one snapshot per call, per tenant and for the
whole pool. The pool's own figures are the KV manager's snapshot, held whole
(``SchedulerStats.kv``), not copied field by field."""

from __future__ import annotations

import msgspec

from kvd.kv.records import KVStats


class TenantStats(msgspec.Struct):
    running: int = 0  # requests computing now
    waiting: int = 0  # requests queued, not yet admitted to the pool
    swapped: int = 0  # requests preempted to host memory
    charged_pages: int = 0  # device pages charged to the tenant now
    reserved_pages: int = 0  # its reservation
    cap_pages: int | None = None  # its burst cap (None: none)
    surplus_pages: int = 0  # charged pages above its guarantee: reclaimable
    host_swap_pages: int = 0  # host pages its swapped-out sequences hold
    host_cached_pages: int = 0  # host-cache pages its cached blocks hold
    service: float = 0.0  # weighted tokens served (the fair-share charge), ever
    preempted_recompute: int = 0  # preemptions that dropped its pages, ever
    preempted_swap: int = 0  # preemptions that swapped its pages out, ever
    rate_limited: int = 0  # requests refused by its rate limits, ever
    finished: int = 0  # requests finished, however they ended, ever
    prompt_tokens: int = 0  # prompt tokens of its requests, ever
    completion_tokens: int = 0  # tokens generated for it, ever
    cached_tokens: int = 0  # of prompt_tokens, served from the prefix cache


class SchedulerStats(msgspec.Struct):
    steps: int  # engine steps run
    running: int  # requests computing now
    waiting: int  # requests queued
    swapped: int  # requests preempted to host memory
    kv: KVStats  # the pool and the host cache
    preempted_recompute: int  # the tenants' preempted_recompute, summed
    preempted_swap: int  # the tenants' preempted_swap, summed
    tenants: dict[str, TenantStats]
    prefill_tokens_per_s: float | None  # measured prefill rate (None: not yet)
    copy_bytes_per_s: float | None  # measured host copy rate (None: not yet)
    crossover_tokens: int | None  # prompt length above which swapping beats recompute
