"""Where a generation ends is decided by the scheduler, as it records each
token: a request's stop ids, and its stop strings through a StopCondition
(here one over token ids; kvd/server/stopstrings.py watches text)."""

from __future__ import annotations

import msgspec
import pytest

from kvd.sched.requests import Rejection, RequestPhase
from kvd.sched.results import Failed
from kvd.sched.sampling_params import SamplingParams
from kvd.sched.scheduler import Scheduler, SchedulerConfig, StepEvent, TenantConfig
from tests.sched.simulated import Clock, greedy, make_executor


class EndsOn:
    """Stops once the output's last tokens are ``pattern``; records what it saw."""

    def __init__(self, pattern: list[int], log: list[EndsOn]) -> None:
        self.pattern, self.seen, self.log = pattern, [], log
        log.append(self)

    def accept(self, token: int) -> bool:
        self.seen.append(token)
        return self.seen[-len(self.pattern) :] == self.pattern

    def fork(self) -> EndsOn:
        return EndsOn(self.pattern, self.log)


def make() -> Scheduler:
    scheduler = Scheduler(make_executor(), SchedulerConfig(), clock=Clock(10.0))
    scheduler.set_tenant(TenantConfig("t"))
    return scheduler


def run(scheduler: Scheduler, failed: list[Failed] | None = None) -> list[StepEvent]:
    """Step until done; the events, and (into ``failed``) the requests failed alone."""
    events: list[StepEvent] = []
    for _ in range(300):
        if not scheduler.has_work():
            break
        result = scheduler.step()
        events += result.events
        if failed is not None:
            failed += result.failed
        scheduler.kv.check_invariants()
    assert not scheduler.has_work()
    assert scheduler.kv.registry.pool.num_referenced() == 0  # every page back
    return events


PROMPT = [5, 9, 13, 17, 21, 25, 29]


def output_of(params: SamplingParams, **submit: object) -> list[StepEvent]:
    scheduler = make()
    scheduler.submit("r", "t", PROMPT, params, **submit)  # type: ignore[arg-type]
    return run(scheduler)


def test_a_stop_condition_ends_the_generation_with_the_token_completing_it() -> None:
    free = [e.token for e in output_of(greedy(12))]
    assert len(free) == 12
    watchers: list[EndsOn] = []
    events = output_of(greedy(12), stop=EndsOn(free[3:5], watchers))
    assert [e.token for e in events] == free[:5]  # nothing computed past it
    assert events[-1].finished and events[-1].finish_reason == "stop"
    assert not any(e.finished for e in events[:-1])
    (watcher,) = watchers
    assert watcher.seen == free[:5]  # output tokens only, each once


def test_a_stop_condition_never_met_leaves_the_length_end() -> None:
    free = output_of(greedy(6))
    watchers: list[EndsOn] = []
    events = output_of(greedy(6), stop=EndsOn([10**6], watchers))
    assert [e.token for e in events] == [e.token for e in free]
    assert events[-1].finish_reason == "length"


def test_each_choice_watches_its_own_output() -> None:
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=10)
    scheduler = make()
    scheduler.submit("r", "t", PROMPT, params, n=3)
    free: dict[int, list[int]] = {}
    free_end: dict[int, str | None] = {}
    for e in run(scheduler):
        free.setdefault(e.choice, []).append(e.token)  # type: ignore[arg-type]
        free_end[e.choice] = e.finish_reason
    assert len({tuple(tokens) for tokens in free.values()}) == 3, "choices should differ"
    longest = max(free, key=lambda c: len(free[c]))
    pattern = free[longest][4:6]
    watchers: list[EndsOn] = []
    scheduler = make()
    lead = scheduler.submit("r", "t", PROMPT, params, n=3, stop=EndsOn(pattern, watchers))
    got: dict[int, list[StepEvent]] = {}
    for e in run(scheduler):
        got.setdefault(e.choice, []).append(e)
    assert len(watchers) == 3  # the lead's own, and one fresh fork per other choice
    for choice, events in got.items():
        tokens = [e.token for e in events]
        ends_at = next(
            (i + 1 for i in range(len(free[choice])) if free[choice][: i + 1][-2:] == pattern),
            None,
        )
        assert tokens == free[choice][: ends_at or 10]
        assert events[-1].finish_reason == ("stop" if ends_at else free_end[choice])
    assert any(
        free[c][-2:] == pattern and free_end[c] == "length" or len(got[c]) < len(free[c])
        for c in got
    ), "the pattern should have cut a choice short"
    assert [w.seen for w in watchers] == [[e.token for e in got[c]] for c in range(3)]
    assert all(r.phase is RequestPhase.FINISHED for r in (lead, *lead.other_choices))


def test_a_requests_stop_ids_end_it_in_the_scheduler() -> None:
    free = [e.token for e in output_of(greedy(12))]
    stop_at = free[4]
    first = free.index(stop_at)
    params = msgspec.structs.replace(greedy(12), stop_token_ids=(stop_at,))
    events = output_of(params)
    assert [e.token for e in events] == free[: first + 1]
    assert events[-1].finish_reason == "stop"


class Breaks:
    """A watch whose decoding fails at its third token."""

    def __init__(self) -> None:
        self.seen = 0

    def accept(self, token: int) -> bool:
        self.seen += 1
        if self.seen == 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "not text")
        return False

    def fork(self) -> Breaks:
        return Breaks()


def test_a_watch_that_fails_fails_its_request_alone() -> None:
    scheduler = make()
    scheduler.submit("broken", "t", PROMPT, greedy(10), stop=Breaks())
    scheduler.submit("other", "t", [4, *PROMPT], greedy(10))
    failed: list[Failed] = []
    events = run(scheduler, failed)
    broken = [e for e in events if e.request_id == "broken"]
    assert [e.token for e in broken[:2]] == [e.token for e in output_of(greedy(2))]
    assert broken[-1].token is None and broken[-1].finish_reason == "error"
    assert "watching its stop strings failed: UnicodeDecodeError" in (broken[-1].detail or "")
    assert len(broken) == 3  # two tokens, then the failure in place of the third
    other = [e for e in events if e.request_id == "other"]
    assert len(other) == 10 and other[-1].finish_reason == "length"
    assert [f.request_id for f in failed] == ["broken"]


def test_stop_strings_without_a_watch_are_refused() -> None:
    scheduler = make()
    params = msgspec.structs.replace(greedy(5), stop=("x",))
    with pytest.raises(Rejection, match="StopCondition") as refused:
        scheduler.submit("r", "t", PROMPT, params)
    assert refused.value.status == 400
    assert not scheduler.has_work()
