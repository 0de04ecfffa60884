"""The step loop: the one owner of the scheduler, and its narrow async face.

HTTP handlers never touch the scheduler. They queue commands (submit,
cancel) into an inbox; the step loop applies the inbox at each step
boundary, then runs ``Scheduler.step`` in its own thread (the event loop
keeps serving while the device computes) and hands each request's tokens to
its handler through a memory channel, which closes when the request ends
(its ticket then says how). So every change to scheduler state
happens between steps, on one task, and a cancel (a client that went away)
takes effect before the next step: its pages are released within one step.

When the engine fails (a step raises or outlives ``step_timeout``, an
invariant breaks), the device state is unknown and no later step can be
trusted: ``run`` returns with ``failure`` set, after ending every request in
flight (closed with ``engine_failed``) and every queued command with its
failure (a submit is refused, an admin call raises EngineFailed). From then
on nothing waits on a step loop that is gone. A fault of one request's
own (the scheduler's ``error`` events) ends that request alone.
"""

from __future__ import annotations

import functools
import math
import time
import uuid
from collections import deque
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import structlog
import trio

from kvd.sched.constraint import Constraint
from kvd.sched.results import StepResult
from kvd.sched.sampling_params import SamplingParams
from kvd.sched.scheduler import Rejection, Request, Scheduler, SchedulerStats, StepEvent
from kvd.sched.stopping import StopCondition
from kvd.server.stepthread import StepThread

log = structlog.get_logger("kvd")
T = TypeVar("T")

SNAPSHOT_INTERVAL_S = 0.2  # how stale /metrics may be while the engine is busy
IDLE_POLL_S = 0.25  # deadlines and snapshots still advance while idle
ENGINE_FAILED = "engine_failed"  # the finish reason of requests the engine's failure ended


def failed_message(cause: str | None) -> str:
    """What a client hears once the engine has failed (retry: it restarts)."""
    return f"the engine failed ({cause}); the server is restarting: retry"


class EngineFailed(RuntimeError):
    """The step loop has failed; the daemon is exiting."""


class StepTimeout(RuntimeError):
    """A step did not come back in time: the device hung or was lost."""


@dataclass(eq=False)
class Ticket:
    """One request's handle, held by its HTTP handler. Its tokens arrive on
    ``events``; the channel closes when the request ends, however it ends,
    and ``finish_reason`` (with ``detail``) then says how."""

    request_id: str
    tenant: str
    send: trio.MemorySendChannel[StepEvent]
    events: trio.MemoryReceiveChannel[StepEvent]
    arrival: float
    # When the step loop handed over its first and its latest token: the one
    # measure of TTFT and inter-token gaps (metrics, the request's log line).
    first_token_at: float | None = None
    last_token_at: float | None = None
    accepted: trio.Event = field(default_factory=trio.Event)
    rejection: Rejection | None = None
    request: Request | None = None
    finished: bool = False
    finish_reason: str | None = None  # None once closed: cancelled by its handler
    detail: str | None = None  # why it failed, for its client
    choices: int = 1  # n: the channel closes once every choice has ended
    ended: set[int] = field(default_factory=set)  # choices that have ended


@dataclass
class StepTotals:
    """Accumulated between engine.step log lines."""

    steps: int = 0
    tokens: int = 0
    busy_s: float = 0.0
    longest_s: float = 0.0  # the slowest step
    since: float = field(default_factory=time.monotonic)


class Runtime:
    def __init__(
        self,
        scheduler: Scheduler,
        *,
        step_log_interval: float = 10.0,
        max_in_flight: int = 4096,
        step_timeout: float = 20.0,
        step_in_thread: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.scheduler = scheduler
        # A device step runs in the step thread so the event loop keeps
        # serving; a simulated one (microseconds) may run inline, which lets
        # tests drive the whole runtime on trio's MockClock.
        self.step_in_thread = step_in_thread
        self.clock = clock
        self.max_in_flight = max_in_flight
        self.step_timeout = step_timeout
        self.failure: str | None = None  # why the engine failed, once it has
        self.copy_failures: dict[str, int] = {}  # device-to-host copies recovered from, by kind
        self.heartbeat = clock()  # the step loop's last sign of life
        self.step_log_interval = step_log_interval
        self.snapshot: SchedulerStats = scheduler.stats()
        self._snapshot_at = 0.0
        # Commands, each with what to do instead if the engine fails first, and
        # whether it needs the step in flight read first (admin changes).
        self._inbox: deque[tuple[Callable[[], object], Callable[[], object] | None, bool]] = deque()
        self._wake = trio.Event()
        self._live: dict[str, Ticket] = {}
        self._idle = trio.Event()
        self._idle.set()
        self._totals = StepTotals(since=clock())
        # Called per tenant and step with its (time to first token, inter-token) values.
        self.latency_sink: Callable[[str, list[float], list[float]], None] | None = None
        # Called after every step and command: what changed in the cache goes out (KV events).
        self.after_change: Callable[[], None] | None = None
        # The step's own thread: never queued behind other threads (tokenizing,
        # state file writes), whose wait would count against step_timeout.
        self._step_thread = StepThread()

    # -- the handlers' side ------------------------------------------------------

    @property
    def in_flight(self) -> int:
        return len(self._live)

    async def submit(
        self,
        tenant: str,
        prompt: list[int],
        params: SamplingParams,
        *,
        tier: str | None = None,
        cache_salt: str | None = None,
        deadline_s: float | None = None,
        request_id: str | None = None,
        arrival: float | None = None,
        n: int = 1,
        constraint: Constraint | None = None,
        stop: StopCondition | None = None,
    ) -> Ticket:
        """Queue a request (``n`` choices, whose events share its ticket);
        returns its ticket once admitted to a queue, or raises Rejection (the
        scheduler's, or 503 when failed or full)."""
        if self.failure is not None:
            raise self._failed_rejection()
        if len(self._live) >= self.max_in_flight:
            raise Rejection(
                503,
                "overloaded",
                f"the server has {len(self._live)} requests in flight, its limit",
                retry_after=2.0,
            )
        send, receive = trio.open_memory_channel[StepEvent](math.inf)
        ticket = Ticket(
            request_id or uuid.uuid4().hex,
            tenant,
            send,
            receive,
            arrival or self.clock(),
            choices=n,
        )
        self._live[ticket.request_id] = ticket
        self._idle = trio.Event() if self._idle.is_set() else self._idle

        def apply() -> None:
            if ticket.finished:  # cancelled or aborted before it reached the scheduler
                ticket.accepted.set()
                return
            try:
                ticket.request = self.scheduler.submit(
                    ticket.request_id,
                    tenant,
                    prompt,
                    params,
                    tier=tier,
                    cache_salt=cache_salt,
                    deadline_s=deadline_s,
                    n=n,
                    constraint=constraint,
                    stop=stop,
                )
            except Rejection as exc:
                ticket.rejection = exc
                self._end(ticket, None)
            ticket.accepted.set()

        def refuse() -> None:
            ticket.rejection = self._failed_rejection()
            self._end(ticket, None)
            ticket.accepted.set()

        self._post(apply, refuse)
        try:
            await ticket.accepted.wait()
        except BaseException:
            self.cancel(ticket)
            raise
        if ticket.rejection is not None:
            raise ticket.rejection
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """Stop a request (idempotent); its pages go back at the next step boundary."""
        if ticket.finished:
            return
        self._end(ticket, None)
        self._post(lambda: self.scheduler.cancel(ticket.request_id))

    def _failed_rejection(self) -> Rejection:
        return Rejection(503, ENGINE_FAILED, failed_message(self.failure), retry_after=5.0)

    async def wait_idle(self) -> None:
        """Until no request is in flight."""
        await self._idle.wait()

    def abort_all(self) -> int:
        """End every request now (the drain timeout passed); returns how many."""
        tickets = list(self._live.values())
        for ticket in tickets:
            self._end(ticket, "abort")
            self._post(functools.partial(self.scheduler.cancel, ticket.request_id))
            ticket.accepted.set()
        return len(tickets)

    async def call(self, fn: Callable[[], T], *, quiet: bool = True) -> T:
        """Run ``fn`` on the step loop at the next step boundary (admin
        changes: atomic with respect to steps); its exception is re-raised
        here. ``quiet``: after the step in flight, if any, is read (a change
        sees every sampled token recorded; a read of figures need not)."""
        done = trio.Event()
        outcome: list[Any] = []

        def apply() -> None:
            try:
                outcome.append((True, fn()))
            except Exception as exc:  # noqa: BLE001  # handed back to the caller
                outcome.append((False, exc))
            done.set()

        def refuse() -> None:
            outcome.append((False, EngineFailed(f"the engine failed: {self.failure}")))
            done.set()

        self._post(apply, refuse, quiet=quiet)
        await done.wait()
        ok, value = outcome[0]
        if not ok:
            raise value
        return value  # type: ignore[no-any-return]

    async def settle(self) -> None:
        """Until every command posted so far has been applied (after any step
        in progress), e.g. the cancels of an abort."""
        done = trio.Event()
        self._post(done.set, done.set)
        await done.wait()

    def _end(self, ticket: Ticket, reason: str | None, detail: str | None = None) -> None:
        """The request is over: its stream closes (its reader sees the end
        and ``finish_reason``), and it no longer counts as in flight."""
        if ticket.finished:
            return
        ticket.finished = True
        ticket.finish_reason, ticket.detail = reason, detail
        ticket.send.close()
        self._live.pop(ticket.request_id, None)
        if not self._live:
            self._idle.set()

    def _post(
        self,
        command: Callable[[], object],
        instead: Callable[[], object] | None = None,
        *,
        quiet: bool = False,
    ) -> None:
        """Queue ``command`` for the step loop; ``instead`` runs if the engine
        has failed (now, or before it got to the command); ``quiet``: the step
        in flight, if any, is read before it runs."""
        if self.failure is not None:
            if instead is not None:
                instead()
            return
        self._inbox.append((command, instead, quiet))
        self._wake.set()

    # -- the step loop ------------------------------------------------------------

    async def run(self) -> None:
        """Apply commands and run steps until cancelled; returns only if the
        engine failed (``failure`` says why)."""
        try:
            await self._serve()
        except Exception as exc:  # noqa: BLE001  # the engine's end: handled, then reported
            self._fail(exc)
        finally:
            self._step_thread.close()

    def _fail(self, exc: BaseException) -> None:
        self.failure = f"{type(exc).__name__}: {exc}"
        log.error("engine.failed", error=repr(exc), in_flight=len(self._live))
        while self._inbox:  # submits not yet taken are refused, calls raise
            _, instead, _ = self._inbox.popleft()
            if instead is not None:
                instead()
        for ticket in list(self._live.values()):
            self._end(ticket, ENGINE_FAILED, self.failure)
            ticket.accepted.set()

    async def _step(self, work: Callable[[], T]) -> T:
        """One scheduler call (a step, or reading the step in flight) in the
        step thread. Shielded: a shutdown waits for the step in progress (it
        owns the scheduler until it returns); only ``step_timeout`` gives up
        on it, and then the engine has failed."""
        if not self.step_in_thread:
            return work()
        # One scope, shielded from outside and cancelled by its own deadline.
        with trio.CancelScope(shield=True, deadline=trio.current_time() + self.step_timeout):
            return await self._step_thread.run(work)
        raise StepTimeout(
            f"a step did not finish within {self.step_timeout:g} s (the device hung or was lost)"
        )

    async def _serve(self) -> None:
        scheduler, clock = self.scheduler, self.clock
        while True:
            self.heartbeat = clock()
            self._wake = trio.Event()
            while self._inbox:
                if self._inbox[0][2] and scheduler.in_flight:
                    await self._step(scheduler.settle)
                self._inbox.popleft()[0]()
            if self.after_change is not None:
                self.after_change()
            if not scheduler.has_work():
                self._refresh(clock(), force=True)
                with trio.move_on_after(IDLE_POLL_S):
                    await self._wake.wait()
                continue
            started = clock()
            result = await self._step(scheduler.step)
            events = result.events
            now = clock()
            self._dispatch(events, now)
            self._log(result)
            if self.after_change is not None:
                self.after_change()
            if scheduler.stalled:
                # Requests wait for pages or budget that only a change (an
                # admin command, a cancel) or a deadline can bring: no spinning.
                self._refresh(now, force=True)
                with trio.move_on_after(IDLE_POLL_S):
                    await self._wake.wait()
                continue
            totals = self._totals
            totals.steps += 1
            totals.tokens += len(events)
            totals.busy_s += now - started
            totals.longest_s = max(totals.longest_s, now - started)
            self._refresh(now)
            # The streams this step fed run before the next step starts, so
            # their Python and the step's do not contend for the GIL.
            await trio.lowlevel.checkpoint()

    def _dispatch(self, events: list[StepEvent], now: float) -> None:
        live = self._live
        first: dict[str, list[float]] = {}
        gaps: dict[str, list[float]] = {}
        for event in events:
            ticket = live.get(event.request_id)
            if ticket is None or event.choice in ticket.ended:
                continue  # its client is gone, or the choice has ended
            if event.token is not None:
                ticket.send.send_nowait(event)
                last = ticket.last_token_at
                if last is None:
                    ticket.first_token_at = now
                    first.setdefault(ticket.tenant, []).append(now - ticket.arrival)
                else:
                    gaps.setdefault(ticket.tenant, []).append(now - last)
                ticket.last_token_at = now
            if event.finished:
                ticket.ended.add(event.choice)
                if event.token is None and len(ticket.ended) < ticket.choices:
                    # One choice failed or expired: the request fails as a whole.
                    self._post(functools.partial(self.scheduler.cancel, ticket.request_id))
                    self._end(ticket, event.finish_reason, event.detail)
                elif len(ticket.ended) == ticket.choices:
                    self._end(ticket, event.finish_reason, event.detail)
        sink = self.latency_sink
        if sink is not None:
            for tenant in first.keys() | gaps.keys():
                sink(tenant, first.get(tenant, []), gaps.get(tenant, []))

    def _log(self, result: StepResult) -> None:
        """Log what a step did besides its tokens, each kind under its event name."""
        for failed in result.failed:
            log.warning(
                "request.failed",
                request_id=failed.request_id,
                tenant=failed.tenant,
                error=failed.cause,
            )
        for copy in result.copy_failed:
            self.copy_failures[copy.kind] = self.copy_failures.get(copy.kind, 0) + 1
            log.warning(
                "kv.copy_failed",
                kind=copy.kind,
                error=copy.cause,
                recovery="recomputed later" if copy.kind == "swap_out" else "blocks dropped",
            )
        for started in result.started:
            log.info(
                "request.start",
                request_id=started.request_id,
                tenant=started.tenant,
                queue_steps=started.queue_steps,
                cached_tokens=started.cached_tokens,
            )
        for preempted in result.preempted:
            log.info(
                "kv.preempt",
                request_id=preempted.request_id,
                tenant=preempted.tenant,
                kind=preempted.kind,
            )

    def _refresh(self, now: float, force: bool = False) -> None:
        if force or now - self._snapshot_at >= SNAPSHOT_INTERVAL_S:
            self.snapshot = self.scheduler.stats()
            self._snapshot_at = now
        totals = self._totals
        if totals.steps and now - totals.since >= self.step_log_interval:
            stats = self.snapshot
            log.info(
                "engine.step",
                steps=totals.steps,
                tokens=totals.tokens,
                busy_s=round(totals.busy_s, 3),
                longest_step_s=round(totals.longest_s, 3),
                interval_s=round(now - totals.since, 3),
                running=stats.running,
                waiting=stats.waiting,
                swapped=stats.swapped,
                referenced_pages=stats.kv.referenced_pages,
                free_pages=stats.kv.free_pages,
                cached_pages=stats.kv.cached_pages,
            )
            self._totals = StepTotals(since=now)


async def waiting_batches(
    events: trio.MemoryReceiveChannel[StepEvent],
) -> AsyncGenerator[list[StepEvent]]:
    """The events of a channel, every one waiting when the reader wakes as
    one list: a reader slower than the engine catches up in one go. It ends
    when the channel has been closed (the request ended) and emptied."""
    while True:
        try:
            batch = [await events.receive()]
        except trio.EndOfChannel:
            return
        while True:
            try:
                batch.append(events.receive_nowait())
            except (trio.WouldBlock, trio.EndOfChannel):
                break
        yield batch
