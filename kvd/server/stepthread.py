"""The step loop's own OS thread: each scheduler call (a step, or reading
the step in flight) runs there while the event loop keeps serving.

``trio.to_thread.run_sync`` would do the same with a thread from trio's
cache, at about twice the CPU per call (a capacity limiter, a cancel scope
per call, a job handed to whichever cached thread is idle, the thread's
name set again): on the AMD EPYC, 123-157 us a round trip against 65-88 us
here, paid once a step, and at one stream once a token. The hop is the
least it can be: a lock released to start the call, and trio's
``run_sync_soon`` to hand the outcome back.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import outcome
import trio

T = TypeVar("T")
# A call: the context it runs in, the work, and how its outcome is handed back.
Job = tuple[contextvars.Context, Callable[[], Any], Callable[[Any], None]]


class StepThreadBusy(RuntimeError):
    """A call was made while an abandoned one still runs (a hung step)."""


class StepThread:
    """One thread, started on the first call, that runs calls one at a time.

    A call that is cancelled is given up on (as ``abandon_on_cancel``): the
    caller returns at once and the thread is left to finish the call, or
    never to (a hung device). The step loop shields its calls from
    everything but its step timeout. ``close`` ends the thread once it is
    idle."""

    def __init__(self, name: str = "kvd-step") -> None:
        self.name = name
        self._go = threading.Lock()
        self._go.acquire()  # released once per call (or to close)
        self._job: Job | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._thread: threading.Thread | None = None
        self._running = False  # a call is on the thread (abandoned ones too)
        self._closed = False

    async def run(self, work: Callable[[], T]) -> T:
        """``work()`` on the thread; its exception is re-raised here."""
        if self._closed:
            raise RuntimeError("the step thread is closed")
        if self._running:
            raise StepThreadBusy("a step given up on is still running")
        if self._thread is None:
            self._token = trio.lowlevel.current_trio_token()
            self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
            self._thread.start()
        task = trio.lowlevel.current_task()
        waiting = True

        def deliver(result: outcome.Outcome[T]) -> None:  # on the event loop
            nonlocal waiting
            self._running = False
            if waiting:  # not given up on
                waiting = False
                trio.lowlevel.reschedule(task, result)

        def give_up(_: Any) -> trio.lowlevel.Abort:
            nonlocal waiting
            waiting = False
            return trio.lowlevel.Abort.SUCCEEDED

        self._job = (contextvars.copy_context(), work, deliver)
        self._running = True
        self._go.release()
        return await trio.lowlevel.wait_task_rescheduled(give_up)  # type: ignore[no-any-return]

    def close(self) -> None:
        """The thread ends when it is idle (at once), or after the call it
        is running returns."""
        if self._closed:
            return
        self._closed = True
        if self._thread is None:
            return
        if not self._running:
            self._job = None
        # Released already: the thread is taking its call, and stops after it.
        with contextlib.suppress(RuntimeError):
            self._go.release()

    def _serve(self) -> None:
        assert self._token is not None
        _name_os_thread(self.name)
        while True:
            self._go.acquire()
            job = self._job
            if job is None:
                return
            context, work, deliver = job
            self._job = None
            result = outcome.capture(context.run, work)
            try:
                self._token.run_sync_soon(deliver, result)
            except trio.RunFinishedError:
                return  # the event loop is gone: nobody waits for it
            if self._closed:
                return


def _name_os_thread(name: str) -> None:
    """The thread's name as ``top -H`` and ``/proc`` show it (Linux; 15 bytes)."""
    try:
        libc = ctypes.CDLL(None)  # the process's own symbols, libc's among them
        libc.pthread_setname_np(ctypes.c_void_p(threading.get_ident()), name.encode()[:15])
    except (OSError, AttributeError):
        pass  # not Linux, or no such call: the name is only for operators' tools
