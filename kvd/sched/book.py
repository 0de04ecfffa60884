"""The scheduler's shared record: tenants with their settings, limiters,
queues and counts; the live requests by phase; and the logs the daemon reads.

The scheduler's parts (``admission.py``, ``preemption.py``, ``tokens.py``)
each hold this one record and say, in their docstrings, which of its fields
they change. Ending a request lives here, as the one way any part ends one:
its pages, its rate-limit refund, its host pages and its place in every
table go together.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable

from kvd.kv.manager import KVManager
from kvd.kv.sequence import Residency
from kvd.sched.fairshare import VirtualCounters
from kvd.sched.ratelimit import TenantLimiter
from kvd.sched.requests import Request, RequestPhase, RunningOrder
from kvd.sched.settings import TenantConfig
from kvd.sched.stats import TenantStats
from kvd.sched.swapspace import SwapSpace


class RequestBook:
    def __init__(self, kv: KVManager, swap_space: SwapSpace, clock: Callable[[], float]) -> None:
        self.kv = kv
        self.swap_space = swap_space
        self.clock = clock
        self.tenants: dict[str, TenantConfig] = {}
        self.limiters: dict[str, TenantLimiter] = {}
        self.queues: dict[str, deque[Request]] = {}
        self.tenant_stats: dict[str, TenantStats] = {}
        self.counters = VirtualCounters()
        self.tenant_names: list[str] = []  # SlotInfo.tenant indexes this
        self.tenant_index: dict[str, int] = {}
        self.requests: dict[str, Request] = {}
        self.choices: dict[str, Request] = {}  # a request of n > 1: its first choice, until all end
        self.running: dict[str, Request] = {}
        self.running_order = RunningOrder()
        self.swapped: dict[str, Request] = {}
        self.stopping: set[Request] = set()  # live requests with stop strings to watch
        self.with_stop_ids: set[Request] = set()  # live requests with stop token ids
        self.serials = itertools.count()  # arrival order among equal clocks
        self.steps = 0
        self.preemptions = 0
        # Preemptions as they happen, (request id, tenant, kind), for the
        # daemon's logs; bounded, so a caller that never reads costs nothing.
        self.preemption_log: deque[tuple[str, str, str]] = deque(maxlen=4096)
        # Requests as they start, (request id, tenant, queue steps, cached tokens),
        # for the daemon's logs; bounded likewise.
        self.start_log: deque[tuple[str, str, int, int]] = deque(maxlen=4096)
        # Requests failed alone by a fault of their own, (request id, tenant,
        # cause), for the daemon's logs; and copies that failed and were
        # recovered from, (what, cause).
        self.fault_log: deque[tuple[str, str, str]] = deque(maxlen=4096)
        self.copy_failures: deque[tuple[str, str]] = deque(maxlen=4096)

    def live_requests(self, tenant: str) -> int:
        """Requests of ``tenant`` queued, running or swapped out."""
        return sum(1 for r in self.requests.values() if r.tenant == tenant)

    def backlogged(self, tenant: str) -> bool:
        return bool(self.queues[tenant]) or any(r.tenant == tenant for r in self.running.values())

    def active_tenants(self) -> set[str]:
        return {t for t in self.tenants if self.backlogged(t)}

    def add_running(self, request: Request) -> None:
        self.running[request.request_id] = request
        self.running_order.add(request)

    def remove_running(self, request: Request) -> None:
        del self.running[request.request_id]
        self.running_order.remove(request)

    def by_seq(self, seq_id: int) -> Request:
        for request in self.running.values():
            if request.seq is not None and request.seq.seq_id == seq_id:
                return request
        raise KeyError(seq_id)

    def finish(self, request: Request, reason: str) -> None:
        """End ``request`` for ``reason``: its pages go back, its unused
        tokens are refunded to its rate limit, it leaves every table."""
        seq = request.seq
        if seq is not None and seq.residency is not Residency.RELEASED:
            self.kv.drop_pending(seq)  # tokens after its end: never recorded
        limiter = self.limiters.get(request.tenant)
        if limiter is not None:
            # A fork was charged for its completion alone (its lead, the prompt).
            shared = request.shared_prompt
            used = 0 if request.started_at is None or seq is None else len(seq.tokens) - shared
            limiter.refund(request.stop_length - shared - used, self.clock())
        if seq is not None and seq.residency is not Residency.RELEASED:
            self.kv.finish(seq)
        if request.phase is RequestPhase.RUNNING:
            self.remove_running(request)
        self.swapped.pop(request.request_id, None)
        queue = self.queues[request.tenant]
        if request in queue:
            queue.remove(request)
        request.phase = RequestPhase.FINISHED
        request.finish_reason = reason
        if request.host_pages is not None:
            self.swap_space.give(request.tenant, len(request.host_pages[0]))
        request.host_pages = None
        self.tenant_stats[request.tenant].finished += 1
        del self.requests[request.request_id]
        self.stopping.discard(request)
        self.with_stop_ids.discard(request)
        lead = request.lead or request
        if lead.forks and all(r.phase is RequestPhase.FINISHED for r in (lead, *lead.forks)):
            del self.choices[lead.reply_id]
