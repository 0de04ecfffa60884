"""Structured output in the scheduler, on the simulated executor: each
choice follows its own copy of the grammar, the executor samples only what
the step's bitmask allows, a grammar that is complete ends its sequence with
"stop", and preemption (recompute or swap) changes nothing: the grammar has
seen every kept token once, whatever was recomputed. The grammar here is a
small automaton over the simulated 48-token vocabulary (tokens alternate
even and odd, complete after a set length); llguidance's real ones are
tested through the API (tests/server/test_structured.py)."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest

from kvd.kv.ledger import BudgetMode
from kvd.sched.constraint import BITS, mask_words
from kvd.sched.sampling_params import SamplingParams
from kvd.sched.scheduler import Scheduler, SchedulerConfig, TenantConfig
from tests.sched.simulated import LIMITS, Clock, make_executor

VOCAB = LIMITS.vocab_size


class Alternating:
    """Tokens alternate even and odd, the first even; complete after ``length``."""

    def __init__(self, length: int, seen: list[int] | None = None, vocab: int = VOCAB) -> None:
        self.length = length
        self.seen = list(seen or [])
        self.vocab = vocab
        self.masks_filled = 0

    def fill_mask(self, row: np.ndarray) -> None:
        bits = np.zeros(row.size * BITS, np.uint8)
        bits[len(self.seen) % 2 : self.vocab : 2] = 1
        row[:] = np.packbits(bits, bitorder="little").view(np.int32)
        self.masks_filled += 1

    def accept(self, token: int) -> bool:
        ok = token % 2 == len(self.seen) % 2
        self.seen.append(token)
        return ok

    def finished(self) -> bool:
        return len(self.seen) >= self.length

    def fork(self) -> Alternating:
        return Alternating(self.length, self.seen, self.vocab)

    def error(self) -> str:
        return "the parity breaks"


def prompt(seed: int, length: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 44 + 2 for i in range(length)]


def serve(pages: int, preemption: str) -> tuple[dict, dict, Scheduler]:
    scheduler = Scheduler(
        make_executor(pages),
        SchedulerConfig(mode=BudgetMode.FREE, preemption=preemption),
        clock=Clock(100.0),
    )
    for name in ("a", "b"):
        scheduler.set_tenant(TenantConfig(name))
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    for t in "ab":
        for i in range(2):
            request_id = f"{t}{i}"
            ids = prompt(10 + i + (5 if t == "b" else 0), 22)
            length = 12 + 3 * i  # complete before max_tokens
            scheduler.submit(request_id, t, ids, params, n=2, constraint=Alternating(length))
    outputs: dict[tuple[str, int], list[int]] = defaultdict(list)
    reasons: dict[tuple[str, int], str | None] = {}
    for _ in range(1000):
        if not scheduler.has_work():
            break
        for event in scheduler.step().events:
            if event.token is not None:
                outputs[event.request_id, event.choice].append(event.token)
            if event.finished:
                reasons[event.request_id, event.choice] = event.finish_reason
        scheduler.kv.check_invariants()
    assert not scheduler.has_work(), "wedged"
    assert scheduler.kv.registry.pool.num_referenced() == 0
    return dict(outputs), reasons, scheduler


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_grammars_hold_through_preemption(preemption: str) -> None:
    roomy, roomy_reasons, _ = serve(400, preemption)
    tight, tight_reasons, scheduler = serve(40, preemption)
    stats = scheduler.stats().tenants
    assert sum(s.preempted_recompute + s.preempted_swap for s in stats.values()) > 0
    assert tight == roomy and tight_reasons == roomy_reasons
    assert len(tight) == 8  # two requests a tenant, two choices each
    for (request_id, _choice), tokens in tight.items():
        assert len(tokens) == 12 + 3 * int(request_id[1])  # the grammar ended it
        assert [t % 2 for t in tokens] == [i % 2 for i in range(len(tokens))]
    assert set(tight_reasons.values()) == {"stop"}


def test_each_choice_follows_its_own_copy() -> None:
    scheduler = Scheduler(make_executor(200), SchedulerConfig(), clock=Clock(100.0))
    scheduler.set_tenant(TenantConfig("t"))
    constraint = Alternating(6)
    first = scheduler.submit(
        "r",
        "t",
        prompt(3, 10),
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
        n=3,
        constraint=constraint,
    )
    choices = [first, *first.other_choices]
    assert first.constraint is constraint
    assert len({id(r.constraint) for r in choices}) == 3
    while scheduler.has_work():
        scheduler.step()
    for request in choices:
        assert isinstance(request.constraint, Alternating)
        assert len(request.constraint.seen) == 6 and request.finish_reason == "stop"
        # A mask for each sampled token, none for prefill chunks that sample nothing.
        assert request.constraint.masks_filled == 6
    assert mask_words(VOCAB) == 2
