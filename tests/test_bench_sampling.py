"""The sampling bench's rounds: passes timed in turn come at every place of
a round, and after every other pass, equally often."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from kvd.bench.sampling import _in_turn


def _recording(calls: list[str], name: str, seconds: float = 0.0) -> Callable[[], float]:
    def call() -> float:
        calls.append(name)
        return seconds

    return call


def test_passes_timed_in_turn_take_every_order_equally_often() -> None:
    calls: list[str] = []
    passes = {
        name: _recording(calls, name, seconds)
        for name, seconds in (("read", 1.0), ("greedy", 2.0), ("draw", 3.0))
    }
    rounds = _in_turn(passes, 10)  # rounded up to a multiple of the 6 orders
    assert len(rounds) == 12
    assert all(r == {"read": 1.0, "greedy": 2.0, "draw": 3.0} for r in rounds)
    orders = [tuple(calls[3 * i : 3 * i + 3]) for i in range(12)]
    assert len(set(orders)) == 6
    assert set(Counter(orders).values()) == {2}
    places = Counter((name, order.index(name)) for order in orders for name in order)
    assert len(places) == 9 and set(places.values()) == {4}
    followed = {pair for pair in zip(calls, calls[1:], strict=False) if pair[0] != pair[1]}
    assert followed == {(a, b) for a in passes for b in passes if a != b}


def test_two_passes_alternate_which_comes_first() -> None:
    calls: list[str] = []
    passes = {name: _recording(calls, name) for name in ("base", "case")}
    assert len(_in_turn(passes, 5)) == 6
    assert calls == ["base", "case", "case", "base"] * 3
