"""The scheduler's shared record: tenants with their settings, limiters,
queues and counts; the live requests by phase; and the logs the daemon reads.

The scheduler and its parts (``admission.py``, ``preemption.py``,
``tokens.py``) each hold this one record and read its tables, but change
them only through its methods, one per step of a request's way (queued,
started, preempted, swapped out and in, served, ended), so every table a
step touches changes together. Ending a request is one of them: its pages,
its rate-limit refund, its host pages and its place in every table go
together. Each part's docstring says which of these changes it makes.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from kvd.kv.manager import KVManager
from kvd.kv.sequence import Residency
from kvd.sched.fairshare import VirtualCounters
from kvd.sched.ratelimit import TenantLimiter
from kvd.sched.requests import Request, RequestPhase, RunningOrder, StepEvent
from kvd.sched.results import CopyFailed, Failed, Preempted, Started, StepResult
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
        self.constrained: set[Request] = set()  # live requests with a grammar to follow
        self.ended = 0  # requests finished so far: a step asks whether any of its own did
        self.serials = itertools.count()  # arrival order among equal clocks
        self.steps = 0
        self.preemptions = 0
        # Starts, preemptions and failures since the last step's result
        # (``take_result`` hands them over with the step's events).
        self.result = StepResult()

    def set_tenant(self, tenant: TenantConfig) -> None:
        """Add ``tenant`` or change its settings; a change of its rate limits
        starts its limiter afresh, and its queue and counts are kept."""
        name = tenant.name
        self.counters.set_weight(name, tenant.weight)
        old = self.tenants.get(name)
        if old is None or old.limits != tenant.limits:
            self.limiters[name] = TenantLimiter(tenant.limits, self.clock())
        self.tenants[name] = tenant
        if name not in self.tenant_index:
            self.tenant_index[name] = len(self.tenant_names)
            self.tenant_names.append(name)
        self.queues.setdefault(name, deque())
        self.tenant_stats.setdefault(name, TenantStats())

    def remove_tenant(self, name: str) -> None:
        """Forget a tenant (the caller checks it has no live request); its
        index in ``tenant_names`` stays taken, so slots never change meaning."""
        for table in (self.tenants, self.limiters, self.queues, self.tenant_stats):
            table.pop(name, None)
        self.counters.forget(name)

    # -- a request's way through the tables: each change is one method here,
    # so the parts change the book only through them.

    def enqueue(self, first: Request, choices: list[Request]) -> None:
        """Queue a new request's choices (``first`` first among them); a tenant
        that had nothing to do becomes active in the fair-share counters."""
        tenant = first.tenant
        queue = self.queues[tenant]
        if len(choices) > 1:
            self.choices[first.reply_id] = first
        if not queue and not self.backlogged(tenant):
            self.counters.activate(tenant, self.active_tenants())
        for request in choices:
            queue.append(request)
            self.requests[request.request_id] = request
            if request.stop is not None:
                self.stopping.add(request)
            if request.params.stop_token_ids:
                self.with_stop_ids.add(request)
            if request.constraint is not None:
                self.constrained.add(request)

    def rate_limited(self, tenant: str) -> None:
        self.tenant_stats[tenant].rate_limited += 1

    def start(self, request: Request) -> None:
        """A waiting request runs (``log_start`` records its first start)."""
        queue = self.queues[request.tenant]
        if queue[0] is request:
            queue.popleft()
        else:  # its own victims went back to the head of the queue, before it
            queue.remove(request)
        request.phase = RequestPhase.RUNNING
        self.add_running(request)

    def log_start(self, request: Request, cached_tokens: int, *, prompt: bool) -> None:
        """``request`` started with ``cached_tokens`` from the prefix cache;
        ``prompt``: count its prompt in its tenant's figures (once per request
        of several choices)."""
        queue_steps = request.queue_steps or 0
        self.result.started.append(
            Started(request.request_id, request.tenant, queue_steps, cached_tokens)
        )
        if prompt:
            stats = self.tenant_stats[request.tenant]
            stats.prompt_tokens += len(request.prompt)
            stats.cached_tokens += cached_tokens

    def preempted(self, request: Request, kind: str) -> None:
        """A running request stops running (``kind``: how its pages go)."""
        self.remove_running(request)
        request.preemptions += 1
        self.preemptions += 1
        self.result.preempted.append(Preempted(request.request_id, request.tenant, kind))

    def swap_failed(self, request: Request, kind: str, cause: str) -> None:
        """The copy of ``request``'s pages out failed: it goes as ``kind`` instead."""
        self.result.copy_failed.append(CopyFailed("swap_out", cause))
        self.result.preempted[-1] = Preempted(request.request_id, request.tenant, kind)

    def swapped_out(
        self, request: Request, blocks: list[tuple[int, int]], data: np.ndarray[Any, Any]
    ) -> None:
        """``request``'s pages are on the host now: ``data``, a row per block."""
        self.swap_space.take(request.tenant, len(blocks))
        request.host_pages = (blocks, data)
        request.phase = RequestPhase.SWAPPED
        self.swapped[request.request_id] = request
        self.tenant_stats[request.tenant].preempted_swap += 1

    def swapped_in(self, request: Request) -> None:
        """``request``'s pages are back on the device: it runs again."""
        assert request.host_pages is not None
        self.swap_space.give(request.tenant, len(request.host_pages[0]))
        request.host_pages = None
        request.phase = RequestPhase.RUNNING
        del self.swapped[request.request_id]
        self.add_running(request)

    def served(self, tenant: str, tokens: int) -> None:
        """``tenant`` was given ``tokens`` new tokens: charged to its fair
        share (once per tenant and step) and counted."""
        self.counters.charge(tenant, output_tokens=tokens)
        self.tenant_stats[tenant].completion_tokens += tokens

    def requeued(self, request: Request) -> None:
        """A preempted request waits at the head of its tenant's queue, to recompute."""
        request.phase = RequestPhase.WAITING
        self.queues[request.tenant].appendleft(request)
        self.tenant_stats[request.tenant].preempted_recompute += 1

    def log_fault(self, request: Request, cause: str) -> None:
        self.result.failed.append(Failed(request.request_id, request.tenant, cause))

    def log_copy_failure(self, kind: str, cause: str) -> None:
        self.result.copy_failed.append(CopyFailed(kind, cause))

    def take_result(self, events: list[StepEvent]) -> StepResult:
        """A step's result: ``events`` with what was logged since the last one."""
        result, self.result = self.result, StepResult()
        result.events = events
        return result

    def next_step(self) -> int:
        self.steps += 1
        return self.steps

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
            # Another choice was charged for its completion alone (the first, the prompt).
            shared = request.shared_prompt
            used = 0 if request.started_at is None or seq is None else len(seq.tokens) - shared
            limiter.refund(request.max_length - shared - used, self.clock())
        if seq is not None and seq.residency is not Residency.RELEASED:
            self.kv.finish(seq)
        if request.phase is RequestPhase.RUNNING:
            self.remove_running(request)
        self.swapped.pop(request.request_id, None)
        queue = self.queues[request.tenant]
        if request in queue:
            queue.remove(request)
        request.phase = RequestPhase.FINISHED
        self.ended += 1
        request.finish_reason = reason
        if request.host_pages is not None:
            self.swap_space.give(request.tenant, len(request.host_pages[0]))
        request.host_pages = None
        self.tenant_stats[request.tenant].finished += 1
        del self.requests[request.request_id]
        self.stopping.discard(request)
        self.with_stop_ids.discard(request)
        self.constrained.discard(request)
        first = request.first_choice or request
        if first.other_choices and all(
            r.phase is RequestPhase.FINISHED for r in (first, *first.other_choices)
        ):
            del self.choices[first.reply_id]
