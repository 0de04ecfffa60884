"""The daemon's status: one value, owned here, changed only by the
transitions below, read by ``/ready``, the handlers, kvctl and the metrics.

    LOADING --ready()--> READY <--undrain()-- DRAINING
       |                   |  --drain()-->       |
       |                   +----fail()----> FAILED <--+
       +--stop()/fail()--------------------------------+

``stop()`` (a signal) is a drain that cannot be undone; ``fail()`` (the
engine failed) is final. Every other combination is refused or a no-op, so
no caller can put the daemon in a state the others do not expect.
"""

from __future__ import annotations

import enum


class Status(enum.Enum):
    LOADING = "loading"  # weights, pool, compiles, calibration
    READY = "ready"  # serving
    DRAINING = "draining"  # no new requests; those in flight finish
    FAILED = "failed"  # the engine failed; the process is exiting

    def __str__(self) -> str:
        return self.value


class StatusError(Exception):
    """A transition the current status does not allow (kvctl says why)."""


class ServerStatus:
    def __init__(self) -> None:
        self._status = Status.LOADING
        self.detail: str | None = None  # what loading is doing, or why it failed
        self.stopping = False  # a signal or a failure: the process is on its way out

    @property
    def status(self) -> Status:
        return self._status

    @property
    def serving(self) -> bool:
        return self._status is Status.READY

    def __str__(self) -> str:
        return str(self._status)

    def loading(self, detail: str) -> None:
        """What loading is doing now (kvctl and /ready say it meanwhile)."""
        if self._status is Status.LOADING:
            self.detail = detail

    def ready(self) -> None:
        if self._status is Status.LOADING and not self.stopping:
            self._status, self.detail = Status.READY, None

    def drain(self) -> None:
        """kvctl drain: new requests are refused until ``undrain``."""
        if self._status is Status.FAILED:
            raise StatusError(f"the daemon has failed ({self.detail})")
        if self._status is Status.READY:
            self._status = Status.DRAINING

    def undrain(self) -> None:
        if self.stopping:
            raise StatusError("the daemon is shutting down: it cannot be undrained")
        if self._status is Status.DRAINING:
            self._status = Status.READY

    def stop(self) -> None:
        """A signal: drain for good (loading stops where it is)."""
        self.stopping = True
        if self._status in (Status.READY, Status.LOADING):
            self._status = Status.DRAINING

    def fail(self, cause: str) -> None:
        self.stopping = True
        self._status, self.detail = Status.FAILED, cause
