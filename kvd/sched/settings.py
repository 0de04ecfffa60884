"""What an operator sets: the scheduler's policy and each tenant's terms."""

from __future__ import annotations

import msgspec

from kvd.kv.ledger import BudgetMode
from kvd.kv.scope import SharingPolicy
from kvd.sched.ratelimit import RateLimits


class TenantConfig(msgspec.Struct, frozen=True):
    name: str
    reservation_pages: int = 0
    cap_pages: int | None = None
    tier: str = "interactive"
    weight: float = 1.0
    limits: RateLimits = RateLimits()
    max_queue: int = 64
    swap_pages: int | None = None  # host pages its swapped-out sequences may hold
    host_quota_pages: int | None = None  # host-cache pages its cached blocks may hold; None: all


class SchedulerConfig(msgspec.Struct, frozen=True):
    tiers: tuple[str, ...] = ("interactive", "batch")  # most important first
    mode: BudgetMode = BudgetMode.RESERVE
    policy: SharingPolicy = SharingPolicy.PUBLIC
    preemption: str = "auto"  # "auto" (cost model), "recompute" or "swap"
    # Plan and dispatch each step before reading the one before it, so the
    # device never waits for the host's bookkeeping; False: one step at a time.
    overlap: bool = True
    # A step's predicted time (cost model) stays under this once it holds any
    # work: prefill chunks shrink to fit after the decodes. None: tokens only.
    target_step_ms: float | None = None
    swap_pages: int | None = None  # host pages swapped-out sequences may hold, all tenants
    # The host cache of the prefix cache: one host budget (in pages) that it
    # and swapped-out sequences share (swap_pages is then not used); 0: off.
    host_pages: int = 0
