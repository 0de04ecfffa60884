"""Continuous batching with multi-tenant policy, one synchronous step at a time.

The scheduler is sans-IO: it owns the KV manager (pages, prefix cache, tenant
ledger) and decides; an executor (kvd/sched/executor.py: the engine, or a
simulated one in tests) computes. Each ``step()``:

1. expires waiting requests past their deadline;
2. schedules every running decode first (one token each): a decode that
   needs a page the pool cannot give gets one through the KV core's eviction
   plan, or is preempted itself;
3. shares what is left of the step among prefill work (running prefill
   chunks, swapped-out sequences coming back, waiting requests), a tenant at a
   time: the most important tier first, then the backlogged tenant with the
   smallest virtual token counter (VTC), first come first served within a
   tenant (in ``free`` mode: first come, first served across tenants). A chunk
   is cut to the step's token and time budget (kvd/sched/stepplan.py) and to
   the pages its tenant may take. A tenant under its reservation reclaims
   other tenants' surplus, so its request starts within the step;
4. runs the executor once, commits the computed tokens to the KV manager and
   turns sampled tokens into events.

Finished and cancelled sequences give their pages back at once.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np

from kvd.engine.sampling_params import SamplingParams
from kvd.kv.columns import COMPUTED, LENGTH
from kvd.kv.eviction import plan_eviction
from kvd.kv.ledger import BudgetMode, TenantBudget
from kvd.kv.manager import KVManager, PrefixHit
from kvd.kv.sequence import KVState, Sequence
from kvd.sched.admission import prompt_problem, total_tokens
from kvd.sched.costmodel import Rates, measure_rates
from kvd.sched.executor import Executor
from kvd.sched.fairshare import VirtualCounters
from kvd.sched.preemption import SWAP, SwapSpace, preemption_kind
from kvd.sched.ratelimit import RateLimited, TenantLimiter
from kvd.sched.requests import (
    ParamsOf,
    Rejection,
    Request,
    RequestState,
    RunningOrder,
    StepEvent,
    StepWork,
)
from kvd.sched.settings import SchedulerConfig, TenantConfig
from kvd.sched.stats import SchedulerStats, TenantStats
from kvd.sched.stepplan import StepPlan
from kvd.sched.tokens import SlotInfo, outcome

__all__ = [
    "Rejection",
    "Request",
    "RequestState",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStats",
    "StepEvent",
    "StepWork",
    "TenantConfig",
    "TenantStats",
]

_NO_SLOTS = np.zeros(0, np.int64)


class Scheduler:
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
        self.swap_space = SwapSpace(config.swap_pages)
        self.tenants: dict[str, TenantConfig] = {}
        self.limiters: dict[str, TenantLimiter] = {}
        self.queues: dict[str, deque[Request]] = {}
        self.counters = VirtualCounters()
        self.requests: dict[str, Request] = {}
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
        self._decode_slots: tuple[list[Request], np.ndarray[Any, Any]] = ([], _NO_SLOTS)
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

    # -- tenants ---------------------------------------------------------------

    def set_tenant(self, tenant: TenantConfig) -> None:
        if tenant.tier not in self.config.tiers:
            raise ValueError(
                f"unknown tier {tenant.tier!r} (tiers: {', '.join(self.config.tiers)})"
            )
        self.kv.set_tenant(tenant.name, TenantBudget(tenant.reservation_pages, tenant.cap_pages))
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
        for table in (self.tenants, self.limiters, self.queues, self.tenant_stats):
            table.pop(name, None)
        self.counters.forget(name)

    # -- admission -------------------------------------------------------------

    def submit(
        self,
        request_id: str,
        tenant: str,
        prompt: list[int],
        params: SamplingParams,
        *,
        tier: str | None = None,
        deadline_s: float | None = None,
        cache_salt: str | None = None,
    ) -> Request:
        """Queue a request, or raise Rejection (400/413/429/503) saying why."""
        config = self.tenants.get(tenant)
        if config is None:
            raise Rejection(401, "unknown_tenant", f"unknown tenant {tenant!r}")
        if request_id in self.requests:
            raise Rejection(400, "duplicate_id", f"request {request_id!r} already exists")
        limit = self.limits.max_model_len
        problem = prompt_problem(prompt, self.limits.vocab_size, limit)
        if problem is not None:
            raise problem
        stop_length = total_tokens(len(prompt), params.max_tokens, limit)
        # Chunks shrink to the pages a tenant may take, so what a request needs
        # is what it holds computed a block at a time.
        pages = self.kv.layout.pages_for_tokens(stop_length)
        most, limited_by = self.kv.ledger.most(tenant)
        if pages > most:
            raise Rejection(
                413,
                "too_large",
                f"prompt plus max_tokens need {pages} KV pages; {limited_by} allows "
                f"{most}: lower max_tokens or shorten the prompt",
            )
        tier_name = tier or config.tier
        if tier_name not in self.config.tiers:
            raise Rejection(400, "bad_tier", f"unknown priority tier {tier_name!r}")
        queue = self.queues[tenant]
        if len(queue) >= config.max_queue:
            raise Rejection(
                429, "queue_full", f"tenant queue is full ({config.max_queue} waiting)", 1.0
            )
        now = self.clock()
        try:
            self.limiters[tenant].admit(stop_length, now)
        except RateLimited as exc:
            if exc.retry_after is None:  # larger than a whole minute's allowance
                raise Rejection(
                    400, "exceeds_rate_limit", f"{exc}: lower max_tokens or the prompt"
                ) from None
            self.tenant_stats[tenant].rate_limited += 1
            raise Rejection(429, "rate_limited", str(exc), exc.retry_after) from None
        tier_index = self.config.tiers.index(tier_name)
        request = Request(
            request_id=request_id,
            tenant=tenant,
            stop_length=stop_length,
            prompt_len=len(prompt),
            params=params,
            prompt=list(prompt),
            tier=tier_index,
            arrival=now,
            deadline=None if deadline_s is None else now + deadline_s,
            cache_salt=cache_salt,
            order_key=(tier_index, now, next(self._serials)),
            arrival_step=self.steps,
        )
        if not queue and not self._backlogged(tenant):
            self.counters.activate(tenant, self._active_tenants())
        queue.append(request)
        self.requests[request_id] = request
        return request

    def _backlogged(self, tenant: str) -> bool:
        return bool(self.queues[tenant]) or any(r.tenant == tenant for r in self.running.values())

    def _active_tenants(self) -> set[str]:
        return {t for t in self.tenants if self._backlogged(t)}

    def cancel(self, request_id: str) -> bool:
        """Stop a request now and free its pages; False if it is unknown or done."""
        request = self.requests.get(request_id)
        if request is None or request.state is RequestState.FINISHED:
            return False
        self._finish(request, "cancelled")
        return True

    def has_work(self) -> bool:
        return bool(self.running or self.swapped or any(self.queues.values()))

    # -- one step --------------------------------------------------------------

    def step(self) -> list[StepEvent]:
        now = self.clock()
        self.steps += 1
        events: list[StepEvent] = []
        self._expire(now, events)
        target = self.config.target_step_ms
        plan = StepPlan(
            self.limits.max_num_batched_tokens,
            self.limits.max_num_seqs,
            self.rates,
            None if target is None else target / 1e3,
            floor_tokens=self.kv.block_size,
        )
        preempted = self.preemptions
        prefilling = self._schedule_decodes(plan)
        self._schedule_prefills(plan, prefilling, now)
        work = plan.work
        # Waiting work that nothing in this step could start, and nothing was
        # freed for: only a change (a cancel, an admin command) or time can help.
        self.stalled = not work and self.preemptions == preempted and not events
        self.last_step_predicted_s = plan.predicted_s()
        if not work:
            self._decode_slots = ([], _NO_SLOTS)
            return events
        requests = work.requests
        seqs: list[Sequence] = [request.seq for request in requests]  # type: ignore[misc]
        scheduled, slots = self._decode_slots
        if scheduled != requests:  # more or fewer than the running decodes
            slots = self.kv.slots_of(seqs)
        self._decode_slots = ([], _NO_SLOTS)
        kv = self.kv
        block = kv.columns.matrix[:, slots]  # the step's counters, gathered once
        counts = work.counts
        tokens, logprobs, stopped = self.executor.run(
            seqs, counts, ParamsOf(requests), slots, block
        )
        if len(counts) == plan.tokens and bool((block[LENGTH] == block[COMPUTED] + 1).all()):
            kv.commit_decodes(seqs, slots, block)
        else:
            kv.commit_batch(seqs, counts, slots)
        self._record_tokens(work, seqs, slots, block, tokens, logprobs, stopped, events)
        return events

    def _add_running(self, request: Request) -> None:
        self.running[request.request_id] = request
        self._running_order.add(request)

    def _remove_running(self, request: Request) -> None:
        del self.running[request.request_id]
        self._running_order.remove(request)

    def _schedule_decodes(self, plan: StepPlan) -> list[Request]:
        """Every running decode that fits the step, most important first; returns
        the running requests with a prefill chunk to compute, in running order."""
        order = self._running_order.snapshot()
        if not order:
            return []
        kv = self.kv
        seqs: list[Sequence] = [request.seq for request in order]  # type: ignore[misc]
        slots = kv.slots_of(seqs)
        block = kv.columns.matrix[:, slots]
        decode = block[LENGTH] == block[COMPUTED] + 1
        if len(order) <= plan.max_seqs and len(order) <= plan.tokens_left:
            # Every running decode fits this step, so priority cannot decide who
            # waits: they are scheduled as one array operation (see
            # KVManager.extend_decodes for when those starting a new block
            # join them); decodes that need pages someone else may want follow
            # by priority, and may preempt by policy.
            self._decode_slots = (order, slots)  # step() reuses them
            left = kv.extend_decodes(seqs, slots)
            if not left:
                plan.add_decodes(order, int(block[COMPUTED].sum()))
                return []
            waiting = set(left)
            fast = [i for i in range(len(order)) if i not in waiting]
            plan.add_decodes([order[i] for i in fast], int(block[COMPUTED][fast].sum()))
            slow = [order[i] for i in left if decode[i]]
            prefilling = [order[i] for i in left if not decode[i]]
        else:
            slow = [r for r, d in zip(order, decode.tolist(), strict=True) if d]
            prefilling = [r for r, d in zip(order, decode.tolist(), strict=True) if not d]
        running = RequestState.RUNNING
        for request in slow:
            if plan.full():
                break
            if request.state is not running:
                continue  # preempted while making room for an earlier one
            seq = request.seq
            assert seq is not None
            if self._grow(request, 1, None, plan):
                plan.add(request, 1, seq.num_computed, prefill=False)
        return prefilling

    def _schedule_prefills(self, plan: StepPlan, prefilling: list[Request], now: float) -> None:
        """Prefill work by tenant: tier, then fair share, within the step's room."""
        # Per tenant: running prefills, then swapped-out sequences, each with the
        # state it was listed in (a victim of this step's evictions is skipped).
        own: dict[str, list[tuple[Request, RequestState]]] = {}
        for request in prefilling:
            own.setdefault(request.tenant, []).append((request, RequestState.RUNNING))
        for request in sorted(self.swapped.values(), key=lambda r: r.order_key):
            own.setdefault(request.tenant, []).append((request, RequestState.SWAPPED))
        blocked: set[str] = set()
        while not plan.full():
            head = self._next_prefill(own, blocked)
            if head is None:
                return
            request = head
            if request.state is RequestState.WAITING:
                outcome_ = self._admit(request, plan, now)
                if outcome_ is None:
                    return  # the step has no room left
                if not outcome_:
                    blocked.add(request.tenant)
                continue
            own[request.tenant].pop(0)
            if request.state is RequestState.SWAPPED:
                self._swap_in(request, plan)
            elif request.state is RequestState.RUNNING:
                seq = request.seq
                assert seq is not None
                n = plan.room(seq.num_computed, len(seq.tokens) - seq.num_computed)
                if n <= 0:
                    return
                granted = self._grow(request, n, None, plan)
                if granted:
                    plan.add(request, granted, seq.num_computed)

    def _next_prefill(
        self, own: dict[str, list[tuple[Request, RequestState]]], blocked: set[str]
    ) -> Request | None:
        """The head of the tenant to serve next: the most important tier first,
        then the smallest virtual counter (free mode: the oldest). ``blocked``
        tenants' queues wait for the next step; their running work does not."""
        best: Request | None = None
        best_key: tuple[int, float, str] | None = None
        free = self.kv.ledger.mode is BudgetMode.FREE
        counters = self.counters.counters
        for tenant in own.keys() | self.queues.keys():
            mine = own.get(tenant)
            while mine and mine[0][0].state is not mine[0][1]:
                mine.pop(0)  # preempted (or finished) since it was listed
            head = mine[0][0] if mine else None
            queue = self.queues.get(tenant) if tenant not in blocked else None
            if queue and (head is None or queue[0].tier < head.tier):
                head = queue[0]
            if head is None:
                continue
            key = (head.tier, head.arrival if free else counters.get(tenant, 0.0), tenant)
            if best_key is None or key < best_key:
                best, best_key = head, key
        return best

    def _admit(self, request: Request, plan: StepPlan, now: float) -> bool | None:
        """Start a waiting request (the head of its tenant's queue): True if it
        runs in this step, False if it must wait, None if the step has no room."""
        kv = self.kv
        if request.seq is None:
            request.seq = kv.add_sequence(
                next(self._seq_ids),
                request.tenant,
                request.prompt,
                tier=request.tier,
                cache_salt=request.cache_salt,
            )
            self._slot_info.start(
                request.seq.slot,
                kv.columns.capacity,
                request.stop_length,
                self._tenant_index[request.tenant],
            )
        seq = request.seq
        hit = kv.lookup(seq)
        n = plan.room(hit.num_tokens, len(seq.tokens) - hit.num_tokens)
        if n <= 0:
            return None
        granted = self._grow(request, n, hit, plan)
        if not granted:
            return False
        queue = self.queues[request.tenant]
        if queue[0] is request:
            queue.popleft()
        else:  # its own victims went back to the head of the queue, before it
            queue.remove(request)
        request.state = RequestState.RUNNING
        self._add_running(request)
        if request.started_at is None:
            request.started_at = now
            request.cached_tokens = hit.num_tokens
            request.queue_steps = self.steps - 1 - request.arrival_step
            self._queue.append(now - request.arrival)
            stats = self.tenant_stats[request.tenant]
            stats.prompt_tokens += len(request.prompt)
            stats.cached_tokens += hit.num_tokens
            self._count_prefix_hit(hit)
            self.start_log.append(
                (request.request_id, request.tenant, request.queue_steps, hit.num_tokens)
            )
        if not request.charged_input:
            self.counters.charge(request.tenant, input_tokens=len(request.prompt))
            request.charged_input = True
        plan.add(request, granted, seq.num_computed)
        return True

    def _swap_in(self, request: Request, plan: StepPlan) -> None:
        seq = request.seq
        assert seq is not None and request.host_pages is not None
        if len(plan.work) >= plan.max_seqs or not self.kv.can_swap_in(seq):
            return
        blocks, data = request.host_pages
        rows = {key: i for i, key in enumerate(blocks)}
        copies = self.kv.swap_in(seq)
        self.executor.copy_in(
            [c.page for c in copies], data[[rows[(c.group, c.block)] for c in copies]]
        )
        self.swap_space.give(request.tenant, len(blocks))
        if self.rates is not None:
            plan.add_copy(self.rates.swap_s(len(blocks)) / 2)
        request.host_pages = None
        request.state = RequestState.RUNNING
        del self.swapped[request.request_id]
        self._add_running(request)
        n = plan.room(seq.num_computed, len(seq.tokens) - seq.num_computed)
        if n > 0:
            granted = self._grow(request, n, None, plan)
            if granted:
                plan.add(request, granted, seq.num_computed)

    def _count_prefix_hit(self, hit: PrefixHit) -> None:
        name = hit.scope.public_prefix
        if name is None:
            return
        counts = self.prefix_hits.setdefault(name, [0, 0, 0])
        served = min(hit.num_tokens, hit.scope.public_blocks * self.kv.block_size)
        counts[0] += 1
        counts[1] += served > 0
        counts[2] += served

    def _grow(self, request: Request, n: int, hit: PrefixHit | None, plan: StepPlan) -> int:
        """Pages for up to ``n`` more tokens (after ``hit``, for a waiting
        request); returns how many it got (0: none, and it waits).

        The one way a sequence grows: in place when its last block has room;
        otherwise as much of ``n`` as the idle pages and the tenant's budget
        allow; only when not one block fits, by evicting per policy. A running
        sequence that cannot grow at all yields (is preempted), as in vLLM.
        """
        seq = request.seq
        assert seq is not None
        kv = self.kv
        if hit is None and kv.extend_in_place(seq, n):
            return n
        demand = kv.try_allocate(seq, n, hit)
        if demand is None:
            return n
        fit = self._most_that_fits(seq, n, hit)
        if fit:
            kv.allocate(seq, fit, hit)
            return fit
        evict = plan_eviction(kv, seq, demand, hit)
        if evict is None:
            if request.state is RequestState.RUNNING:
                self._preempt(request, plan)  # it cannot grow: it yields
            return 0
        for victim in evict.victims:
            self._preempt(self._by_seq(victim.seq_id), plan)
        if hit is not None and hit.epoch != kv.pool.evictions:
            return 0  # the victims' pages evicted what the hit was made of: next step
        n = self._most_that_fits(seq, n, hit, whole=True)
        if n:
            kv.allocate(seq, n, hit)
        return n

    def _most_that_fits(
        self, seq: Sequence, n: int, hit: PrefixHit | None, whole: bool = False
    ) -> int:
        """The most of ``n`` tokens (``whole``: all of them or none) that the idle
        pages and the tenant's budget allow now, without evicting anyone."""
        kv = self.kv
        if kv.can_allocate(seq, n, hit):
            return n
        if whole:
            return 0
        low, high = 0, n  # low fits (0 always does), high does not
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if kv.can_allocate(seq, mid, hit) else (low, mid)
        return low

    def _by_seq(self, seq_id: int) -> Request:
        for request in self.running.values():
            if request.seq is not None and request.seq.seq_id == seq_id:
                return request
        raise KeyError(seq_id)

    def preemption_kind(self, seq: Sequence) -> str:
        tenant = self.tenants.get(seq.tenant)
        return preemption_kind(
            self.config.preemption,
            self.rates,
            self.kv,
            seq,
            self.swap_space,
            tenant.swap_pages if tenant else None,
        )

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        seq = request.seq
        assert seq is not None
        plan.remove(request)
        kind = self.preemption_kind(seq)
        stats = self.tenant_stats[request.tenant]
        self._remove_running(request)
        request.preemptions += 1
        self.preemptions += 1
        self.preemption_log.append((request.request_id, request.tenant, kind))
        if kind == SWAP:
            copies = self.kv.begin_swap_out(seq)
            data = self.executor.copy_out([c.page for c in copies])
            self.kv.finish_swap_out(seq)
            self.swap_space.take(request.tenant, len(copies))
            request.host_pages = ([(c.group, c.block) for c in copies], data)
            request.state = RequestState.SWAPPED
            self.swapped[request.request_id] = request
            stats.preempted_swap += 1
            return
        self.kv.release(seq)  # recompute: tokens kept, pages dropped
        request.state = RequestState.WAITING
        self.queues[request.tenant].appendleft(request)
        stats.preempted_recompute += 1

    # -- results -------------------------------------------------------------------

    def _record_tokens(
        self,
        work: StepWork,
        seqs: list[Sequence],
        slots: np.ndarray[Any, Any],
        block: np.ndarray[Any, Any],
        tokens: np.ndarray[Any, Any],
        logprobs: np.ndarray[Any, Any],
        stopped: np.ndarray[Any, Any],
        events: list[StepEvent],
    ) -> None:
        """Turn one step's sampled tokens into events, as array operations over
        the batch (this runs for every running sequence every step). ``block``
        holds the sequences' columns from before the step."""
        now = self.clock()
        info = self._slot_info
        out = outcome(
            work.counts, slots, block, tokens, logprobs, stopped, self._is_stop, info.stop_length
        )
        requests = work.requests
        if out.keep is not None:
            keep = out.keep.tolist()
            requests = [requests[i] for i in keep]
            seqs = [seqs[i] for i in keep]
        if not requests:
            return
        slots, finished, by_stop = out.slots, out.finished, out.by_stop
        self._observe_latency(requests, slots, now)
        token_list = out.tokens.tolist()
        # A last token too: it is part of the output.
        self.kv.append_decoded(seqs, token_list, slots, out.length)
        reasons: list[str | None] = [None] * len(requests)
        ends = np.flatnonzero(finished).tolist()
        for i in ends:
            reasons[i] = "stop" if by_stop[i] else "length"
        events += map(
            StepEvent,
            [r.request_id for r in requests],
            token_list,
            out.logprobs.tolist(),
            finished.tolist(),
            reasons,
        )
        for i in ends:
            self._finish(requests[i], reasons[i])  # type: ignore[arg-type]
        served = np.bincount(info.tenant[slots])
        for index in np.flatnonzero(served).tolist():
            tenant, count = self.tenant_names[index], int(served[index])
            self.counters.charge(tenant, output_tokens=count)  # fair share, once per tenant
            self.tenant_stats[tenant].completion_tokens += count

    def _observe_latency(
        self, requests: list[Request], slots: np.ndarray[Any, Any], now: float
    ) -> None:
        """Time to first token and inter-token gaps, kept per sequence slot."""
        last_token_at = self._slot_info.last_token_at
        last = last_token_at[slots]
        first = np.isnan(last)
        if first.any():
            for i in np.flatnonzero(first).tolist():
                request = requests[i]
                request.first_token_at = now
                self._ttft.append(now - request.arrival)
            last = last[~first]
        self._itl += (now - last).tolist()
        last_token_at[slots] = now

    def _finish(self, request: Request, reason: str) -> None:
        seq = request.seq
        limiter = self.limiters.get(request.tenant)
        if limiter is not None:
            used = 0 if request.started_at is None else len(seq.tokens) if seq else 0
            limiter.refund(request.stop_length - used, self.clock())
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
                events.append(StepEvent(request.request_id, None, 0.0, True, "deadline"))

    # -- observability -----------------------------------------------------------

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
        )
