"""The scheduler's policy under random traffic and live admin changes, on the
simulated executor (no JAX): every step keeps the pool whole and every output
exact; reclaiming never pushes a tenant under its reservation; once the
configuration is sane again, everything finishes (no wedge). Faults kvd
recovers from come at random too: a running sequence whose inputs fail a step
(it alone ends, with "error"), and swap-out copies that fail (recomputed)."""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import kvd.sched.preemption as preemption_module
from kvd.kv.eviction import plan_eviction
from kvd.kv.ledger import BudgetError, BudgetMode
from kvd.kv.scope import SharingPolicy
from kvd.sched.costmodel import Rates
from kvd.sched.requests import Rejection, RequestPhase
from kvd.sched.sampling_params import SamplingParams
from kvd.sched.scheduler import Scheduler, SchedulerConfig, TenantConfig
from kvd.sched.simulated import expected_output
from tests.sched.simulated import STOP_IDS, Clock, make_executor
from tests.sched.test_faults import Faulty

TENANTS = ("a", "b", "c", "d")
TIERS = ("interactive", "batch")
DRAIN_STEPS = 3000


class CheckedScheduler(Scheduler):
    """Checks, at each preemption made to reclaim another tenant's surplus,
    that the victim's tenant keeps at least its reservation."""

    reclaiming_for: str | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        preempt = self.preemption.preempt

        def checked(request: Any, plan: Any, **options: Any) -> None:
            preempt(request, plan, **options)
            if self.reclaiming_for is not None and request.tenant != self.reclaiming_for:
                account = self.kv.registry.ledger.accounts[request.tenant]
                assert account.used >= account.reservation, (request.tenant, account)

        checked.reclaim_check = True  # type: ignore[attr-defined]
        self.preemption.preempt = checked  # type: ignore[method-assign]


class PolicyMachine(RuleBasedStateMachine):
    @initialize(
        preemption=st.sampled_from(["auto", "recompute", "swap"]),
        swap_cheap=st.booleans(),
        swap_pages=st.sampled_from([None, 0, 12, 40]),
        target_ms=st.sampled_from([None, 5.0, 50.0]),
        host_pages=st.sampled_from([0, 0, 16, 60]),
        overlap=st.booleans(),
    )
    def start(
        self,
        preemption: str,
        swap_cheap: bool,
        swap_pages: int | None,
        target_ms: float | None,
        host_pages: int,
        overlap: bool = False,
    ) -> None:
        self.executor = make_executor(pages=48)  # two long requests fill it
        self.faulty = Faulty(self.executor)
        self.host_pages = host_pages
        self.clock = Clock()
        # Rates in made-up seconds: either kind can be the cheaper one.
        rates = Rates(
            prefill_fixed_s=0.001,
            prefill_s_per_token=0.001,
            copy_fixed_s=0.0001 if swap_cheap else 0.05,
            copy_s_per_page=0.0001 if swap_cheap else 0.01,
            page_bytes=self.executor.layout.page_bytes,
            pages_per_token=0.25,
            attention_s_per_pair=1e-6,
            chunk_tokens=self.executor.limits.max_num_batched_tokens,
            token_buckets=self.executor.limits.token_buckets,
        )
        config = SchedulerConfig(
            tiers=TIERS,
            mode=BudgetMode.RESERVE,
            preemption=preemption,
            target_step_ms=target_ms,
            swap_pages=swap_pages,
            host_pages=host_pages,  # the host cache, shared with swap
            overlap=overlap,  # each step dispatched before the one before it is read
        )
        self.scheduler = CheckedScheduler(self.executor, config, rates=rates, clock=self.clock)
        self.capacity = self.scheduler.kv.registry.ledger.capacity
        for name in TENANTS[:2]:
            self.scheduler.set_tenant(TenantConfig(name, max_queue=8))
        self.serial = 0
        self.expected: dict[str, tuple[list[int], str]] = {}
        self.outputs: dict[str, list[int]] = {}
        self.done: dict[str, str] = {}
        self.steps = 0
        _current[0] = self.scheduler

    # -- traffic -----------------------------------------------------------------

    @rule(
        data=st.data(),
        length=st.integers(1, 40),
        max_tokens=st.integers(1, 24),
        shared_start=st.booleans(),
        sample=st.booleans(),
        salt=st.sampled_from([None, None, "s1"]),
        deadline=st.sampled_from([None, None, 0.5, 3.0]),
        burst=st.integers(1, 4),
        ends=st.sampled_from([None, None, "ignore_eos", "min_tokens"]),
    )
    def submit(
        self,
        data: st.DataObject,
        burst: int,
        length: int,
        max_tokens: int,
        shared_start: bool,
        sample: bool,
        salt: str | None,
        deadline: float | None,
        ends: str | None,
    ) -> None:
        for _ in range(burst):
            tenant = data.draw(st.sampled_from(sorted(self.scheduler.book.tenants)), "tenant")
            tier = data.draw(st.sampled_from([None, *TIERS]), "tier")
            self._submit(
                tenant, tier, length, max_tokens, shared_start, sample, salt, deadline, ends
            )

    def _submit(
        self,
        tenant: str,
        tier: str | None,
        length: int,
        max_tokens: int,
        shared_start: bool,
        sample: bool,
        salt: str | None,
        deadline: float | None,
        ends: str | None = None,
    ) -> None:
        self.serial += 1
        length = max(1, length - self.serial % 7)
        head = [5, 6, 7, 8, 9, 10, 11, 12] if shared_start else []
        prompt = (head + [(self.serial * 13 + i * 7) % 40 + 2 for i in range(length)])[:40]
        # "min_tokens": frequent stop ids (3 in 48 tokens), masked for the first
        # half, through preemptions (recomputed sequences count from their output).
        params = SamplingParams(
            temperature=0.7 if sample else 0.0,
            seed=self.serial,
            max_tokens=max_tokens,
            ignore_eos=ends == "ignore_eos",
            min_tokens=max_tokens // 2 if ends == "min_tokens" else 0,
            stop_token_ids=(2, 3, 4) if ends == "min_tokens" else (),
        )
        request_id = f"r{self.serial}"
        try:
            self.scheduler.submit(
                request_id, tenant, prompt, params, tier=tier, deadline_s=deadline, cache_salt=salt
            )
        except Rejection as exc:
            assert exc.status in (413, 429), exc
            return
        limits = self.executor.limits
        self.expected[request_id] = expected_output(prompt, params, limits, STOP_IDS)
        self.outputs[request_id] = []

    @rule(count=st.integers(1, 4))
    def step(self, count: int) -> None:
        for _ in range(count):
            self._one_step()

    def _one_step(self) -> None:
        scheduler = self.scheduler
        events = scheduler.step().events
        self.copy_fault_steps -= 1
        self.faulty.copies_fail = self.copy_fault_steps > 0
        self.steps += 1
        self.clock.now += 0.1
        for event in events:
            if event.token is not None:
                out = self.outputs[event.request_id]
                out.append(event.token)
                want = self.expected[event.request_id][0]
                assert out == want[: len(out)], (event.request_id, out, want)
            if event.finished:
                self.done[event.request_id] = event.finish_reason or ""
                if event.finish_reason == "error":
                    assert event.request_id == self.faulted, event
                    self.faulty.bad_seq = self.faulted = None
                if event.finish_reason in ("stop", "length"):
                    want_tokens, want_reason = self.expected[event.request_id]
                    assert self.outputs[event.request_id] == want_tokens
                    assert event.finish_reason == want_reason

    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        live = sorted(self.scheduler.book.requests)
        if live:
            request_id = data.draw(st.sampled_from(live), "request")
            assert self.scheduler.cancel(request_id)
            self.done[request_id] = "cancelled"
            if request_id == self.faulted:
                self.faulty.bad_seq = self.faulted = None

    faulted: str | None = None
    copy_fault_steps = 0

    @precondition(lambda self: self.faulted is None)
    @rule(data=st.data())
    def fault_a_sequence(self, data: st.DataObject) -> None:
        """The next step a running request is in fails on its own inputs."""
        running = sorted(self.scheduler.book.running)
        if running:
            self._fault(data.draw(st.sampled_from(running), "faulted"))

    def _fault(self, request_id: str) -> None:
        seq = self.scheduler.book.requests[request_id].seq
        assert seq is not None
        self.faulted = request_id
        self.faulty.bad_seq = seq.seq_id

    # Only without the host cache: a failed offload whose block a hit claims in
    # the same step fails the engine (the daemon restarts), by design.
    @precondition(lambda self: self.host_pages == 0)
    @rule(steps=st.integers(1, 12))
    def copies_fail(self, steps: int) -> None:
        """Every device-to-host copy of the next ``steps`` steps fails."""
        self.copy_fault_steps = steps
        self.faulty.copies_fail = True

    @rule(seconds=st.sampled_from([0.5, 2.0]))
    def time_passes(self, seconds: float) -> None:
        self.clock.now += seconds

    # -- admin changes -------------------------------------------------------------

    @rule(
        data=st.data(),
        reservation=st.integers(0, 40),
        cap=st.sampled_from([None, 20, 60]),
        weight=st.sampled_from([1.0, 2.0]),
        tier=st.sampled_from(TIERS),
        swap=st.sampled_from([None, 4, 30]),
        host_quota=st.sampled_from([None, None, 0, 6]),
    )
    def set_tenant(
        self,
        data: st.DataObject,
        reservation: int,
        cap: int | None,
        weight: float,
        tier: str,
        swap: int | None,
        host_quota: int | None,
    ) -> None:
        name = data.draw(st.sampled_from(TENANTS), "tenant")
        if cap is not None:
            cap = max(cap, reservation)
        config = TenantConfig(
            name,
            reservation_pages=reservation,
            cap_pages=cap,
            tier=tier,
            weight=weight,
            max_queue=8,
            swap_pages=swap,
            host_quota_pages=host_quota,
        )
        # Reservations the pool cannot hold are refused, changing nothing.
        with contextlib.suppress(BudgetError):
            self.scheduler.set_tenant(config)

    @rule(data=st.data())
    def remove_tenant(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.scheduler.book.tenants)), "tenant")
        if len(self.scheduler.book.tenants) < 2:
            return
        try:
            self.scheduler.remove_tenant(name)
        except ValueError:
            assert self.scheduler.live_requests(name)

    @rule(mode=st.sampled_from(BudgetMode))
    def set_mode(self, mode: BudgetMode) -> None:
        self.scheduler.kv.set_mode(mode)

    @rule(policy=st.sampled_from(SharingPolicy))
    def set_policy(self, policy: SharingPolicy) -> None:
        self.scheduler.kv.set_policy(policy)

    @rule()
    def flush(self) -> None:
        self.scheduler.flush_cache()
        assert (
            not self.scheduler.kv.registry.host.blocks and not self.scheduler.kv.registry.pool.lru
        )

    @precondition(lambda self: "head" not in self.scheduler.kv.registry.public)
    @rule()
    def add_prefix(self) -> None:
        with contextlib.suppress(ValueError):  # it would break the reservations
            self.scheduler.kv.add_public_prefix("head", [5, 6, 7, 8, 9, 10, 11, 12])

    @precondition(lambda self: "head" in self.scheduler.kv.registry.public)
    @rule()
    def remove_prefix(self) -> None:
        self.scheduler.kv.remove_public_prefix("head")

    # -- properties ------------------------------------------------------------------

    @invariant()
    def pool_is_whole(self) -> None:
        scheduler = self.scheduler
        kv = scheduler.kv
        kv.check_invariants()
        held = {p for r in scheduler.book.requests.values() if r.seq for p in r.seq.held_pages()}
        assert kv.registry.pool.num_referenced() == len(held)
        host = sum(len(r.host_pages[0]) for r in scheduler.book.swapped.values() if r.host_pages)
        assert scheduler.swap_space.held == host
        cache = kv.registry.host
        if cache.enabled:  # one host budget: swap first, the cache in what is left
            assert cache.swap_held == host and host + len(cache) <= cache.total
            scheduler.sync_host_cache()  # as the next step would: then the data is the cache's
            assert set(scheduler.host_copies.store) <= {b.row for b in cache.blocks.values()}
        elif scheduler.config.swap_pages is not None:
            assert host <= scheduler.config.swap_pages
        for request in scheduler.book.requests.values():
            assert request.phase is not RequestPhase.FINISHED

    def teardown(self) -> None:
        if not hasattr(self, "scheduler"):
            return
        scheduler = self.scheduler
        # A sane configuration again: no reservation, no cap, room to reserve.
        scheduler.kv.set_mode(BudgetMode.RESERVE)
        for name, tenant in list(scheduler.book.tenants.items()):
            scheduler.set_tenant(TenantConfig(name, tier=tenant.tier, max_queue=8))
        for _ in range(DRAIN_STEPS):
            if not scheduler.has_work():
                break
            self._one_step()
        assert not scheduler.has_work(), [
            (r.request_id, r.phase, r.tenant) for r in scheduler.book.requests.values()
        ]
        for request_id in self.expected:
            assert request_id in self.done, request_id
        scheduler.kv.check_invariants()
        assert scheduler.kv.registry.pool.num_referenced() == 0
        assert scheduler.swap_space.held == 0


def _watch_reclaims(kv: Any, requester: Any, demand: Any, hit: Any = None) -> Any:
    plan = plan_eviction(kv, requester, demand, hit)
    scheduler = _current[0]
    if scheduler is not None:
        reclaiming = plan is not None and plan.reason == "reclaim-surplus"
        scheduler.reclaiming_for = requester.tenant if reclaiming else None
    return plan


_current: list[Any] = [None]


def test_policy_fuzz(monkeypatch: Any) -> None:
    monkeypatch.setattr(preemption_module, "plan_eviction", _watch_reclaims)
    case = PolicyMachine.TestCase
    case.settings = settings(
        max_examples=200,
        stateful_step_count=100,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    case().runTest()


def test_the_reclaim_check_wraps_the_preemptions_the_scheduler_makes() -> None:
    """Growth preempts through ``scheduler.preemption.preempt``: the fuzz's
    check must be what that name holds, or it would never run."""
    scheduler = CheckedScheduler(make_executor(pages=48))
    assert getattr(scheduler.preemption.preempt, "reclaim_check", False)
    assert "self.preempt(" in inspect.getsource(type(scheduler.preemption).grow)


def test_a_sequence_swapped_out_in_the_step_that_reloaded_its_blocks() -> None:
    """Found by the fuzz (shrunk): a request whose prefix hit reloads host-cache
    blocks is preempted by swap in the same step, before the queued copy in
    ran; its swap copy must read the reloaded content, not the page's old one."""
    machine = PolicyMachine()
    machine.start(
        preemption="auto", swap_cheap=True, swap_pages=None, target_ms=None, host_pages=60
    )
    bursts: list[tuple[tuple[int, int, bool, str | None], list[tuple[str, str | None]]]] = [
        ((8, 22, True, None), [("a", "batch")]),
        ((10, 17, True, "s1"), [("b", "batch"), ("a", "batch"), ("b", None), ("a", "batch")]),
        ((8, 21, False, "s1"), [("b", None), ("a", "interactive"), ("b", None)]),
    ]
    for (length, max_tokens, sample, salt), requests in bursts:
        for tenant, tier in requests:
            machine._submit(tenant, tier, length, max_tokens, True, sample, salt, None)
        machine.pool_is_whole()
    machine.teardown()  # runs every request to the end, each output checked
    assert machine.scheduler.stats().preempted_swap > 0
    assert machine.scheduler.kv.host_hit_tokens > 0


def test_a_prefix_hit_made_stale_by_its_own_evictions_waits() -> None:
    """Found by the fuzz (shrunk): a victim evicted for a request with a prefix
    hit is swapped out, and makes room on the host by dropping 3 host-cache
    blocks. The scheduler checked the hit against the device's eviction count
    alone, which had not moved, while ``allocate`` checks both tiers and
    refused the hit as stale (in a daemon: an engine failure). The request
    must wait for the next step instead."""
    machine = PolicyMachine()
    machine.start(
        preemption="swap", swap_cheap=False, swap_pages=None, target_ms=None, host_pages=60
    )
    machine._submit("a", None, 1, 1, False, False, None, None)
    for tier in (None, None, None, "batch"):
        machine._submit("a", tier, 31, 22, False, False, None, None)
    machine.step(3)
    machine._fault("r2")
    for tenant in ("b", "a", "a"):
        machine._submit(tenant, None, 20, 18, False, False, None, None)
    machine._submit("a", None, 1, 1, False, False, None, None)
    machine.pool_is_whole()
    machine.teardown()
    assert machine.done["r2"] == "error"


def test_the_oracle_honours_ignore_eos_and_min_tokens() -> None:
    """The fuzz's expected outputs: no end token or stop id before min_tokens,
    and with ignore_eos the model's end token does not end the request."""
    limits = make_executor().limits
    prompts = [[(seed * 7 + i) % 40 + 2 for i in range(5)] for seed in range(40)]
    masked = SamplingParams(max_tokens=20, min_tokens=10, stop_token_ids=(2, 3, 4))
    ignoring = SamplingParams(max_tokens=30, ignore_eos=True)
    eos_seen = 0
    for prompt in prompts:
        out, reason = expected_output(prompt, masked, limits, STOP_IDS)
        assert len(out) >= 10 and not {1, 2, 3, 4} & set(out[:10])
        assert reason == ("stop" if out[-1] in {1, 2, 3, 4} else "length")
        out, reason = expected_output(prompt, ignoring, limits, STOP_IDS)
        assert (len(out), reason) == (30, "length")
        eos_seen += 1 in out
    assert eos_seen  # the end token came up, and did not end those requests
