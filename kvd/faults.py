"""Fault injection for kvd's own test suite: ``KVD_FAULTS``.

A comma-separated list of ``point:action[@N][+]``: at the N-th time (default
the first) the daemon reaches ``point``, ``action`` happens; with ``+``, at
that time and every later one. The points and what they can do:

- ``step:raise`` / ``step:hang`` / ``step:slow``: the engine step raises (a
  device error), never returns (a lost device), or takes 50 ms longer (a
  slow device: a test can then act while a request is surely mid-flight);
- ``sequence:raise``: a sequence's own step inputs cannot be built (counted
  per sequence as it first runs): a fault attributable to one request;
- ``tokenize:raise`` / ``detokenize:raise``: turning a request's prompt into
  tokens, or its tokens into text, fails (counted per prompt, and per batch
  of tokens handed to a client);
- ``d2h:fail``: a device-to-host copy fails (swap-outs and host-cache
  offloads);
- ``statefile:enospc`` / ``statefile:readonly``: writing the state file fails
  as on a full or read-only disk.

Refused unless ``KVD_TESTING=1`` is set as well: injected faults have no place
in a serving daemon. Pure Python; the points call ``fire``, which costs one
attribute read when nothing is armed.
"""

from __future__ import annotations

import os
import re
import threading

ACTIONS = {
    "step": ("raise", "hang", "slow"),
    "sequence": ("raise",),
    "tokenize": ("raise",),
    "detokenize": ("raise",),
    "d2h": ("fail",),
    "statefile": ("enospc", "readonly"),
}
SLOW_STEP_S = 0.05  # ``step:slow``: long beside a loopback round trip, short beside a test
_ITEM = re.compile(r"(?P<point>[a-z0-9_]+):(?P<action>[a-z]+)(?:@(?P<at>\d+))?(?P<every>\+)?")


class FaultSpecError(ValueError):
    """``KVD_FAULTS`` cannot be used: malformed, or outside tests."""


class InjectedFault(RuntimeError):
    """What an injected ``raise`` or ``fail`` raises: named as injected, so a
    log can never pass one off as a real failure."""


class _Fault:
    def __init__(self, point: str, action: str, at: int, every: bool) -> None:
        self.point, self.action, self.at, self.every = point, action, at, every

    def __repr__(self) -> str:
        return f"{self.point}:{self.action}@{self.at}{'+' if self.every else ''}"


class Faults:
    def __init__(self, faults: list[_Fault]) -> None:
        self.faults = faults
        self.reached: dict[str, int] = {}
        self._lock = threading.Lock()  # points are reached from worker threads too

    def fire(self, point: str) -> str | None:
        """Count one arrival at ``point``; the action armed for it now, if any."""
        with self._lock:
            count = self.reached.get(point, 0) + 1
            self.reached[point] = count
            for fault in self.faults:
                if fault.point == point and (
                    count == fault.at or (fault.every and count > fault.at)
                ):
                    return fault.action
        return None

    def __str__(self) -> str:
        return ",".join(repr(f) for f in self.faults)


def parse(spec: str) -> Faults:
    faults = []
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        match = _ITEM.fullmatch(item)
        if match is None:
            raise FaultSpecError(f"KVD_FAULTS: {item!r} is not point:action[@N][+]")
        point, action = match["point"], match["action"]
        if point not in ACTIONS:
            raise FaultSpecError(
                f"KVD_FAULTS: unknown point {point!r} (known: {', '.join(ACTIONS)})"
            )
        if action not in ACTIONS[point]:
            raise FaultSpecError(
                f"KVD_FAULTS: {point} cannot {action!r} (it can: {', '.join(ACTIONS[point])})"
            )
        at = int(match["at"] or 1)
        if at < 1:
            raise FaultSpecError(f"KVD_FAULTS: {item!r}: counts start at 1")
        faults.append(_Fault(point, action, at, bool(match["every"])))
    return Faults(faults)


armed: Faults | None = None


def arm_from_environment(environ: dict[str, str] | None = None) -> Faults | None:
    """Arm what ``KVD_FAULTS`` names (None if unset); FaultSpecError if it is
    malformed or ``KVD_TESTING=1`` is not set."""
    global armed
    env = os.environ if environ is None else environ
    spec = env.get("KVD_FAULTS")
    if spec is None:
        armed = None
        return None
    if env.get("KVD_TESTING") != "1":
        raise FaultSpecError(
            "KVD_FAULTS injects failures and is for kvd's test suite only; "
            "unset it (or set KVD_TESTING=1 in a test)"
        )
    armed = parse(spec)
    return armed


def fire(point: str) -> str | None:
    """The action armed for this arrival at ``point`` (None: carry on)."""
    faults = armed
    return None if faults is None else faults.fire(point)


def testing() -> bool:
    """Fault injection is allowed in this process (the admin API can arm more)."""
    return armed is not None
