"""n > 1 on the simulated executor: a request's choices are sequences that
share its prompt's full blocks (prefilled by the first choice, found by the
others in the prefix cache), each charged only for its own pages, counted
as one request by the tenant's queue, rate limits and cancel."""

from __future__ import annotations

from collections import defaultdict

import msgspec
import pytest

from kvd.kv.ledger import BudgetMode
from kvd.sched.ratelimit import RateLimits
from kvd.sched.requests import Rejection, Request, RequestPhase
from kvd.sched.sampling_params import SamplingParams
from kvd.sched.scheduler import Scheduler, SchedulerConfig, TenantConfig
from kvd.sched.simulated import expected_output
from tests.sched.simulated import LIMITS, STOP_IDS, Clock, greedy, make_executor


def prompt(seed: int, length: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 44 + 2 for i in range(length)]


def make(pages: int = 90, **tenant: object) -> Scheduler:
    scheduler = Scheduler(make_executor(pages), SchedulerConfig(), clock=Clock(100.0))
    scheduler.set_tenant(TenantConfig("t", **tenant))  # type: ignore[arg-type]
    return scheduler


def run(
    scheduler: Scheduler, watch: list[Request] | None = None, limit: int = 500
) -> dict[tuple[str, int], list[int]]:
    """Steps to the end; (request id, choice) -> tokens. With ``watch`` (a
    request's choices), checks at every step that the started ones hold the
    first choice's full prompt blocks (the same pages) in every table."""
    outputs: dict[tuple[str, int], list[int]] = defaultdict(list)
    shared_seen = False
    for _ in range(limit):
        if not scheduler.has_work():
            break
        for event in scheduler.step().events:
            if event.token is not None:
                outputs[event.request_id, event.choice].append(event.token)
        scheduler.kv.check_invariants()
        if watch:
            shared_seen |= _shares_prompt_blocks(scheduler, watch)
    assert not scheduler.has_work(), "wedged"
    assert scheduler.kv.registry.pool.num_referenced() == 0
    if watch:
        assert shared_seen, "the choices never held the prompt's blocks together"
    return dict(outputs)


def _shares_prompt_blocks(scheduler: Scheduler, choices: list[Request]) -> bool:
    """Whether every choice holds the prompt's full blocks of the global
    group as the same pages, each referenced once per choice (and charged once)."""
    live = [r for r in choices if r.phase is RequestPhase.RUNNING and r.seq is not None]
    if len(live) < len(choices):
        return False
    kv = scheduler.kv
    full = choices[0].prompt_len // kv.block_size
    group = next(g for g, spec in enumerate(kv.layout.groups) if spec.window is None)
    tables = [r.seq.tables[group][:full] for r in live]  # type: ignore[union-attr]
    if any(len(t) < full for t in tables):
        return False
    assert all(t == tables[0] for t in tables), tables
    for page in tables[0]:
        assert kv.registry.pool.ref[page] == len(choices)
    return True


def test_n_greedy_choices_equal_n_1_and_share_the_prompt() -> None:
    ids = prompt(1, 30)
    want, _ = expected_output(ids, greedy(10), LIMITS, STOP_IDS)
    scheduler = make()
    first = scheduler.submit("r", "t", ids, greedy(10), n=4)
    choices = [first, *first.other_choices]
    assert [c.choice for c in choices] == [0, 1, 2, 3]
    out = run(scheduler, watch=choices)
    assert out == {("r", i): want for i in range(4)}
    stats = scheduler.stats().tenants["t"]
    assert stats.prompt_tokens == len(ids)  # the prompt counted once
    assert stats.completion_tokens == 4 * len(want)
    # Every choice after the first found the prompt's full blocks cached.
    full = len(ids) // scheduler.kv.block_size * scheduler.kv.block_size
    assert [c.cached_tokens for c in choices] == [0, full, full, full]


def test_seeded_choices_sample_with_seed_plus_their_index() -> None:
    ids = prompt(2, 20)
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=8)
    want = [
        expected_output(ids, msgspec.structs.replace(params, seed=7 + i), LIMITS, STOP_IDS)[0]
        for i in range(3)
    ]
    assert len({tuple(w) for w in want}) == 3
    for _ in range(2):  # reproducible
        scheduler = make()
        scheduler.submit("r", "t", ids, params, n=3)
        assert run(scheduler) == {("r", i): want[i] for i in range(3)}


def test_cancel_ends_all_choices_or_one() -> None:
    scheduler = make()
    first = scheduler.submit("r", "t", prompt(3, 24), greedy(20), n=3)
    for _ in range(8):
        scheduler.step()
    assert all(r.phase is RequestPhase.RUNNING for r in (first, *first.other_choices))
    assert scheduler.cancel("r", choice=1)
    assert first.other_choices[0].phase is RequestPhase.FINISHED
    assert (
        first.phase is RequestPhase.RUNNING and first.other_choices[1].phase is RequestPhase.RUNNING
    )
    assert not scheduler.cancel("r", choice=1)  # already over
    scheduler.step()
    assert scheduler.cancel("r")
    assert all(r.phase is RequestPhase.FINISHED for r in (first, *first.other_choices))
    assert not scheduler.cancel("r") and "r" not in scheduler.book.choices
    scheduler.kv.check_invariants()
    assert scheduler.kv.registry.pool.num_referenced() == 0


def test_the_first_choices_end_leaves_the_others_running() -> None:
    """Choice 0 cancelled mid-decode: the forks keep their pages (the shared
    prompt blocks stay held) and finish with their own tokens."""
    ids = prompt(4, 26)
    want, _ = expected_output(ids, greedy(12), LIMITS, STOP_IDS)
    scheduler = make()
    first = scheduler.submit("r", "t", ids, greedy(12), n=3)
    outputs: dict[int, list[int]] = defaultdict(list)
    for _ in range(6):
        for event in scheduler.step().events:
            if event.token is not None:
                outputs[event.choice].append(event.token)
    assert scheduler.cancel("r", choice=0) and first.phase is RequestPhase.FINISHED
    while scheduler.has_work():
        for event in scheduler.step().events:
            if event.token is not None:
                outputs[event.choice].append(event.token)
        scheduler.kv.check_invariants()
    assert outputs[1] == want and outputs[2] == want
    assert "r" not in scheduler.book.choices
    assert scheduler.kv.registry.pool.num_referenced() == 0


def test_the_queue_and_rate_limits_count_a_requests_choices_together() -> None:
    ids = prompt(5, 30)  # 30 tokens of prompt, 10 of completion per choice
    scheduler = make(max_queue=1)
    scheduler.submit("a", "t", ids, greedy(10), n=4)
    with pytest.raises(Rejection) as refused:
        scheduler.submit("b", "t", ids, greedy(10))
    assert refused.value.code == "queue_full"
    run(scheduler)
    # The prompt once and each choice's completion: 30 + 3 * 10 = 60 tokens.
    limited = make(limits=RateLimits(tokens_per_minute=60))
    limited.submit("a", "t", ids, greedy(10), n=3)
    bucket = limited.book.limiters["t"].tokens
    assert bucket is not None and bucket.level == 0
    with pytest.raises(Rejection) as refused:
        make(limits=RateLimits(tokens_per_minute=59)).submit("a", "t", ids, greedy(10), n=3)
    assert refused.value.code == "exceeds_rate_limit"
    # Each choice gives back what it did not generate; the prompt stays paid.
    out = run(limited)
    assert bucket.level == 60 - 30 - sum(len(tokens) for tokens in out.values())
    # A request cancelled before it started gives back all it paid.
    limited.book.limiters["t"].tokens.level = 60  # type: ignore[union-attr]
    limited.submit("b", "t", ids, greedy(10), n=3)
    assert limited.cancel("b") and bucket.level == 60


def test_duplicate_ids_and_forks_waiting_past_the_deadline() -> None:
    scheduler = make()
    scheduler.submit("r", "t", prompt(6, 40), greedy(6), n=2, deadline_s=5.0)
    with pytest.raises(Rejection):
        scheduler.submit("r", "t", prompt(6, 40), greedy(6))
    scheduler.step()  # the first choice starts (its prefill takes three steps)
    scheduler.clock.now += 10.0  # type: ignore[attr-defined]
    out = run(scheduler)
    assert sorted(out) == [("r", 0), ("r", 1)]  # the started request is not late


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_choices_survive_preemption_under_a_tight_pool(preemption: str) -> None:
    """Two tenants' n > 1 requests in a pool too small for all their choices:
    preempted choices come back and every one yields its n = 1 tokens."""
    executor = make_executor(pages=40)
    scheduler = Scheduler(
        executor,
        SchedulerConfig(mode=BudgetMode.FREE, preemption=preemption),
        clock=Clock(100.0),
    )
    for name in ("a", "b"):
        scheduler.set_tenant(TenantConfig(name))
    prompts = {f"{t}{i}": prompt(10 + i + (5 if t == "b" else 0), 22) for t in "ab" for i in (0, 1)}
    for request_id, ids in prompts.items():
        scheduler.submit(request_id, request_id[0], ids, greedy(14), n=3)
    out = run(scheduler)
    for request_id, ids in prompts.items():
        want, _ = expected_output(ids, greedy(14), LIMITS, STOP_IDS)
        assert [out[request_id, i] for i in range(3)] == [want] * 3
    stats = scheduler.stats().tenants
    assert sum(s.preempted_recompute + s.preempted_swap for s in stats.values()) > 0


def test_a_prompts_own_logprobs_come_with_its_first_token() -> None:
    """prompt_logprobs: the first choice computes its whole prompt (none of it
    from the prefix cache, where an earlier request left it), over several
    chunks, and its first token carries the prompt's scores in order (the
    simulated executor's: -0.25, the token's own id first); its other
    choices still share its prompt and carry none; the pool whole after."""
    scheduler = make()
    tokens = prompt(3, 30)  # two chunks of at most 16
    scheduler.submit("warm", "t", tokens, greedy(2))
    run(scheduler)
    params = msgspec.structs.replace(greedy(3), prompt_logprobs=2)
    first = scheduler.submit("r", "t", tokens, params, n=2)
    firsts = {}
    for _ in range(50):
        for event in scheduler.step().events:
            firsts.setdefault(event.choice, event)
        if len(firsts) == 2 and first.phase is RequestPhase.FINISHED:
            break
    assert first.cached_tokens == 0
    scores = firsts[0].prompt
    assert scores is not None and len(scores) == len(tokens) - 1
    vocab = LIMITS.vocab_size
    for token, (logprob, top) in zip(tokens[1:], scores, strict=True):
        assert logprob == -0.25 and top == ((token, -0.25), ((token + 1) % vocab, -1.25))
    assert firsts[1].prompt is None
    assert not scheduler.tokens.scoring
    run(scheduler)
    scheduler.kv.check_invariants()
    assert scheduler.kv.registry.pool.num_referenced() == 0
