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
from collections.abc import Callable
from typing import Any, NamedTuple

import msgspec
import numpy as np

from kvd.kv.ledger import BudgetMode, TenantBudget
from kvd.kv.manager import KVManager, StepColumns
from kvd.kv.records import PrefixHit
from kvd.kv.sequence import Sequence
from kvd.sched.admission import Admission
from kvd.sched.book import RequestBook
from kvd.sched.constraint import mask_words
from kvd.sched.costmodel import Rates, measure_rates
from kvd.sched.executor import Executor, PendingStep, SequenceFault, StepOutput
from kvd.sched.hostcopies import HostCopies
from kvd.sched.preemption import Preemption
from kvd.sched.requests import (
    ParamsOf,
    Rejection,
    Request,
    RequestPhase,
    SlotInfo,
    StepEvent,
    StepWork,
)
from kvd.sched.results import StepResult
from kvd.sched.settings import SchedulerConfig, TenantConfig
from kvd.sched.stats import SchedulerStats, TenantStats
from kvd.sched.stepplan import StepPlan
from kvd.sched.swapspace import SwapSpace
from kvd.sched.tokens import TokenRecorder, sampling_rows

__all__ = [
    "Rejection",
    "Request",
    "RequestPhase",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStats",
    "StepEvent",
    "StepWork",
    "TenantConfig",
    "TenantStats",
]


class Launched(NamedTuple):
    """A dispatched step whose sampled tokens are not recorded yet."""

    work: StepWork
    seqs: list[Sequence]
    slots: np.ndarray[Any, Any]
    before: StepColumns  # the sequences' columns before it
    pending: PendingStep
    constrained: bool  # some row follows a grammar
    ended: int  # the book's count of finished requests when it was dispatched


def _rows_of(work: StepWork, output: StepOutput, keep: list[int]) -> tuple[StepWork, StepOutput]:
    """The rows ``keep`` of a step's work and of its output."""
    kept = StepWork()
    for i in keep:
        kept.add(work.requests[i], work.counts[i])
    top_ids, top_logprobs, prompt = output.top_ids, output.top_logprobs, output.prompt
    return kept, StepOutput(
        output.tokens[keep],
        output.logprobs[keep],
        None if top_ids is None else top_ids[keep],
        None if top_logprobs is None else top_logprobs[keep],
        None if prompt is None else [prompt[i] for i in keep],
    )


_NO_SLOTS = np.zeros(0, np.int64)
_NOTHING_SCHEDULED: tuple[list[Request], list[Sequence], np.ndarray[Any, Any]] = ([], [], _NO_SLOTS)


class Scheduler:
    """Step building: decodes first, then prefill work by tier and fair share
    within the step's room. It owns the KV manager, binds the executor to
    it, and holds its parts: the request book (``book.py``: tenants, queues,
    live requests), admission (``admission.py``), growth and preemption
    (``preemption.py``), the host cache's copies (``hostcopies.py``) and
    token recording (``tokens.py``)."""

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
        self.limits = limits = executor.limits
        self.config = config = config or SchedulerConfig()
        if kv is None:
            kv = KVManager(executor.layout, executor.num_pages)
        kv.set_mode(config.mode)
        kv.set_policy(config.policy)
        self.kv = kv
        executor.bind(kv)
        self.clock = clock
        kv.enable_host_cache(config.host_pages)
        self.swap_space = SwapSpace(config.swap_pages, kv)
        self.book = book = RequestBook(kv, self.swap_space, clock)
        self.host_copies = HostCopies(kv, executor, book.log_copy_failure)
        self.admission = Admission(book, kv, config, limits)
        self.preemption = Preemption(book, kv, executor, config, self.host_copies, rates)
        is_stop = np.zeros(limits.vocab_size, np.bool_)  # by token id
        is_stop[sorted(executor.stop_ids)] = True
        self._slot_info = SlotInfo()
        self.tokens = TokenRecorder(book, kv, self._slot_info, is_stop)
        self.submit = self.admission.submit
        self.live_requests = book.live_requests
        self.sync_host_cache = self.host_copies.sync
        self.stalled = False
        self.last_step_predicted_s: float | None = None
        self._seq_ids = itertools.count(1)
        # The running order's version, sequences and slots (``_running_slots``).
        self._running: tuple[int, list[Sequence], np.ndarray[Any, Any]] | None = None
        # The running requests of this step and their KV slots, when computed while
        # scheduling (a step of only those decodes needs them again).
        self._decode_slots: tuple[list[Request], list[Sequence], np.ndarray[Any, Any]] = (
            _NOTHING_SCHEDULED
        )
        # Overlapped steps: the step dispatched and not read yet; by KV slot,
        # the row of that step whose sampled token a sequence holds as a
        # placeholder; the events of a step read early (``settle``).
        self._in_flight: Launched | None = None
        self._source_row = np.full(kv.slot_capacity, -1, np.int64)
        self._settled: list[StepEvent] = []
        # Per public prefix: [requests that started with it, of those served
        # from cache, prompt tokens served from cache].
        self.prefix_hits: dict[str, list[int]] = {}

    @property
    def rates(self) -> Rates | None:
        """The cost model's rates (None until measured or given)."""
        return self.preemption.rates

    @rates.setter
    def rates(self, rates: Rates | None) -> None:
        self.preemption.rates = rates

    @property
    def steps(self) -> int:
        return self.book.steps

    @property
    def preemptions(self) -> int:
        return self.book.preemptions

    def calibrate(self, repeats: int = 3) -> Rates:
        """Measure the executor's rates (on a scratch KV manager) and use them."""
        self.settle()
        try:
            self.rates = rates = measure_rates(self.executor, repeats)
        finally:
            self.executor.bind(self.kv)
        return rates

    def set_tenant(self, tenant: TenantConfig) -> None:
        if tenant.tier not in self.config.tiers:
            raise ValueError(
                f"unknown tier {tenant.tier!r} (tiers: {', '.join(self.config.tiers)})"
            )
        self.kv.set_tenant(tenant.name, TenantBudget(tenant.reservation_pages, tenant.cap_pages))
        self.kv.set_host_quota(tenant.name, tenant.host_quota_pages)
        self.sync_host_cache()  # a lowered quota's blocks are gone now, data included
        self.book.set_tenant(tenant)

    def remove_tenant(self, name: str) -> None:
        """Forget a tenant with no live request (refused otherwise)."""
        book = self.book
        if name not in book.tenants:
            raise ValueError(f"no tenant {name!r}")
        live = book.live_requests(name)
        if live:
            raise ValueError(f"tenant {name!r} has {live} live requests: drain them first")
        self.kv.remove_tenant(name)
        self.sync_host_cache()
        book.remove_tenant(name)

    def flush_cache(self) -> int:
        """Forget every cached block nobody uses, in the pool and the host
        cache (host data too)."""
        flushed = self.kv.flush_cache()
        self.sync_host_cache()
        return flushed

    def cancel(self, request_id: str, choice: int | None = None) -> bool:
        """Stop a request (all its choices, or the one ``choice``) now and free
        its pages; False if it is unknown or done."""
        first = self.book.requests.get(request_id) or self.book.choices.get(request_id)
        if first is None:
            return False
        group = [first, *first.other_choices]
        targets = group if choice is None else [r for r in group if r.choice == choice]
        live = [r for r in targets if r.phase is not RequestPhase.FINISHED]
        for request in live:
            self.book.finish(request, "cancelled")
        return bool(live)

    def has_work(self) -> bool:
        return bool(
            self.book.running
            or self.book.swapped
            or any(self.book.queues.values())
            or self._in_flight is not None
            or self._settled
        )

    def step(self) -> StepResult:
        """Plan a step and dispatch it; return the events of the step read
        now: this one (serial), or the one dispatched before it (overlapped,
        whose tokens the device computed while this one was planned), with
        the starts, preemptions and failures since the last step."""
        events, self._settled = self._settled, []
        now = self.clock()
        self.book.next_step()
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
        in_flight, self._in_flight = self._in_flight, None
        # Waiting work that nothing in this step could start, and nothing was
        # freed for: only a change (a cancel, an admin command) or time can help.
        self.stalled = (
            not work and in_flight is None and self.preemptions == preempted and not events
        )
        self.last_step_predicted_s = plan.predicted_s()
        scheduled, seqs, slots = self._decode_slots
        self._decode_slots = _NOTHING_SCHEDULED
        launched = None
        if work:
            if scheduled != work.requests:  # more or fewer than the running decodes
                seqs = [request.seq for request in work.requests]  # type: ignore[misc]
                slots = self.kv.slots_of(seqs)
            launched = self._launch(work, seqs, slots, bool(plan.prefill_tokens), events)
        if not self.config.overlap:
            if launched is not None:
                self._record(launched, events)
            return self.book.take_result(events)
        self._in_flight = launched
        if in_flight is not None:
            self._record(in_flight, events)
        return self.book.take_result(events)

    def settle(self) -> None:
        """Read the step in flight, if any (its events come with the next
        ``step()``): for what must see every sampled token recorded and the
        device quiet, such as admin changes and calibration."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            self._record(in_flight, self._settled)

    @property
    def in_flight(self) -> bool:
        """A dispatched step's tokens are not recorded yet."""
        return self._in_flight is not None

    def _launch(
        self,
        work: StepWork,
        seqs: list[Sequence],
        slots: np.ndarray[Any, Any],
        prefills: bool,
        events: list[StepEvent],
    ) -> Launched | None:
        """Dispatch ``work`` and commit its computed tokens; overlapped, its
        sampled tokens go in as placeholders. None: a sequence's own inputs
        failed, and nothing ran."""
        kv = self.kv
        requests, counts = work.requests, work.counts
        ended = self.book.ended  # none of them has ended yet
        before = kv.step_columns(slots)  # the step's column fields, gathered once
        self.sync_host_cache()
        masks = self._constraint_masks(requests, counts, before)
        sources = None
        if self.config.overlap and (before.pending > 0).any():
            sources = np.where(before.pending > 0, self._source_row[slots], -1)
        try:
            pending = self.executor.dispatch(
                seqs, counts, ParamsOf(requests), slots, before, masks, sources
            )
        except SequenceFault as fault:
            # Nothing ran: the others' pages stay allocated from their computed
            # tokens, so the next step plans them again as if this one never was.
            self._fail(requests[fault.index], fault.cause, events)
            return None
        if not prefills:  # decodes alone (commit_decodes checks that they are)
            kv.commit_decodes(seqs, slots, before)
        else:
            kv.commit_batch(seqs, counts, slots)
        if self.config.overlap:
            rows = np.flatnonzero(sampling_rows(counts, before))
            kv.append_pending([seqs[i] for i in rows], slots[rows], before.length[rows])
            if len(self._source_row) < kv.slot_capacity:
                grown = np.full(kv.slot_capacity, -1, np.int64)
                grown[: len(self._source_row)] = self._source_row
                self._source_row = grown
            self._source_row[slots[rows]] = rows
        return Launched(work, seqs, slots, before, pending, masks is not None, ended)

    def _record(self, launched: Launched, events: list[StepEvent]) -> None:
        """Read a dispatched step's tokens and turn them into events. A row
        whose request ended since it was dispatched (a stop found in the
        step before, a cancel) is dropped: its token comes after its end."""
        output = launched.pending.result()
        work, seqs, slots, before = launched.work, launched.seqs, launched.slots, launched.before
        finished = RequestPhase.FINISHED
        # Only a request that ended since the dispatch can be one of its own.
        ended = self.book.ended != launched.ended
        if ended and any(request.phase is finished for request in work.requests):
            keep = [i for i, r in enumerate(work.requests) if r.phase is not finished]
            work, output = _rows_of(work, output, keep)
            seqs = [seqs[i] for i in keep]
            slots, before = slots[keep], before.rows(keep)
        if work:
            self.tokens.record(
                work,
                seqs,
                slots,
                before,
                output,
                events,
                launched.constrained,
                pending=self.config.overlap,
            )

    def _constraint_masks(
        self, requests: list[Request], counts: list[int], before: StepColumns
    ) -> np.ndarray[Any, Any] | None:
        """The tokens each structured-output row may sample this step (a
        bitmask row per request; all ones for the others), or None when no
        row has a grammar. Only rows that sample are asked: a prefill chunk
        short of its prompt's end samples nothing it keeps."""
        if not self.book.constrained:
            return None
        constrained = [i for i, r in enumerate(requests) if r.constraint is not None]
        if not constrained:
            return None
        sampling = sampling_rows(counts, before)
        masks = np.full((len(requests), mask_words(self.limits.vocab_size)), -1, np.int32)
        for i in constrained:
            if sampling[i]:
                requests[i].constraint.fill_mask(masks[i])  # type: ignore[union-attr]
        return masks

    def _running_slots(
        self, version: int, order: list[Request]
    ) -> tuple[list[Sequence], np.ndarray[Any, Any]]:
        """The sequences of the running ``order`` and their slots, kept from
        the last step while the order is the same (``version``): a running
        request keeps its sequence and a sequence its slot, and in steady
        decode the order changes only when a request comes or goes."""
        kept = self._running
        if kept is None or kept[0] != version:
            seqs: list[Sequence] = [request.seq for request in order]  # type: ignore[misc]
            kept = self._running = (version, seqs, self.kv.slots_of(seqs))
        return list(kept[1]), kept[2].copy()

    def _schedule_decodes(self, plan: StepPlan) -> list[Request]:
        """Every running decode that fits the step, most important first; returns
        the running requests with a prefill chunk to compute, in running order."""
        running_order = self.book.running_order
        order = running_order.snapshot()
        if not order:
            return []
        kv = self.kv
        seqs, slots = self._running_slots(running_order.version, order)
        before = kv.step_columns(slots)
        if self._in_flight is not None:
            # A row whose newest token is still on the device waits for it when
            # that token may be its last (its length) or the step needs it on
            # the host (a grammar's mask, a penalty's history).
            info = self._slot_info
            hold = (before.pending > 0) & (
                info.waits[slots] | (before.length >= info.max_length[slots])
            )
            if hold.any():
                run = np.flatnonzero(~hold)
                order = [order[i] for i in run.tolist()]
                seqs = [seqs[i] for i in run.tolist()]
                slots, before = slots[run], before.rows(run)
                if not order:
                    return []
        if len(order) <= plan.max_seqs and len(order) <= plan.tokens_left:
            # Every running decode fits this step, so priority cannot decide who
            # waits: they are scheduled as one array operation (see
            # KVManager.extend_decodes for when those starting a new block
            # join them); decodes that need pages someone else may want follow
            # by priority, and may preempt by policy.
            self._decode_slots = (order, seqs, slots)  # step() reuses them
            left = kv.extend_decodes(seqs, slots, before)
            if not left:
                plan.add_decodes(order, int(before.computed.sum()))
                return []
            decode = before.length == before.computed + 1
            waiting = set(left)
            fast = [i for i in range(len(order)) if i not in waiting]
            plan.add_decodes([order[i] for i in fast], int(before.computed[fast].sum()))
            slow = [order[i] for i in left if decode[i]]
            prefilling = [order[i] for i in left if not decode[i]]
        else:
            decode = before.length == before.computed + 1
            slow = [r for r, d in zip(order, decode.tolist(), strict=True) if d]
            prefilling = [r for r, d in zip(order, decode.tolist(), strict=True) if not d]
        running = RequestPhase.RUNNING
        for request in slow:
            if plan.full():
                break
            if request.phase is not running:
                continue  # preempted while making room for an earlier one
            seq = request.seq
            assert seq is not None
            if self.preemption.grow(request, 1, None, plan):
                plan.add(request, 1, seq.num_computed, prefill=False)
        return prefilling

    def _schedule_prefills(self, plan: StepPlan, prefilling: list[Request], now: float) -> None:
        """Prefill work by tenant: tier, then fair share, within the step's room."""
        # Per tenant: running prefills, then swapped-out sequences, each with the
        # phase it was listed in (a victim of this step's evictions is skipped).
        own: dict[str, list[tuple[Request, RequestPhase]]] = {}
        for request in prefilling:
            own.setdefault(request.tenant, []).append((request, RequestPhase.RUNNING))
        for request in sorted(self.book.swapped.values(), key=lambda r: r.order_key):
            own.setdefault(request.tenant, []).append((request, RequestPhase.SWAPPED))
        blocked: set[str] = set()
        while not plan.full():
            head = self._next_prefill(own, blocked)
            if head is None:
                return
            request = head
            if request.phase is RequestPhase.WAITING:
                outcome_ = self._admit(request, plan, now)
                if outcome_ is None:
                    return  # the step has no room left
                if not outcome_:
                    blocked.add(request.tenant)
                continue
            own[request.tenant].pop(0)
            if request.seq is not None and request.seq.pending:
                continue  # swapped out with a token in flight: back once that is read
            if request.phase is RequestPhase.SWAPPED:
                self.preemption.swap_in(request, plan)
            elif request.phase is RequestPhase.RUNNING:
                seq = request.seq
                assert seq is not None
                n = plan.room(seq.num_computed, len(seq.tokens) - seq.num_computed)
                if n <= 0:
                    return
                granted = self.preemption.grow(request, n, None, plan)
                if granted:
                    plan.add(request, granted, seq.num_computed)

    def _next_prefill(
        self, own: dict[str, list[tuple[Request, RequestPhase]]], blocked: set[str]
    ) -> Request | None:
        """The head of the tenant to serve next: the most important tier first,
        then the smallest virtual counter (free mode: the oldest). ``blocked``
        tenants' queues wait for the next step; their running work does not."""
        best: Request | None = None
        best_key: tuple[int, float, int, str] | None = None
        free = self.kv.mode is BudgetMode.FREE
        counters = self.book.counters
        for tenant in own.keys() | self.book.queues.keys():
            mine = own.get(tenant)
            while mine and mine[0][0].phase is not mine[0][1]:
                mine.pop(0)  # preempted (or finished) since it was listed
            head = mine[0][0] if mine else None
            queue = self.book.queues.get(tenant) if tenant not in blocked else None
            if queue and (head is None or queue[0].tier < head.tier):
                head = queue[0]
            if head is None:
                continue
            order = (head.arrival, 0) if free else counters.key(tenant)
            key = (head.tier, *order, tenant)
            if best_key is None or key < best_key:
                best, best_key = head, key
        return best

    def _admit(self, request: Request, plan: StepPlan, now: float) -> bool | None:
        """Start a waiting request (the head of its tenant's queue): True if it
        runs in this step, False if it must wait, None if the step has no room."""
        kv = self.kv
        first = request.first_choice
        if first is not None and first.phase is not RequestPhase.FINISHED:
            computed = first.seq.num_computed if first.seq is not None else 0
            if computed < first.prompt_len:
                return False  # another choice starts from the first's computed prompt
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
                kv.slot_capacity,
                request.max_length,
                self.book.tenant_index[request.tenant],
                request.params.ignore_eos,
                request.params.stop_token_ids,
                waits=request.constraint is not None,
                reply_id=request.reply_id,
                choice=request.choice,
            )
        seq = request.seq
        if seq.pending:
            return False  # preempted with a token in flight: it restarts once that is read
        hit = kv.lookup(seq, use_cache=not request.scores_prompt)
        if hit.reloads and not self._reload_pays(hit, seq):
            hit = kv.lookup(seq, host=False)
        n = plan.room(hit.num_tokens, len(seq.tokens) - hit.num_tokens)
        if n <= 0:
            return None
        granted = self.preemption.grow(request, n, hit, plan)
        if not granted:
            return False
        self.book.start(request)
        if request.started_at is None:
            request.started_at = now
            request.cached_tokens = hit.num_tokens
            request.queue_steps = self.steps - 1 - request.arrival_step
            # A request's prompt counts once for all its choices.
            self.book.log_start(request, hit.num_tokens, prompt=first is None)
            if first is None:
                for other in request.other_choices:
                    other.deadline = None  # the request has started
                self._count_prefix_hit(hit)
        if not request.charged_input and first is None:
            self.book.counters.charge(request.tenant, input_tokens=len(request.prompt))
            request.charged_input = True
        if hit.reloads and self.rates is not None:
            plan.add_copy(self.rates.swap_s(len(hit.reloads)) / 2)
        plan.add(request, granted, seq.num_computed)
        return True

    def _reload_pays(self, hit: PrefixHit, seq: Sequence) -> bool:
        """Copying the hit's host-cache blocks back beats recomputing them
        (the cost model's copy and prefill rates; without rates, copy)."""
        rates = self.rates
        if rates is None:
            return True
        device = self.kv.lookup(seq, host=False).num_tokens
        copy_in_s = rates.swap_s(len(hit.reloads)) / 2
        return copy_in_s < rates.recompute_s(hit.num_tokens, device)

    def _count_prefix_hit(self, hit: PrefixHit) -> None:
        name = hit.scope.public_prefix
        if name is None:
            return
        counts = self.prefix_hits.setdefault(name, [0, 0, 0])
        served = min(hit.num_tokens, hit.scope.public_blocks * self.kv.block_size)
        counts[0] += 1
        counts[1] += served > 0
        counts[2] += served

    def _fail(self, request: Request, cause: BaseException, events: list[StepEvent]) -> None:
        """End ``request`` alone for a fault of its own (its pages go back)."""
        self.book.finish(request, "error")
        detail = f"{type(cause).__name__}: {cause}"
        self.book.log_fault(request, detail)
        events.append(
            StepEvent(request.reply_id, None, 0.0, True, "error", detail, choice=request.choice)
        )

    def _expire(self, now: float, events: list[StepEvent]) -> None:
        for queue in self.book.queues.values():
            # Only requests that never started: a preempted one re-queued is not late.
            expired = [
                r
                for r in queue
                if r.deadline is not None and r.deadline < now and r.started_at is None
            ]
            for request in expired:
                self.book.finish(request, "deadline")
                events.append(
                    StepEvent(request.reply_id, None, 0.0, True, "deadline", choice=request.choice)
                )

    def stats(self) -> SchedulerStats:
        kv = self.kv
        tenants: dict[str, TenantStats] = {}
        for name, base in self.book.tenant_stats.items():
            pages = kv.tenant(name)
            stats = msgspec.structs.replace(
                base,
                running=sum(1 for r in self.book.running.values() if r.tenant == name),
                waiting=len(self.book.queues[name]),
                swapped=sum(1 for r in self.book.swapped.values() if r.tenant == name),
                charged_pages=pages.charged_pages if pages else 0,
                reserved_pages=pages.reserved_pages if pages else 0,
                cap_pages=pages.cap_pages if pages else None,
                surplus_pages=pages.surplus_pages if pages else 0,
                host_swap_pages=self.swap_space.used.get(name, 0),
                host_cached_pages=pages.host_cached_pages if pages else 0,
                service=self.book.counters.service.get(name, 0.0),
            )
            tenants[name] = stats
        rates = self.rates
        return SchedulerStats(
            steps=self.steps,
            running=len(self.book.running),
            waiting=sum(len(q) for q in self.book.queues.values()),
            swapped=len(self.book.swapped),
            kv=kv.stats(),
            preempted_recompute=sum(t.preempted_recompute for t in tenants.values()),
            preempted_swap=sum(t.preempted_swap for t in tenants.values()),
            tenants=tenants,
            prefill_tokens_per_s=rates.prefill_tokens_per_s if rates else None,
            copy_bytes_per_s=rates.copy_bytes_per_s if rates else None,
            crossover_tokens=rates.crossover_tokens() if rates else None,
        )
