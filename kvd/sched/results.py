"""What one scheduler step hands back: one value holding everything the step
did that its caller reports (the daemon logs each kind under its own event
name), instead of logs the caller drains from the scheduler's record.

Things that happen between two steps (a copy that fails while an admin
change syncs the host cache, the tokens of a step read early by ``settle``)
come with the next step's result."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from kvd.sched.requests import StepEvent


class Started(NamedTuple):
    """A request started computing for the first time."""

    request_id: str
    tenant: str
    queue_steps: int  # steps it waited in its queue
    cached_tokens: int  # prompt tokens the prefix cache served


class Preempted(NamedTuple):
    """A running request gave its pages up."""

    request_id: str
    tenant: str
    kind: str  # "swap" (pages to host memory) or "recompute" (pages dropped)


class Failed(NamedTuple):
    """A request failed alone, for a fault of its own inputs."""

    request_id: str
    tenant: str
    cause: str


class CopyFailed(NamedTuple):
    """A copy between the device and host memory failed and was recovered from."""

    kind: str  # "swap_out" (the request recomputes later) or "offload" (blocks dropped)
    cause: str


@dataclass(slots=True)
class StepResult:
    """One step: its tokens and ends (``events``, in order), and the starts,
    preemptions, failures and failed copies since the last step's result."""

    events: list[StepEvent] = field(default_factory=list)
    started: list[Started] = field(default_factory=list)
    preempted: list[Preempted] = field(default_factory=list)
    failed: list[Failed] = field(default_factory=list)
    copy_failed: list[CopyFailed] = field(default_factory=list)
