"""Overlapped steps: each step is planned and dispatched before the one
before it is read, its sampled tokens placeholders on the host until then.
The serial loop (``overlap = false``) is the oracle: on the real engine over
a tiny model, the same requests give the same tokens, logprobs and ends,
with every feature at once and a pool small enough to force preemption; on
the simulated executor, the rules that make it safe hold step by step."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from msgspec.structs import replace

from kvd.kv.columns import PLACEHOLDER
from kvd.kv.ledger import BudgetMode
from kvd.sched.requests import RequestPhase
from kvd.sched.sampling_params import SamplingParams
from kvd.sched.scheduler import Scheduler, SchedulerConfig, StepEvent, TenantConfig
from kvd.sched.simulated import SimulatedExecutor
from kvd.sched.stepplan import StepPlan
from tests.sched.conftest import MakeEngine
from tests.sched.simulated import Clock, greedy, make_executor
from tests.sched.test_constraints import Alternating


class EndsOn:
    """A stop condition over token ids: stops once the output ends with ``pattern``."""

    def __init__(self, pattern: list[int]) -> None:
        self.pattern = pattern
        self.seen: list[int] = []

    def accept(self, token: int) -> bool:
        self.seen.append(token)
        return self.seen[-len(self.pattern) :] == self.pattern

    def fork(self) -> EndsOn:
        return EndsOn(self.pattern)


class StopsAfter:
    """A stop condition that stops the generation at its ``n``-th token."""

    def __init__(self, n: int) -> None:
        self.n, self.seen = n, 0

    def accept(self, token: int) -> bool:
        self.seen += 1
        return self.seen >= self.n

    def fork(self) -> StopsAfter:
        return StopsAfter(self.n)


def prompt(seed: int, n: int, vocab: int = 64) -> list[int]:
    return [2, *np.random.default_rng(seed).integers(3, vocab, n - 1).tolist()]


def drive(
    scheduler: Scheduler, limit: int = 2000, preempt_at: tuple[int, ...] = ()
) -> dict[str, list[StepEvent]]:
    """Every event by reply id, with the pool checked after every step;
    ``preempt_at``: steps before which the newest running request is preempted."""
    events: dict[str, list[StepEvent]] = {}
    for step in range(limit):
        if not scheduler.has_work():
            break
        if step in preempt_at and scheduler.book.running:
            victim = scheduler.book.running_order.snapshot()[-1]
            scheduler.preemption.preempt(victim, StepPlan(32, 8))
            scheduler.kv.check_invariants()
        for event in scheduler.step().events:
            events.setdefault(event.request_id, []).append(event)
        scheduler.kv.check_invariants()
    assert not scheduler.has_work()
    assert scheduler.kv.registry.pool.num_referenced() == 0  # every page back
    return events


# The stop tests' sampling: drawn, so that the output does not repeat itself.
DRAWN = SamplingParams(temperature=1.0, seed=3, max_tokens=20)
STOP_ID_AT = 5


def pattern(free: list[int]) -> list[int]:
    return free[7:9]


def ends_at(free: list[int], stop: list[int]) -> int:
    """How many tokens a generation ``free`` stopped by ``stop`` at its end keeps."""
    return next(i + len(stop) for i in range(len(free)) if free[i : i + len(stop)] == stop)


def submit_mix(scheduler: Scheduler, vocab: int, free: list[int]) -> None:
    """Every feature at once. ``free``: a drawn output of the first prompt,
    from which a stop id and a stop pattern are taken so that both fire
    mid-generation (found only when the token is read: a late stop)."""
    long = prompt(1, 70, vocab)  # past the step's 32 tokens: chunked
    shared = prompt(2, 40, vocab)  # a prefix the later ones find cached
    submit = scheduler.submit
    submit("greedy", "t", long, greedy(20))
    submit(
        "seeded", "t", prompt(3, 12, vocab), SamplingParams(temperature=0.9, seed=7, max_tokens=18)
    )
    submit(
        "choices",
        "t",
        prompt(4, 9, vocab),
        SamplingParams(temperature=1.0, seed=11, max_tokens=12),
        n=2,
    )
    submit(
        "penalized",
        "t",
        prompt(5, 15, vocab),
        SamplingParams(
            temperature=0.0,
            max_tokens=16,
            min_tokens=6,
            presence_penalty=0.8,
            frequency_penalty=1.1,
            repetition_penalty=1.4,
        ),
    )
    submit(
        "biased",
        "t",
        prompt(6, 11, vocab),
        SamplingParams(
            temperature=0.0, max_tokens=14, logit_bias=((5, 3.0), (9, -100.0)), min_tokens=4
        ),
    )
    submit("stop-id", "t", long, replace(DRAWN, stop_token_ids=(free[STOP_ID_AT],)))
    submit("stop-pattern", "t", long, DRAWN, stop=EndsOn(pattern(free)))
    submit(
        "ignore-eos",
        "t",
        prompt(7, 8, vocab),
        SamplingParams(temperature=0.0, max_tokens=15, ignore_eos=True),
    )
    submit(
        "logprobs",
        "t",
        prompt(8, 10, vocab),
        SamplingParams(
            temperature=0.0, max_tokens=10, logprobs=True, top_logprobs=3, prompt_logprobs=2
        ),
    )
    grammar = Alternating(9, vocab=vocab)
    submit("grammar", "t", prompt(9, 10, vocab), greedy(30), constraint=grammar)
    for i in range(3):  # the same 40-token start: prefix hits, some from decoded blocks
        submit(f"shared-{i}", "t", shared + prompt(20 + i, 6, vocab), greedy(16))


def _rounded(value: Any) -> Any:
    """Nested tuples of ids and logprobs, floats to 3 decimals."""
    if isinstance(value, float):
        return round(value, 3)
    if isinstance(value, tuple):
        return tuple(_rounded(v) for v in value)
    return value


def summary(events: dict[str, list[StepEvent]]) -> dict[Any, Any]:
    out = {}
    for reply_id, mine in events.items():
        by_choice: dict[int, list[StepEvent]] = {}
        for event in mine:
            by_choice.setdefault(event.choice, []).append(event)
        for choice, evs in by_choice.items():
            ends = [e for e in evs if e.finished]
            assert len(ends) == 1 and ends[-1] is evs[-1], (reply_id, evs)  # nothing after the end
            out[reply_id, choice] = (
                [e.token for e in evs if e.token is not None],
                [round(e.logprob, 3) for e in evs if e.token is not None],
                ends[0].finish_reason,
                [_rounded(e.top) for e in evs],
                [_rounded(e.prompt) for e in evs],
            )
    return out


@pytest.mark.parametrize(
    ("preemption", "kv_dtype", "host_pages"), [("recompute", None, 64), ("swap", "int8", 0)]
)
def test_overlapped_steps_match_the_serial_loop_on_the_engine(
    make_engine: MakeEngine, preemption: str, kv_dtype: str | None, host_pages: int
) -> None:
    """The tiny model behind the real engine, a pool of 32 blocks for about
    500 tokens of demand, requests preempted on top (mid-decode and
    mid-prefill); with the host cache, or with int8 K/V."""
    reference = Scheduler(make_engine(), SchedulerConfig(overlap=False), clock=Clock(10.0))
    reference.set_tenant(TenantConfig("t"))
    reference.submit("free", "t", prompt(1, 70), DRAWN)
    free = [e.token for e in drive(reference)["free"] if e.token is not None]
    runs = {}
    for overlap in (False, True):
        engine = make_engine(pool_tokens=128, kv_dtype=kv_dtype)
        config = SchedulerConfig(
            mode=BudgetMode.FREE, preemption=preemption, overlap=overlap, host_pages=host_pages
        )
        scheduler = Scheduler(engine, config, clock=Clock(10.0))
        scheduler.set_tenant(TenantConfig("t", max_queue=64))
        scheduler.kv.enable_events()
        submit_mix(scheduler, engine.vocab_size, free)
        runs[overlap] = summary(drive(scheduler, preempt_at=(3, 8, 14, 21)))
        assert scheduler.preemptions >= 4
        asked = runs[overlap]["logprobs", 0]
        assert asked[3][0] is not None and asked[4][0] is not None  # top and prompt logprobs
        stopped_by_id = runs[overlap]["stop-id", 0]
        assert (len(stopped_by_id[0]), stopped_by_id[2]) == (
            ends_at(free, [free[STOP_ID_AT]]),
            "stop",
        )
        stopped_by_pattern = runs[overlap]["stop-pattern", 0]
        assert (len(stopped_by_pattern[0]), stopped_by_pattern[2]) == (
            ends_at(free, pattern(free)),
            "stop",
        )
    assert runs[True] == runs[False]


# -- the rules, on the simulated executor ------------------------------------------


class Counting:
    """Counts, per sequence, the steps it is dispatched in."""

    def __init__(self, executor: SimulatedExecutor) -> None:
        self.rows: dict[int, int] = {}
        self.steps: list[set[int]] = []  # the sequences of each dispatch
        dispatch = executor.dispatch

        def counted(seqs: list[Any], *args: Any) -> Any:
            self.steps.append({seq.seq_id for seq in seqs})
            for seq in seqs:
                self.rows[seq.seq_id] = self.rows.get(seq.seq_id, 0) + 1
            return dispatch(seqs, *args)

        executor.dispatch = counted  # type: ignore[method-assign]


def simulated(overlap: bool = True, **config: Any) -> tuple[Scheduler, Counting]:
    executor = make_executor()
    counting = Counting(executor)
    scheduler = Scheduler(executor, SchedulerConfig(overlap=overlap, **config), clock=Clock(10.0))
    scheduler.set_tenant(TenantConfig("t", max_queue=64))
    return scheduler, counting


PROMPT = [5, 9, 13, 17, 21, 25, 29]


def test_a_length_stop_costs_no_extra_step_and_another_stop_at_most_one() -> None:
    steps = {}
    for overlap in (False, True):
        scheduler, counting = simulated(overlap)
        scheduler.submit("length", "t", PROMPT, greedy(12))
        scheduler.submit("stop", "t", PROMPT, greedy(12), stop=StopsAfter(1))
        drive(scheduler)
        steps[overlap] = dict(counting.rows)
    # One prefill step samples the first token; 11 decodes the rest.
    assert steps[False] == {1: 12, 2: 1}
    # The length stop is known when the step is planned; the stop condition
    # only when its token is read, one step late (that step's token is dropped).
    assert steps[True] == {1: 12, 2: 2}


def test_a_late_stop_emits_nothing_after_its_end_and_frees_its_pages() -> None:
    scheduler, _ = simulated()
    scheduler.kv.enable_events()
    request = scheduler.submit("r", "t", PROMPT, greedy(20), stop=StopsAfter(1))
    events = scheduler.step().events  # the prefill dispatched, nothing read yet
    assert events == [] and scheduler.in_flight
    events = scheduler.step().events  # its first token read (a stop) as the next step flies
    assert [(e.finished, e.finish_reason) for e in events] == [(True, "stop")]
    assert request.phase is RequestPhase.FINISHED
    assert len(request.output) == 1  # the in-flight placeholder is gone with the request
    events = scheduler.step().events  # that step read: its row dropped, exactly once
    assert events == [] and not scheduler.has_work()
    assert scheduler.kv.registry.pool.num_referenced() == 0
    scheduler.kv.check_invariants()


def test_a_cancel_with_a_step_in_flight_drops_its_token_once() -> None:
    scheduler, _ = simulated()
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    scheduler.submit("a", "t", PROMPT, params)
    scheduler.submit("b", "t", PROMPT[:5], params)
    before = [e for _ in range(4) for e in scheduler.step().events]
    assert scheduler.in_flight
    assert scheduler.cancel("a")
    scheduler.kv.check_invariants()
    later = drive(scheduler)
    assert "a" not in later  # its token in flight was dropped
    tokens = [e.token for e in before + later["b"] if e.request_id == "b"]
    assert len(tokens) == 30


def test_no_placeholder_reaches_the_prefix_cache_or_its_events() -> None:
    """Blocks filled by decodes enter the cache when their sequence ends,
    even if that is while a step computing into them is in flight; a block
    holding a placeholder never does."""
    scheduler, _ = simulated()
    log = scheduler.kv.enable_events()
    for i in range(5):
        scheduler.submit(f"r{i}", "t", PROMPT[: 3 + i], greedy(9 + 3 * i))
    stored: list[list[int]] = []
    for _ in range(300):
        if not scheduler.has_work():
            break
        scheduler.step()
        for seq in scheduler.kv.registry.sequences.values():
            assert PLACEHOLDER not in seq.tokens[: seq.known_tokens]
            assert seq.registered * scheduler.kv.block_size <= seq.known_tokens
        stored += [list(event.token_ids) for event in log.take() if hasattr(event, "token_ids")]
    assert stored and not any(PLACEHOLDER in ids for ids in stored)


def test_rows_that_need_their_token_on_the_host_wait_and_the_others_do_not() -> None:
    """A grammar's row waits a step for its newest token (its mask is made
    on the host from it); a free row and a penalized one (whose history
    takes a token in flight on the device) in the same batch do not."""
    scheduler, counting = simulated()
    penalized = SamplingParams(temperature=0.0, max_tokens=10, presence_penalty=0.5)
    scheduler.submit("free", "t", PROMPT, greedy(10))
    scheduler.submit("penalized", "t", PROMPT, penalized)
    scheduler.submit("grammar", "t", PROMPT, greedy(10), constraint=Alternating(10, vocab=48))
    events = drive(scheduler)
    for name in ("free", "penalized", "grammar"):
        assert len([e for e in events[name] if e.token is not None]) == 10, name
    assert counting.rows[1] == counting.rows[2] == 10  # one dispatch per token
    for row in (1, 2):  # free and penalized: every step from the first
        assert [i for i, ids in enumerate(counting.steps) if row in ids] == list(range(10))
    # The grammar's row (its prompt's prefill in two chunks) waits every other step.
    assert any(3 not in ids for ids in counting.steps[:10])
