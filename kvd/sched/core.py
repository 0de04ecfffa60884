"""The scheduler's state and bookkeeping: tenants, queues, running and
swapped requests, finishing and expiring them, and the stats it reports. It
owns the KV manager and binds the executor to it."""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np

from kvd.kv.hosttier import FREE, OUT
from kvd.kv.ledger import TenantBudget
from kvd.kv.manager import KVError, KVManager, PrefixHit
from kvd.kv.sequence import KVState, Sequence
from kvd.sched.costmodel import Rates, measure_rates
from kvd.sched.executor import Executor
from kvd.sched.fairshare import VirtualCounters
from kvd.sched.ratelimit import TenantLimiter
from kvd.sched.requests import (
    Request,
    RequestState,
    RunningOrder,
    SlotInfo,
    StepEvent,
)
from kvd.sched.settings import SchedulerConfig, TenantConfig
from kvd.sched.stats import SchedulerStats, TenantStats
from kvd.sched.swapspace import SwapSpace

_NO_SLOTS = np.zeros(0, np.int64)


class SchedulerCore:
    def __init__(
        self,
        executor: Executor,
        config: SchedulerConfig | None = None,
        *,
        kv: KVManager | None = None,
        rates: Rates | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.executor = executor
        self.limits = executor.limits
        self.config = config = config or SchedulerConfig()
        if kv is None:
            kv = KVManager(executor.layout, executor.num_pages)
        kv.set_mode(config.mode)
        kv.set_policy(config.policy)
        self.kv = kv
        executor.bind(kv)
        self.rates = rates
        self.clock = clock
        kv.enable_host_tier(config.host_pages)
        self.swap_space = SwapSpace(config.swap_pages, kv.host)
        # Host-tier block contents by host slot, as (rows of one copy, index):
        # the tier keeps the bookkeeping.
        self.host_store: dict[int, tuple[Any, int] | None] = {}  # None: its copy failed
        self.tenants: dict[str, TenantConfig] = {}
        self.limiters: dict[str, TenantLimiter] = {}
        self.queues: dict[str, deque[Request]] = {}
        self.counters = VirtualCounters()
        self.requests: dict[str, Request] = {}
        self.choices: dict[str, Request] = {}  # a request of n > 1: its first choice, until all end
        self.running: dict[str, Request] = {}
        self._running_order = RunningOrder()
        self._serials = itertools.count()
        self.swapped: dict[str, Request] = {}
        self.tenant_stats: dict[str, TenantStats] = {}
        self.steps = 0
        self.stalled = False
        self.preemptions = 0
        self.last_step_predicted_s: float | None = None
        self._seq_ids = itertools.count(1)
        self._ttft: list[float] = []
        self._itl: list[float] = []
        # The running requests of this step and their KV slots, when computed while
        # scheduling (a step of only those decodes needs them again).
        self._decode_slots: tuple[list[Request], list[Sequence], np.ndarray[Any, Any]] = (
            [],
            [],
            _NO_SLOTS,
        )
        self._slot_info = SlotInfo()
        self.tenant_names: list[str] = []  # SlotInfo.tenant indexes this
        self._tenant_index: dict[str, int] = {}
        self._is_stop = np.zeros(self.limits.vocab_size, np.bool_)  # by token id
        self._is_stop[sorted(executor.stop_ids)] = True
        self._queue: list[float] = []
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
        # Requests holding their prompt's own logprobs until their first token.
        self._scoring: set[Request] = set()
        # Per public prefix: [requests that started with it, of those served
        # from cache, prompt tokens served from cache].
        self.prefix_hits: dict[str, list[int]] = {}

    def calibrate(self, repeats: int = 3) -> Rates:
        """Measure the executor's rates (on a scratch KV manager) and use them."""
        try:
            self.rates = measure_rates(self.executor, repeats)
        finally:
            self.executor.bind(self.kv)
        return self.rates

    def set_tenant(self, tenant: TenantConfig) -> None:
        if tenant.tier not in self.config.tiers:
            raise ValueError(
                f"unknown tier {tenant.tier!r} (tiers: {', '.join(self.config.tiers)})"
            )
        self.kv.set_tenant(tenant.name, TenantBudget(tenant.reservation_pages, tenant.cap_pages))
        self.kv.set_host_quota(tenant.name, tenant.host_quota_pages)
        self.sync_host_tier()  # a lowered quota's blocks are gone now, data included
        self.counters.set_weight(tenant.name, tenant.weight)
        old = self.tenants.get(tenant.name)
        if old is None or old.limits != tenant.limits:
            self.limiters[tenant.name] = TenantLimiter(tenant.limits, self.clock())
        self.tenants[tenant.name] = tenant
        if tenant.name not in self._tenant_index:
            self._tenant_index[tenant.name] = len(self.tenant_names)
            self.tenant_names.append(tenant.name)
        self.queues.setdefault(tenant.name, deque())
        self.tenant_stats.setdefault(tenant.name, TenantStats())

    def live_requests(self, tenant: str) -> int:
        """Requests of ``tenant`` queued, running or swapped out."""
        return sum(1 for r in self.requests.values() if r.tenant == tenant)

    def remove_tenant(self, name: str) -> None:
        """Forget a tenant with no live request (refused otherwise)."""
        if name not in self.tenants:
            raise ValueError(f"no tenant {name!r}")
        live = self.live_requests(name)
        if live:
            raise ValueError(f"tenant {name!r} has {live} live requests: drain them first")
        self.kv.remove_tenant(name)
        self.sync_host_tier()
        for table in (self.tenants, self.limiters, self.queues, self.tenant_stats):
            table.pop(name, None)
        self.counters.forget(name)

    def flush_cache(self) -> int:
        """Forget every cached block nobody uses, on both tiers (host data too)."""
        flushed = self.kv.flush_cache()
        self.sync_host_tier()
        return flushed

    def sync_host_tier(self) -> None:
        """Do the copies the host tier queued, in the order it queued them:
        pages it took in are copied out before anything overwrites them (a
        step, a swap-in), blocks a hit brought back are copied in before a
        step reads them, slots it let go of are dropped. Consecutive copies
        of one kind go as one executor call. Called before every engine step
        and device write."""
        copies = self.kv.host.take_copies()
        store = self.host_store
        # Without waiting where the executor can (the engine's gather is
        # ordered before the step that reuses the pages): a row is read on
        # the host when a reload first needs it.
        copy_out = getattr(self.executor, "copy_out_later", self.executor.copy_out)
        for kind, run in itertools.groupby(copies, key=lambda copy: copy.kind):
            batch = list(run)
            if kind == FREE:
                for copy in batch:
                    store.pop(copy.slot, None)
            elif kind == OUT:
                try:
                    rows = copy_out([copy.page for copy in batch])
                except Exception as exc:  # noqa: BLE001  # recovered from: the blocks go
                    lost = {copy.slot for copy in batch}
                    self.kv.host.lose(lost)
                    for slot in lost:
                        store[slot] = None
                    self.copy_failures.append(("offload", f"{type(exc).__name__}: {exc}"))
                    continue
                for i, copy in enumerate(batch):
                    store[copy.slot] = (rows, i)
            else:
                entries = [store.pop(copy.slot) for copy in batch]
                if any(entry is None for entry in entries):
                    # Claimed by a hit in the step its copy out failed: the
                    # device would read pages nobody wrote.
                    raise KVError("a host-tier block a prefix hit claimed was never stored")
                data = np.stack([_row(entry) for entry in entries if entry is not None])
                self.executor.copy_in([copy.page for copy in batch], data)

    def _backlogged(self, tenant: str) -> bool:
        return bool(self.queues[tenant]) or any(r.tenant == tenant for r in self.running.values())

    def _active_tenants(self) -> set[str]:
        return {t for t in self.tenants if self._backlogged(t)}

    def cancel(self, request_id: str, choice: int | None = None) -> bool:
        """Stop a request (all its choices, or the one ``choice``) now and free
        its pages; False if it is unknown or done."""
        lead = self.requests.get(request_id) or self.choices.get(request_id)
        if lead is None:
            return False
        group = [lead, *lead.forks]
        targets = group if choice is None else [r for r in group if r.choice == choice]
        live = [r for r in targets if r.state is not RequestState.FINISHED]
        for request in live:
            self._finish(request, "cancelled")
        return bool(live)

    def has_work(self) -> bool:
        return bool(self.running or self.swapped or any(self.queues.values()))

    def _add_running(self, request: Request) -> None:
        self.running[request.request_id] = request
        self._running_order.add(request)

    def _remove_running(self, request: Request) -> None:
        del self.running[request.request_id]
        self._running_order.remove(request)

    def _by_seq(self, seq_id: int) -> Request:
        for request in self.running.values():
            if request.seq is not None and request.seq.seq_id == seq_id:
                return request
        raise KeyError(seq_id)

    def _count_prefix_hit(self, hit: PrefixHit) -> None:
        name = hit.scope.public_prefix
        if name is None:
            return
        counts = self.prefix_hits.setdefault(name, [0, 0, 0])
        served = min(hit.num_tokens, hit.scope.public_blocks * self.kv.block_size)
        counts[0] += 1
        counts[1] += served > 0
        counts[2] += served

    def _finish(self, request: Request, reason: str) -> None:
        seq = request.seq
        limiter = self.limiters.get(request.tenant)
        if limiter is not None:
            # A fork was charged for its completion alone (its lead, the prompt).
            shared = request.shared_prompt
            used = 0 if request.started_at is None or seq is None else len(seq.tokens) - shared
            limiter.refund(request.stop_length - shared - used, self.clock())
        if seq is not None and seq.state is not KVState.RELEASED:
            self.kv.finish(seq)
        if request.state is RequestState.RUNNING:
            self._remove_running(request)
        self.swapped.pop(request.request_id, None)
        queue = self.queues[request.tenant]
        if request in queue:
            queue.remove(request)
        request.state = RequestState.FINISHED
        request.finish_reason = reason
        if request.host_pages is not None:
            self.swap_space.give(request.tenant, len(request.host_pages[0]))
        request.host_pages = None
        self.tenant_stats[request.tenant].finished += 1
        del self.requests[request.request_id]
        lead = request.lead or request
        if lead.forks and all(r.state is RequestState.FINISHED for r in (lead, *lead.forks)):
            del self.choices[lead.reply_id]

    def _fail(self, request: Request, cause: BaseException, events: list[StepEvent]) -> None:
        """End ``request`` alone for a fault of its own (its pages go back)."""
        self._finish(request, "error")
        detail = f"{type(cause).__name__}: {cause}"
        self.fault_log.append((request.request_id, request.tenant, detail))
        events.append(
            StepEvent(request.reply_id, None, 0.0, True, "error", detail, choice=request.choice)
        )

    def _expire(self, now: float, events: list[StepEvent]) -> None:
        for queue in self.queues.values():
            # Only requests that never started: a preempted one re-queued is not late.
            expired = [
                r
                for r in queue
                if r.deadline is not None and r.deadline < now and r.started_at is None
            ]
            for request in expired:
                self._finish(request, "deadline")
                events.append(
                    StepEvent(request.reply_id, None, 0.0, True, "deadline", choice=request.choice)
                )

    def stats(self) -> SchedulerStats:
        kv = self.kv
        tenants: dict[str, TenantStats] = {}
        for name, base in self.tenant_stats.items():
            account = kv.ledger.accounts.get(name)
            stats = msgspec.structs.replace(
                base,
                running=sum(1 for r in self.running.values() if r.tenant == name),
                waiting=len(self.queues[name]),
                swapped=sum(1 for r in self.swapped.values() if r.tenant == name),
                pages_used=account.used if account else 0,
                pages_reserved=account.reservation if account else 0,
                pages_cap=account.cap if account else None,
                surplus_pages=kv.ledger.surplus(name) if account else 0,
                host_swap_pages=self.swap_space.used.get(name, 0),
                host_cached_pages=kv.host.used.get(name, 0),
                service=self.counters.service.get(name, 0.0),
            )
            tenants[name] = stats
        ttft, itl, queue = self._ttft, self._itl, self._queue
        self._ttft, self._itl, self._queue = [], [], []
        rates = self.rates
        return SchedulerStats(
            steps=self.steps,
            running=len(self.running),
            waiting=sum(len(q) for q in self.queues.values()),
            swapped=len(self.swapped),
            free_pages=len(kv.pool.free),
            cached_pages=len(kv.pool.lru),
            used_pages=kv.pool.num_referenced(),
            prefix_query_tokens=kv.prefix_query_tokens,
            prefix_hit_tokens=kv.prefix_hit_tokens,
            preempted_recompute=sum(t.preempted_recompute for t in tenants.values()),
            preempted_swap=sum(t.preempted_swap for t in tenants.values()),
            ttft_s=ttft,
            inter_token_s=itl,
            queue_s=queue,
            tenants=tenants,
            prefill_tokens_per_s=rates.prefill_tokens_per_s if rates else None,
            copy_bytes_per_s=rates.copy_bytes_per_s if rates else None,
            crossover_tokens=rates.crossover_tokens() if rates else None,
            host_pages=kv.host.total,
            host_cached_pages=len(kv.host),
            host_swap_pages=self.swap_space.held,
            host_hit_tokens=kv.host_hit_tokens,
            host_offloads=kv.host.offloaded,
            host_evictions=kv.host.evictions,
        )


def _row(entry: tuple[Any, int]) -> np.ndarray[Any, Any]:
    rows, index = entry
    return np.asarray(rows[index])
