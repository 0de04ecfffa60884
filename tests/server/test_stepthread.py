"""The step loop's own thread: calls run there, one at a time; a call given
up on is left behind; close ends the thread."""

from __future__ import annotations

import threading

import pytest
import trio

from kvd.server.stepthread import StepThread, StepThreadBusy


async def test_calls_run_on_one_thread_of_their_own() -> None:
    steps = StepThread(name="kvd-step-test")
    seen = [await steps.run(threading.current_thread) for _ in range(3)]
    assert len(set(seen)) == 1
    assert seen[0] is not threading.current_thread()
    assert seen[0].name == "kvd-step-test"
    steps.close()
    seen[0].join(timeout=10)
    assert not seen[0].is_alive()


async def test_an_exception_comes_back_to_the_caller() -> None:
    steps = StepThread()

    def fails() -> None:
        raise ValueError("the step failed")

    with pytest.raises(ValueError, match="the step failed"):
        await steps.run(fails)
    assert await steps.run(lambda: 7) == 7  # the thread carries on
    steps.close()


async def test_a_call_given_up_on_is_left_to_finish_and_its_result_dropped() -> None:
    steps = StepThread()
    release = threading.Event()
    finished = threading.Event()

    def hangs() -> str:
        release.wait(timeout=30)
        finished.set()
        return "late"

    with trio.move_on_after(0.05) as timer:
        await steps.run(hangs)
    assert timer.cancelled_caught
    with pytest.raises(StepThreadBusy):
        await steps.run(lambda: None)
    release.set()
    await trio.to_thread.run_sync(finished.wait, 30)
    # Its result is handed back on the event loop, to nobody: the thread is free again.
    with trio.fail_after(30):
        while True:
            try:
                assert await steps.run(lambda: "next") == "next"
                break
            except StepThreadBusy:
                await trio.sleep(0.01)
    steps.close()


async def test_close_while_a_call_runs_ends_the_thread_after_it() -> None:
    steps = StepThread()
    thread = await steps.run(threading.current_thread)
    release = threading.Event()
    with trio.move_on_after(0.05):
        await steps.run(lambda: release.wait(timeout=30))
    steps.close()
    assert thread.is_alive()  # still in the call
    release.set()
    await trio.to_thread.run_sync(thread.join, 30)
    assert not thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        await steps.run(lambda: None)


async def test_close_before_any_call_starts_no_thread() -> None:
    before = threading.active_count()
    steps = StepThread()
    steps.close()
    assert threading.active_count() == before
