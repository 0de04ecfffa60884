"""The scheduler on the real engine (a tiny random model): preemption that
cannot be seen in the output, isolation by reservation, fair share, rate limits."""

from __future__ import annotations

import pytest

from kvd.kv.ledger import BudgetMode
from kvd.sched.ratelimit import RateLimits
from kvd.sched.sampling_params import SamplingParams
from kvd.sched.scheduler import (
    Rejection,
    RequestPhase,
    Scheduler,
    SchedulerConfig,
    TenantConfig,
)
from kvd.sched.stepplan import StepPlan
from tests.sched.conftest import MakeEngine
from tests.sched.simulated import Clock, greedy


def prompt(seed: int, length: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 60 + 2 for i in range(length)]


def run_to_end(scheduler: Scheduler, limit: int = 500) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}
    for _ in range(limit):
        if not scheduler.has_work():
            break
        for event in scheduler.step().events:
            if event.token is not None:
                outputs.setdefault(event.request_id, []).append(event.token)
    assert not scheduler.has_work()
    scheduler.kv.check_invariants()
    assert scheduler.kv.registry.pool.num_referenced() == 0
    return outputs


def make_scheduler(engine, mode=BudgetMode.RESERVE, preemption="auto", **tenants):  # type: ignore[no-untyped-def]
    # A scheduler owns a KV manager of its own: each scenario starts cold.
    scheduler = Scheduler(
        engine, SchedulerConfig(mode=mode, preemption=preemption), clock=Clock(1000.0)
    )
    for name, config in (tenants or {"t": TenantConfig("t")}).items():
        scheduler.set_tenant(config if isinstance(config, TenantConfig) else TenantConfig(name))
    return scheduler


@pytest.fixture(scope="module")
def engine(make_engine: MakeEngine):  # type: ignore[no-untyped-def]
    return make_engine()


def reference(engine, prompt_ids: list[int], n: int, params=None) -> list[int]:  # type: ignore[no-untyped-def]
    scheduler = make_scheduler(engine)
    scheduler.submit("ref", "t", prompt_ids, params or greedy(n))
    return run_to_end(scheduler)["ref"]


# Penalties and min_tokens depend on where the prompt ends: a recomputed
# sequence starts with its output so far, which must still count as output.
PENALIZED = SamplingParams(
    temperature=0.0,
    max_tokens=20,
    min_tokens=12,
    presence_penalty=0.8,
    frequency_penalty=1.1,
    repetition_penalty=1.4,
)


@pytest.mark.parametrize("kind", ["recompute", "swap"])
@pytest.mark.parametrize("when", ["mid-decode", "mid-prefill"])
@pytest.mark.parametrize("sampling", ["greedy", "penalized"])
def test_preemption_is_invisible(engine, kind: str, when: str, sampling: str) -> None:  # type: ignore[no-untyped-def]
    ids = prompt(1, 70)  # longer than the step budget of 32: the prefill is chunked
    params = greedy(20) if sampling == "greedy" else PENALIZED
    expected = reference(engine, ids, 20, params)
    if sampling == "penalized":
        assert expected != reference(engine, ids, 20)  # the penalties change the output
    scheduler = make_scheduler(engine, preemption=kind)
    request = scheduler.submit("r", "t", ids, params)
    outputs: list[int] = []
    preempt_at = 1 if when == "mid-prefill" else 6
    for step in range(200):
        if not scheduler.has_work():
            break
        if step == preempt_at:
            assert request.phase is RequestPhase.RUNNING
            if when == "mid-prefill":
                assert request.seq is not None and request.seq.num_computed < len(ids)
            scheduler.preemption.preempt(request, StepPlan(32, 8))
            scheduler.kv.check_invariants()
            expected_state = RequestPhase.SWAPPED if kind == "swap" else RequestPhase.WAITING
            assert request.phase is expected_state
        outputs += [e.token for e in scheduler.step().events if e.token is not None]
    assert outputs == expected
    stats = scheduler.stats().tenants["t"]
    assert (stats.preempted_swap, stats.preempted_recompute) == (
        (1, 0) if kind == "swap" else (0, 1)
    )
    scheduler.kv.check_invariants()
    assert scheduler.kv.registry.pool.num_referenced() == 0


def test_rate_limit_refuses_with_a_correct_retry_after(engine) -> None:  # type: ignore[no-untyped-def]
    limited = TenantConfig("slow", limits=RateLimits(tokens_per_minute=100))
    scheduler = make_scheduler(engine, slow=limited, other=TenantConfig("other"))
    clock = scheduler.clock
    assert isinstance(clock, Clock)
    scheduler.submit("a", "slow", prompt(2, 20), greedy(40))  # 60 tokens of 100
    with pytest.raises(Rejection) as refused:
        scheduler.submit("b", "slow", prompt(3, 20), greedy(40))
    assert refused.value.status == 429
    # 40 tokens left; 20 more refill at 100/60 per second: 12 s.
    assert refused.value.retry_after == pytest.approx(12.0)
    scheduler.submit("c", "other", prompt(4, 20), greedy(40))  # others are unaffected
    clock.now += 11.9
    with pytest.raises(Rejection):
        scheduler.submit("b", "slow", prompt(3, 20), greedy(40))
    clock.now += 0.2
    scheduler.submit("b", "slow", prompt(3, 20), greedy(40))
    with pytest.raises(Rejection) as never:
        scheduler.submit("huge", "slow", prompt(5, 60), greedy(60))
    # Over the whole per-minute allowance: no wait would help, so not a 429.
    assert never.value.status == 400 and never.value.retry_after is None
    assert scheduler.stats().tenants["slow"].rate_limited == 2
    run_to_end(scheduler)


def test_tokens_per_minute_refunds_what_was_not_generated(engine) -> None:  # type: ignore[no-untyped-def]
    """Admission pays prompt + max_tokens; the end gives back what was not
    used, so a request cancelled in the queue costs nothing and one stopped
    early costs its prompt and what it generated."""
    limited = TenantConfig("slow", limits=RateLimits(tokens_per_minute=100))
    scheduler = make_scheduler(engine, slow=limited)
    bucket = scheduler.book.limiters["slow"].tokens
    assert bucket is not None
    scheduler.submit("a", "slow", prompt(2, 20), greedy(60))  # 80 of 100
    with pytest.raises(Rejection):
        scheduler.submit("b", "slow", prompt(3, 20), greedy(60))
    scheduler.cancel("a")  # never started: all 80 back
    assert bucket.level == pytest.approx(100)
    request = scheduler.submit("b", "slow", prompt(3, 20), greedy(60))
    while len(request.output) < 5:
        scheduler.step()
    used = 20 + len(request.output)
    scheduler.cancel("b")
    assert bucket.level == pytest.approx(100 - used)
    last = scheduler.submit("c", "slow", prompt(4, 20), greedy(60 - used))  # fits after the refund
    run_to_end(scheduler)
    assert bucket.level == pytest.approx(100 - used - 20 - len(last.output))


def test_a_tenant_with_live_requests_cannot_be_removed(engine) -> None:  # type: ignore[no-untyped-def]
    scheduler = make_scheduler(engine, a=TenantConfig("a"), b=TenantConfig("b"))
    scheduler.submit("queued", "a", prompt(1, 8), greedy(4))
    with pytest.raises(ValueError, match="1 live requests"):
        scheduler.remove_tenant("a")
    run_to_end(scheduler)
    scheduler.remove_tenant("a")
    assert "a" not in scheduler.book.tenants


def test_static_mode_refuses_by_the_reservation(engine) -> None:  # type: ignore[no-untyped-def]
    """In static mode a tenant's limit is its reservation, not its burst cap
    or the pool: a request beyond it is a 413 that says so, not a wait."""
    tenant = TenantConfig("s", reservation_pages=8, cap_pages=64)
    scheduler = make_scheduler(engine, mode=BudgetMode.STATIC, s=tenant)
    assert engine.layout.pages_for_tokens(40 + 80) > 8
    with pytest.raises(Rejection) as refused:
        scheduler.submit("big", "s", prompt(1, 40), greedy(80))
    assert refused.value.status == 413
    assert "your reservation (the budget is static) allows 8" in str(refused.value)


def test_admission_errors(engine) -> None:  # type: ignore[no-untyped-def]
    scheduler = make_scheduler(engine)
    cases = [
        (dict(request_id="x", tenant="nobody", prompt=[3]), 401),
        (dict(request_id="x", tenant="t", prompt=[]), 400),
        (dict(request_id="x", tenant="t", prompt=[999]), 400),
        (dict(request_id="x", tenant="t", prompt=[3] * 128), 413),
        (dict(request_id="x", tenant="t", prompt=[3], tier="gold"), 400),
    ]
    for kwargs, status in cases:
        with pytest.raises(Rejection) as refused:
            scheduler.submit(params=greedy(4), **kwargs)  # type: ignore[arg-type]
        assert refused.value.status == status, kwargs
    full = make_scheduler(engine, t=TenantConfig("t", max_queue=2))
    full.submit("a", "t", [3], greedy(2))
    full.submit("b", "t", [3], greedy(2))
    with pytest.raises(Rejection) as refused:
        full.submit("c", "t", [3], greedy(2))
    assert refused.value.status == 429 and refused.value.code == "queue_full"
    run_to_end(full)


def test_cancel_and_deadline_free_everything(engine) -> None:  # type: ignore[no-untyped-def]
    scheduler = make_scheduler(engine)
    scheduler.submit("a", "t", prompt(6, 40), greedy(50))  # fills the step's 32-token budget
    scheduler.submit("late", "t", prompt(7, 10), greedy(5), deadline_s=0.5)
    scheduler.step()
    assert scheduler.kv.registry.pool.num_referenced() > 0
    assert scheduler.book.requests["late"].started_at is None
    assert scheduler.cancel("a") and not scheduler.cancel("a")
    assert scheduler.kv.registry.pool.num_referenced() == 0  # cancelled: pages back at once
    scheduler.clock.now += 1.0  # type: ignore[attr-defined]
    events = scheduler.step().events
    assert [(e.request_id, e.finish_reason) for e in events] == [("late", "deadline")]
    run_to_end(scheduler)


def _isolation(engine, mode: BudgetMode) -> tuple[list[int], dict[str, list[int]], Scheduler]:  # type: ignore[no-untyped-def]
    """An abuser floods long requests; a reserved tenant sends short ones."""
    capacity = engine.num_pages - 1
    scheduler = make_scheduler(
        engine,
        mode=mode,
        abuser=TenantConfig("abuser", max_queue=100),  # same tier: only the budget isolates
        good=TenantConfig("good", reservation_pages=capacity // 3),
    )
    for i in range(12):
        scheduler.submit(f"abuse-{i}", "abuser", prompt(100 + i, 60), greedy(60))
    waits: list[int] = []
    outputs: dict[str, list[int]] = {}
    submitted: dict[str, int] = {}
    for step in range(400):
        if step % 6 == 3 and len(submitted) < 8:
            name = f"good-{len(submitted)}"
            scheduler.submit(name, "good", prompt(200 + len(submitted), 12), greedy(8))
            submitted[name] = step
        before = {r for r, q in scheduler.book.requests.items() if q.started_at is None}
        for event in scheduler.step().events:
            if event.token is not None:
                outputs.setdefault(event.request_id, []).append(event.token)
        for name in list(submitted):
            request = scheduler.book.requests.get(name)
            started = request is None or request.started_at is not None
            if name in before and started and name.startswith("good"):
                waits.append(step - submitted[name])
        if not scheduler.has_work() and len(submitted) == 8:
            break
    return waits, outputs, scheduler


def test_reservation_isolates_a_tenant_from_an_abuser(engine) -> None:  # type: ignore[no-untyped-def]
    waits, outputs, scheduler = _isolation(engine, BudgetMode.RESERVE)
    assert len(waits) == 8 and max(waits) <= 2, waits  # every short request starts at once
    for i in range(8):  # and computes what it computes alone
        assert outputs[f"good-{i}"] == reference(engine, prompt(200 + i, 12), 8)
    stats = scheduler.stats().tenants
    assert stats["good"].preempted_recompute + stats["good"].preempted_swap == 0
    assert stats["abuser"].preempted_recompute + stats["abuser"].preempted_swap > 0
    scheduler.kv.check_invariants()


def test_free_mode_starves_the_same_tenant(engine) -> None:  # type: ignore[no-untyped-def]
    """The contrast the seed predicts: first come, first served lets the abuser's
    running work hold the pool, and the short requests wait."""
    waits, _, scheduler = _isolation(engine, BudgetMode.FREE)
    assert max(waits, default=0) > 2, waits
    scheduler.kv.check_invariants()


@pytest.mark.parametrize("weights", [(1.0, 1.0), (2.0, 1.0)])
def test_fair_share_between_backlogged_tenants(  # type: ignore[no-untyped-def]
    make_engine: MakeEngine, weights: tuple[float, float]
) -> None:
    engine = make_engine(max_num_seqs=2)  # two at a time: the order decides who is served
    scheduler = make_scheduler(
        engine,
        a=TenantConfig("a", weight=weights[0], max_queue=100),
        b=TenantConfig("b", weight=weights[1], max_queue=100),
    )
    for i in range(40):
        scheduler.submit(f"a{i}", "a", prompt(300 + i, 8), greedy(8))
        scheduler.submit(f"b{i}", "b", prompt(400 + i, 8), greedy(8))
    for _ in range(150):  # both stay backlogged throughout
        scheduler.step()
    service = scheduler.stats().tenants
    ratio = service["a"].service / service["b"].service
    if weights == (1.0, 1.0):
        assert 0.5 <= ratio <= 2.0, ratio
    else:
        assert abs(ratio - 2.0) <= 0.4, ratio
    for request_id in list(scheduler.book.requests):
        scheduler.cancel(request_id)
    scheduler.kv.check_invariants()
    assert scheduler.kv.registry.pool.num_referenced() == 0


def test_bench_scheduler_prints_figures() -> None:
    """`kvd bench scheduler`'s command line, in this process: one size (each
    size warms an engine of its own), its figures as JSON."""
    import json

    from click.testing import CliRunner

    from kvd.cli import cli

    args = ["bench", "scheduler", "--running", "8", "--steps", "3", "--no-crossover", "--json"]
    out = CliRunner().invoke(cli, args, prog_name="kvd")
    assert out.exit_code == 0, out.output
    report = json.loads(out.stdout)
    assert [f["running"] for f in report["overhead"]] == [8]
    assert all(f["mean_ms"] > 0 and f["device_ms"] > 0 for f in report["overhead"])
    bad = CliRunner().invoke(cli, ["bench", "scheduler", "--running", "8,x"], prog_name="kvd")
    assert bad.exit_code == 2 and "--running" in bad.stderr
    missing = ["bench", "scheduler", "--running", "8", "--nano-vllm", "/nonexistent/nano-vllm"]
    no_anchor = CliRunner().invoke(cli, missing, prog_name="kvd")
    assert no_anchor.exit_code == 1 and "holds no nanovllm/engine/scheduler.py" in no_anchor.stderr


def test_a_request_that_can_never_fit_is_refused_at_once(engine) -> None:  # type: ignore[no-untyped-def]
    scheduler = make_scheduler(engine, small=TenantConfig("small", cap_pages=8))
    pages = engine.layout.pages_for_tokens(40 + 80)
    assert pages > 8
    with pytest.raises(Rejection) as refused:
        scheduler.submit("big", "small", prompt(1, 40), greedy(80))
    assert refused.value.status == 413 and "your burst cap allows 8" in str(refused.value)
    scheduler.submit("fits", "small", prompt(2, 4), greedy(1))
    run_to_end(scheduler)


def test_the_engine_tables_follow_the_kv_tables(make_engine: MakeEngine) -> None:
    """Decodes grow blocks and slide windows through logged edits; whatever the
    path, the engine's copy of every running sequence's tables is exact: global
    groups entry for entry, sliding groups' rings for every block still held."""
    engine = make_engine()
    ring_groups = [g for g, ring in enumerate(engine.rings) if ring < engine._rows.width]
    assert ring_groups, "the test engine's sliding tables should be rings"
    scheduler = Scheduler(engine)
    scheduler.set_tenant(TenantConfig("t", max_queue=16))
    params = SamplingParams(temperature=0.0, max_tokens=40)
    for i in range(6):
        scheduler.submit(f"r{i}", "t", list(range(3, 3 + 2 + 3 * i)), params)
    rows = engine._rows
    checked = 0
    while scheduler.has_work():
        scheduler.step()
        if engine._table_edits:
            rows.apply(engine._table_edits)
        for request in scheduler.book.running.values():
            seq = request.seq
            assert seq is not None
            if rows.stamps[seq.slot + 1] != seq.table_version:
                continue  # to be rewritten whole before its next step
            row = rows.tables[:, seq.slot + 1]
            for g, table in enumerate(seq.tables):
                if g in ring_groups:
                    ring = int(engine.rings[g])
                    live = range(max(seq.sliding_start, seq.num_blocks - ring), seq.num_blocks)
                    assert [row[g, b % ring] for b in live] == table[live.start :], seq
                else:
                    assert row[g, : seq.num_blocks].tolist() == table, seq
            checked += 1
    assert checked > 100
    scheduler.kv.check_invariants()


def test_a_host_cache_hit_yields_the_tokens_of_a_device_hit(engine) -> None:  # type: ignore[no-untyped-def]
    """On the real engine: a prefix evicted from the pool to the host cache and
    copied back gives the greedy tokens a recompute gives, and is counted as
    a host hit."""
    shared = prompt(21, 64)
    want = reference(engine, shared + [9], 12)
    scheduler = Scheduler(engine, SchedulerConfig(host_pages=256), clock=Clock(1000.0))
    scheduler.set_tenant(TenantConfig("t"))
    scheduler.submit("warm", "t", shared + [7], greedy(4))
    run_to_end(scheduler)
    for i in range(6):  # unrelated prompts take every page of the 256-token pool
        scheduler.submit(f"flood{i}", "t", prompt(300 + i, 90), greedy(2))
    run_to_end(scheduler)
    assert scheduler.kv.stats().host_offloads > 0
    before = scheduler.kv.stats()
    scheduler.submit("again", "t", shared + [9], greedy(12))
    got = run_to_end(scheduler)["again"]
    after = scheduler.kv.stats()
    assert after.host_hit_tokens - before.host_hit_tokens > 0
    assert got == want


def test_biases_and_min_tokens_reach_the_engines_step(engine) -> None:  # type: ignore[no-untyped-def]
    """On the real engine, in one batch: a +100 bias forces its token, a -100
    bias bans one, and min_tokens masks a stop id that greedy would pick first
    (and then allows it); a row without them is what it is alone."""
    scheduler = Scheduler(engine)
    scheduler.set_tenant(TenantConfig("t", max_queue=16))
    start = prompt(3, 9)
    scheduler.submit("plain", "t", start, greedy(8))
    first = run_to_end(scheduler)["plain"][0]
    requests = {
        "plain": greedy(8),
        "forced": SamplingParams(temperature=0.0, max_tokens=5, logit_bias=((7, 100.0),)),
        "banned": SamplingParams(temperature=0.0, max_tokens=8, logit_bias=((first, -100.0),)),
        "masked": SamplingParams(
            temperature=0.0, max_tokens=8, min_tokens=4, stop_token_ids=(first,)
        ),
        "unmasked": SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=(first,)),
    }
    for name, params in requests.items():
        scheduler.submit(name, "t", start, params)
    out = run_to_end(scheduler)
    assert out["plain"][0] == first
    assert out["forced"] == [7] * 5
    assert first not in out["banned"]
    assert out["unmasked"] == [first]  # the stop id ends it at once
    assert len(out["masked"]) >= 4 and first not in out["masked"][:4]
    assert out["masked"][-1] == first or len(out["masked"]) == 8


def test_top_logprobs_come_from_the_engines_step(engine) -> None:  # type: ignore[no-untyped-def]
    """Alternatives only for the request that asked, as many as it asked, the
    greedy token first with the logprob reported for it."""
    scheduler = Scheduler(engine)
    scheduler.set_tenant(TenantConfig("t", max_queue=16))
    scheduler.submit(
        "top",
        "t",
        prompt(4, 7),
        SamplingParams(temperature=0.0, max_tokens=6, logprobs=True, top_logprobs=5),
    )
    scheduler.submit(
        "plain", "t", prompt(5, 7), SamplingParams(temperature=0.0, max_tokens=6, logprobs=True)
    )
    seen = {"top": 0, "plain": 0}
    while scheduler.has_work():
        for event in scheduler.step().events:
            if event.token is None:
                continue
            seen[event.request_id] += 1
            if event.request_id == "plain":
                assert event.top is None
                continue
            assert event.top is not None and len(event.top) == 5
            assert event.top[0][0] == event.token
            assert abs(event.top[0][1] - event.logprob) < 1e-5
            values = [v for _, v in event.top]
            assert values == sorted(values, reverse=True) and values[0] <= 0
    assert seen == {"top": 6, "plain": 6}


def test_penalties_follow_each_sequences_own_output(engine) -> None:  # type: ignore[no-untyped-def]
    """On the real engine, batched with an unpenalized request: each greedy
    token of a presence- and frequency-penalized request is the best of the
    model's own top 20 (reported per token) after subtracting the penalties
    of its output so far, with prompt tokens not counted; the plain request
    is what it is alone."""
    start = prompt(6, 12)
    plain_alone = reference(engine, start, 16)
    scheduler = Scheduler(engine)
    scheduler.set_tenant(TenantConfig("t", max_queue=16))
    penalized = SamplingParams(
        temperature=0.0,
        max_tokens=16,
        logprobs=True,
        top_logprobs=20,
        presence_penalty=2.0,
        frequency_penalty=1.5,
    )
    scheduler.submit("plain", "t", start, greedy(16))
    scheduler.submit("penalized", "t", start, penalized)
    output: list[int] = []
    plain: list[int] = []
    decided = 0
    while scheduler.has_work():
        for event in scheduler.step().events:
            if event.token is None:
                continue
            if event.request_id == "plain":
                plain.append(event.token)
                continue
            assert event.top is not None
            counts = {t: output.count(t) for t in set(output)}
            scores = {
                token: logprob - 1.5 * counts.get(token, 0) - 2.0 * (token in counts)
                for token, logprob in event.top
            }
            best = max(scores, key=lambda token: scores[token])
            # Tokens outside the top 20 score at most the 20th's own logprob.
            if scores[best] >= event.top[-1][1]:
                assert event.token == best, (output, event.top)
                decided += 1
            output.append(event.token)
    assert plain == plain_alone
    assert decided >= 12
    # The model repeats one token (a margin of ~10 nats): the penalties move it on.
    assert len(set(output)) > len(set(plain_alone))
