"""Continuous batching with multi-tenant policy, one synchronous step at a time.

Each ``step()``:
1. expires waiting requests past their deadline;
2. schedules the running sequences, most important first (tier, then age):
   a decode token or the next prefill chunk each, within the step's token
   budget. A sequence that needs a page the pool cannot give gets one through
   the KV core's eviction plan (victims are recomputed or swapped, whichever
   the measured cost model says is cheaper), or is preempted itself;
3. swaps back in what fits;
4. admits waiting requests: tier first, then the backlogged tenant with the
   smallest virtual token counter, first come first served within a tenant
   (in ``free`` mode: first come, first served across tenants).
   A tenant under its reservation reclaims other tenants' surplus, so its
   request starts within the step;
5. runs the engine once and turns sampled tokens into events.

Finished and cancelled sequences give their pages back at once.
"""

from __future__ import annotations

import bisect
import enum
import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from kvd.engine.engine import Engine
from kvd.engine.sampling import SamplingParams
from kvd.kv.columns import COMPUTED, LENGTH
from kvd.kv.eviction import plan_eviction
from kvd.kv.ledger import BudgetMode, TenantBudget
from kvd.kv.manager import PrefixHit
from kvd.kv.scope import SharingPolicy
from kvd.kv.sequence import KVState, Sequence
from kvd.sched.costmodel import Rates
from kvd.sched.fairshare import VirtualCounters
from kvd.sched.ratelimit import RateLimited, RateLimits, TenantLimiter

_NO_SLOTS = np.zeros(0, np.int64)


class TenantConfig(msgspec.Struct, frozen=True):
    name: str
    reservation_pages: int = 0
    cap_pages: int | None = None
    tier: str = "interactive"
    weight: float = 1.0
    limits: RateLimits = RateLimits()
    max_queue: int = 64


class SchedulerConfig(msgspec.Struct, frozen=True):
    tiers: tuple[str, ...] = ("interactive", "batch")  # most important first
    mode: BudgetMode = BudgetMode.RESERVE
    policy: SharingPolicy = SharingPolicy.PUBLIC
    preemption: str = "auto"  # "auto" (cost model), "recompute" or "swap"


class Rejection(Exception):
    """A request refused at admission, with the HTTP status the API should use."""

    def __init__(self, status: int, code: str, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.retry_after = retry_after


class RequestState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


# Fields a decode step reads come first: a step touches every running request,
# and on a CPU whose caches the model call has just flushed, each cache line
# of each request costs a miss.
@dataclass(slots=True, eq=False, kw_only=True)  # eq=False: compared by identity
class Request:
    seq: Sequence | None = None
    state: RequestState = RequestState.WAITING
    request_id: str
    tenant: str
    stop_length: int  # prompt + max_tokens, or the context: the sequence ends at this length
    prompt_len: int
    params: SamplingParams
    prompt: list[int]
    tier: int
    arrival: float
    deadline: float | None
    cache_salt: str | None
    order_key: tuple[int, float, int]  # (tier, arrival, serial): the running order
    finish_reason: str | None = None
    host_pages: tuple[list[tuple[int, int]], np.ndarray[Any, Any]] | None = None
    first_token_at: float | None = None
    started_at: float | None = None
    charged_input: bool = False
    cached_tokens: int = 0
    preemptions: int = 0

    @property
    def output(self) -> list[int]:
        """The tokens generated so far (they follow the prompt in its sequence)."""
        return [] if self.seq is None else self.seq.tokens[self.prompt_len :]


class RunningOrder:
    """The running requests, most important first (tier, then age), kept
    sorted as requests come and go instead of sorted again every step."""

    def __init__(self) -> None:
        self._keys: list[tuple[int, float, int]] = []
        self._requests: list[Request] = []

    def add(self, request: Request) -> None:
        at = bisect.bisect_left(self._keys, request.order_key)
        self._keys.insert(at, request.order_key)
        self._requests.insert(at, request)

    def remove(self, request: Request) -> None:
        at = bisect.bisect_left(self._keys, request.order_key)
        if at < len(self._requests) and self._requests[at] is request:
            del self._keys[at]
            del self._requests[at]

    def snapshot(self) -> list[Request]:
        return list(self._requests)


class SlotInfo:
    """Per KV slot, what token handling needs of the request whose sequence holds
    it: a step reads these for all its sequences as arrays, not from 256
    request objects."""

    def __init__(self) -> None:
        self.last_token_at = np.full(0, np.nan)  # NaN: no token yet
        self.stop_length = np.zeros(0, np.int64)  # the sequence ends at this length
        self.tenant = np.zeros(0, np.int64)  # index into Scheduler.tenant_names

    def start(self, slot: int, capacity: int, stop_length: int, tenant: int) -> None:
        """A new sequence holds ``slot`` (of a KV manager with ``capacity`` slots)."""
        if len(self.stop_length) < capacity:
            self._grow(capacity)
        self.last_token_at[slot] = np.nan
        self.stop_length[slot] = stop_length
        self.tenant[slot] = tenant

    def _grow(self, capacity: int) -> None:
        old = len(self.stop_length)
        for name, fill in (("last_token_at", np.nan), ("stop_length", 0), ("tenant", 0)):
            column = getattr(self, name)
            grown = np.full(capacity, fill, column.dtype)
            grown[:old] = column
            setattr(self, name, grown)


class StepWork:
    """What one step computes: requests, and how many tokens of each, in order."""

    __slots__ = ("requests", "counts")

    def __init__(self) -> None:
        self.requests: list[Request] = []
        self.counts: list[int] = []

    def __len__(self) -> int:
        return len(self.requests)

    def add(self, request: Request, count: int) -> None:
        self.requests.append(request)
        self.counts.append(count)

    def add_decodes(self, requests: list[Request]) -> None:
        self.requests += requests
        self.counts += [1] * len(requests)

    def remove(self, request: Request) -> None:
        for i, scheduled in enumerate(self.requests):
            if scheduled is request:
                del self.requests[i]
                del self.counts[i]
                return


class ParamsOf:
    """The sampling parameters of ``requests``, read only where the engine needs
    them (a sequence's first step): a decode step does not touch 256 of them."""

    __slots__ = ("_requests",)

    def __init__(self, requests: list[Request]) -> None:
        self._requests = requests

    def __len__(self) -> int:
        return len(self._requests)

    def __getitem__(self, index: int) -> SamplingParams:
        return self._requests[index].params


class StepEvent(msgspec.Struct, frozen=True):
    request_id: str
    token: int | None  # None for an event without a token (rejection, cancel)
    logprob: float
    finished: bool
    finish_reason: str | None = None


class TenantStats(msgspec.Struct):
    running: int = 0
    waiting: int = 0
    swapped: int = 0
    pages_used: int = 0
    pages_reserved: int = 0
    pages_cap: int | None = None
    surplus_pages: int = 0
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
    ttft_s: list[float]  # since the last stats() call
    inter_token_s: list[float]
    queue_s: list[float]
    tenants: dict[str, TenantStats]
    prefill_tokens_per_s: float | None
    copy_bytes_per_s: float | None
    crossover_tokens: int | None


class Scheduler:
    def __init__(
        self,
        engine: Engine,
        config: SchedulerConfig | None = None,
        *,
        rates: Rates | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self.kv = engine.kv
        self.config = config or SchedulerConfig()
        self.kv.set_mode(self.config.mode)
        self.kv.set_policy(self.config.policy)
        self.rates = rates
        self.clock = clock
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
        self._seq_ids = itertools.count(1)
        self._ttft: list[float] = []
        self._itl: list[float] = []
        # The running requests of this step and their KV slots, when computed while
        # scheduling (a step of only those decodes needs them again).
        self._decode_slots: tuple[list[Request], np.ndarray[Any, Any]] = ([], _NO_SLOTS)
        self._slot_info = SlotInfo()
        self.tenant_names: list[str] = []  # SlotInfo.tenant indexes this
        self._tenant_index: dict[str, int] = {}
        self._is_stop = np.zeros(engine.model.config.vocab_size, np.bool_)  # by token id
        self._is_stop[sorted(engine.stop_ids)] = True
        self._queue: list[float] = []
        # Preemptions as they happen, (request id, tenant, kind), for the
        # daemon's logs; bounded, so a caller that never reads costs nothing.
        self.preemption_log: deque[tuple[str, str, str]] = deque(maxlen=4096)
        # Per public prefix: [requests that started with it, of those served
        # from cache, prompt tokens served from cache].
        self.prefix_hits: dict[str, list[int]] = {}

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
        if not prompt:
            raise Rejection(400, "empty_prompt", "the prompt is empty")
        vocab = self.engine.model.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise Rejection(400, "bad_token", "the prompt holds token ids outside the vocabulary")
        limit = self.engine.config.max_model_len
        if len(prompt) >= limit:
            raise Rejection(
                413,
                "prompt_too_long",
                f"the prompt has {len(prompt)} tokens; the context is {limit} tokens",
            )
        pages = self.kv.layout.pages_for_tokens(
            len(prompt) + min(params.max_tokens, limit - len(prompt))
        )
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
        budget_tokens = len(prompt) + min(params.max_tokens, limit - len(prompt))
        try:
            self.limiters[tenant].admit(budget_tokens, now)
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
            stop_length=len(prompt) + min(params.max_tokens, limit - len(prompt)),
            prompt_len=len(prompt),
            params=params,
            prompt=list(prompt),
            tier=tier_index,
            arrival=now,
            deadline=None if deadline_s is None else now + deadline_s,
            cache_salt=cache_salt,
            order_key=(tier_index, now, next(self._serials)),
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
        work = StepWork()
        budget = self.engine.config.max_num_batched_tokens
        preempted = self.preemptions
        budget = self._schedule_running(work, budget)
        budget = self._swap_in(work, budget)
        self._admit(work, budget, now)
        # Waiting work that nothing in this step could start, and nothing was
        # freed for: only a change (a cancel, an admin command) or time can help.
        self.stalled = not work and self.preemptions == preempted and not events
        if not work:
            return events
        requests = work.requests
        seqs: list[Sequence] = [request.seq for request in requests]  # type: ignore[misc]
        scheduled, slots = self._decode_slots
        if scheduled != requests:  # more or fewer than the running decodes
            slots = self.kv.slots_of(seqs)
        self._decode_slots = ([], _NO_SLOTS)
        block = self.kv.columns.matrix[:, slots]  # the step's counters, gathered once
        tokens, logprobs, stopped = self.engine.run(
            seqs, work.counts, ParamsOf(requests), slots, block
        )
        self._record_tokens(work, seqs, slots, block, tokens, logprobs, stopped, events)
        return events

    def _add_running(self, request: Request) -> None:
        self.running[request.request_id] = request
        self._running_order.add(request)

    def _remove_running(self, request: Request) -> None:
        del self.running[request.request_id]
        self._running_order.remove(request)

    def _order(self, requests: list[Request]) -> list[Request]:
        return sorted(requests, key=lambda r: (r.tier, r.arrival))

    def _schedule_running(self, work: StepWork, budget: int) -> int:
        max_seqs = self.engine.config.max_num_seqs
        order = self._running_order.snapshot()
        if len(order) <= max_seqs and len(order) <= budget:
            # Every running request fits this step, so priority cannot decide who
            # waits: the decodes are scheduled as one array operation, first
            # (see KVManager.extend_decodes for when those starting a new block
            # join them); the rest (prefill chunks, decodes that need pages
            # someone else may want) follow by priority with the budget left,
            # and may preempt by policy.
            seqs: list[Sequence] = [request.seq for request in order]  # type: ignore[misc]
            self._decode_slots = (order, self.kv.slots_of(seqs))  # step() reuses them
            slow = self.kv.extend_decodes(seqs, self._decode_slots[1])
            fast = order
            if slow:
                needs_work = set(slow)
                fast = [r for i, r in enumerate(order) if i not in needs_work]
                order = [order[i] for i in slow]
            else:
                order = []
            work.add_decodes(fast)
            budget -= len(fast)
        extend_in_place = self.kv.extend_in_place
        running = RequestState.RUNNING
        for request in order:
            if budget <= 0 or len(work) >= max_seqs:
                break
            if request.state is not running:
                continue  # preempted while making room for an earlier one
            seq = request.seq
            assert seq is not None
            n = min(len(seq.tokens) - seq.num_computed, budget)
            if extend_in_place(seq, n) or self._ensure_pages(request, n, None, work):
                work.add(request, n)
                budget -= n
        return budget

    def _swap_in(self, work: StepWork, budget: int) -> int:
        for request in self._order(list(self.swapped.values())):
            seq = request.seq
            if budget <= 0 or len(work) >= self.engine.config.max_num_seqs or seq is None:
                break
            if not self.kv.can_swap_in(seq):
                continue
            assert request.host_pages is not None
            blocks, data = request.host_pages
            rows = {key: i for i, key in enumerate(blocks)}
            copies = self.kv.swap_in(seq)
            self.engine.copy_in(
                [c.page for c in copies], data[[rows[(c.group, c.block)] for c in copies]]
            )
            request.host_pages = None
            request.state = RequestState.RUNNING
            del self.swapped[request.request_id]
            self._add_running(request)
            n = min(len(seq.tokens) - seq.num_computed, budget)
            if self._ensure_pages(request, n, None, work):
                work.add(request, n)
                budget -= n
        return budget

    def _next_waiting(self, blocked: set[str]) -> Request | None:
        candidates = [
            (queue[0].tier, tenant)
            for tenant, queue in self.queues.items()
            if queue and tenant not in blocked
        ]
        if not candidates:
            return None
        best_tier = min(tier for tier, _ in candidates)
        tenants = [t for tier, t in candidates if tier == best_tier]
        if self.kv.ledger.mode is BudgetMode.FREE:
            # Free-for-all: first come, first served across tenants, no fair share.
            return min((self.queues[t][0] for t in tenants), key=lambda r: r.arrival)
        return self.queues[self.counters.order(tenants)[0]][0]

    def _admit(self, work: StepWork, budget: int, now: float) -> None:
        blocked: set[str] = set()
        while budget > 0 and len(work) < self.engine.config.max_num_seqs:
            request = self._next_waiting(blocked)
            if request is None:
                return
            if request.seq is None:
                request.seq = self.kv.add_sequence(
                    next(self._seq_ids),
                    request.tenant,
                    request.prompt,
                    tier=request.tier,
                    cache_salt=request.cache_salt,
                )
                self._slot_info.start(
                    request.seq.slot,
                    self.kv.columns.capacity,
                    request.stop_length,
                    self._tenant_index[request.tenant],
                )
            seq = request.seq
            hit = self.kv.lookup(seq)
            n = min(len(seq.tokens) - hit.num_tokens, budget)
            if not self._ensure_pages(request, n, hit, work):
                blocked.add(request.tenant)
                continue
            self.queues[request.tenant].popleft()
            request.state = RequestState.RUNNING
            self._add_running(request)
            if request.started_at is None:
                request.started_at = now
                request.cached_tokens = hit.num_tokens
                self._queue.append(now - request.arrival)
                stats = self.tenant_stats[request.tenant]
                stats.prompt_tokens += len(request.prompt)
                stats.cached_tokens += hit.num_tokens
                self._count_prefix_hit(hit)
            if not request.charged_input:
                self.counters.charge(request.tenant, input_tokens=len(request.prompt))
                request.charged_input = True
            work.add(request, n)
            budget -= n

    def _count_prefix_hit(self, hit: PrefixHit) -> None:
        name = hit.scope.public_prefix
        if name is None:
            return
        counts = self.prefix_hits.setdefault(name, [0, 0, 0])
        served = min(hit.num_tokens, hit.scope.public_blocks * self.kv.block_size)
        counts[0] += 1
        counts[1] += served > 0
        counts[2] += served

    def _ensure_pages(
        self, request: Request, n: int, hit: PrefixHit | None, work: StepWork
    ) -> bool:
        """Allocate pages for ``n`` more tokens, preempting by policy if needed."""
        seq = request.seq
        assert seq is not None
        kv = self.kv
        if hit is None and kv.extend_in_place(seq, n):
            return True
        demand = kv.try_allocate(seq, n, hit)
        if demand is None:
            return True
        plan = plan_eviction(kv, seq, demand, hit)
        if plan is None:
            if request.state is RequestState.RUNNING:
                self._preempt(request, work)  # it cannot grow: it yields, as vLLM does
            return False
        for victim in plan.victims:
            self._preempt(self._by_seq(victim.seq_id), work)
        if hit is not None and hit.epoch != kv.pool.evictions:
            return False
        if not kv.can_allocate(seq, n, hit):
            return False
        kv.allocate(seq, n, hit)
        return True

    def _by_seq(self, seq_id: int) -> Request:
        for request in self.running.values():
            if request.seq is not None and request.seq.seq_id == seq_id:
                return request
        raise KeyError(seq_id)

    def preemption_kind(self, seq: Sequence) -> str:
        if self.config.preemption != "auto" or self.rates is None:
            return "swap" if self.config.preemption == "swap" else "recompute"
        pages = len(seq.held_pages())
        recompute = self.rates.recompute_s(seq.num_computed)
        return "swap" if self.rates.swap_s(pages) < recompute else "recompute"

    def _preempt(self, request: Request, work: StepWork) -> None:
        seq = request.seq
        assert seq is not None
        work.remove(request)
        kind = self.preemption_kind(seq)
        stats = self.tenant_stats[request.tenant]
        self._remove_running(request)
        request.preemptions += 1
        self.preemptions += 1
        if seq.num_computed == 0:
            kind = "recompute"  # nothing computed yet: nothing to swap
        self.preemption_log.append((request.request_id, request.tenant, kind))
        if kind == "swap":
            copies = self.kv.begin_swap_out(seq)
            data = self.engine.copy_out([c.page for c in copies])
            self.kv.finish_swap_out(seq)
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
        requests = work.requests
        length = block[LENGTH]
        sampled = block[COMPUTED] + np.asarray(work.counts) == length  # not a prefill chunk
        if not sampled.all():
            keep = np.flatnonzero(sampled)
            requests = [requests[i] for i in keep.tolist()]
            seqs = [seqs[i] for i in keep.tolist()]
            slots, length = slots[keep], length[keep]
            tokens, logprobs, stopped = tokens[keep], logprobs[keep], stopped[keep]
        if not requests:
            return
        info = self._slot_info
        by_stop = stopped | self._is_stop[tokens]
        finished = by_stop | (length >= info.stop_length[slots] - 1)  # with this token
        self._observe_latency(requests, slots, now)
        token_list = tokens.tolist()
        # A last token too: it is part of the output.
        self.kv.append_decoded(seqs, token_list, slots, length)
        reasons: list[str | None] = [None] * len(requests)
        ends = np.flatnonzero(finished).tolist()
        for i in ends:
            reasons[i] = "stop" if by_stop[i] else "length"
        events += map(
            StepEvent,
            [r.request_id for r in requests],
            token_list,
            logprobs.tolist(),
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
