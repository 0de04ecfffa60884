"""The daemon's lifecycle in-process: overload, a stop's drain and abort,
what /ready and kvctl say while it loads, and the start-up failures, on the
real Daemon (its ``run`` where the whole start is the subject) over the
simulated executor. The process-level endings (signals, exit statuses,
systemd) are in test_processes.py."""

from __future__ import annotations

import functools
import gc
import json
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
import trio

from kvd import faults
from kvd.sched.simulated import SimulatedExecutor
from kvd.server.config import load_config
from kvd.server.daemon import Daemon, load_engine, startup_failure
from tests.server.conftest import ALICE, BOB, write_config
from tests.server.harness import DEVICE, Reply, Served, serving, simulated_loader, until


@pytest.fixture(autouse=True)
def disarmed() -> Iterator[None]:
    faults.armed = None
    yield
    faults.armed = None


async def held(served: Served, count: int) -> None:
    """Until ``count`` requests are in flight."""
    runtime = served.daemon.runtime
    assert runtime is not None
    await until(lambda: runtime.in_flight >= count, f"{count} requests in flight")


async def test_overload_is_a_503_with_retry_after(tmp_path: Path) -> None:
    async with serving(tmp_path, max_in_flight=2, max_model_len=2048) as served:
        faults.armed = faults.parse("step:slow@1+")  # 1,500 tokens outlast the test
        async with trio.open_nursery() as nursery:
            for i in range(2):
                nursery.start_soon(
                    functools.partial(served.complete, ALICE, f"hold {i}", max_tokens=1500)
                )
            await held(served, 2)
            response = await served.complete(BOB, "one more", max_tokens=2)
            assert response.status_code == 503
            assert (await response.get_json())["error"]["code"] == "overloaded"
            assert int(response.headers["Retry-After"]) >= 1
            nursery.cancel_scope.cancel()  # the two clients hang up
        faults.armed = None
        await served.assert_whole()
        outcomes = [e["outcome"] for e in served.named("request.finish")]
        assert outcomes.count("disconnected") == 2, outcomes


def events_of(reply: Reply | None) -> list[str]:
    assert reply is not None and reply.status_code == 200
    text = reply.response.content.decode()
    return [line.removeprefix("data: ") for line in text.split("\n\n") if line]


async def test_a_stop_drains_what_finishes_and_aborts_what_is_left(tmp_path: Path) -> None:
    """What a signal starts (test_processes.py sends the signal): new
    requests are refused with Retry-After and /ready says draining; the
    requests in flight get ``drain_timeout``; what is left is aborted with an
    error event, its pages released, and the pool is whole."""
    async with serving(tmp_path, drain_timeout=2.0, max_model_len=2048) as served:
        faults.armed = faults.parse("step:slow@1+")  # 50 ms a step: 2,000 tokens take 100 s
        replies: list[Reply | None] = [None] * 6

        async def one(i: int) -> None:
            tokens = 4 if i < 4 else 2000
            replies[i] = await served.complete(ALICE, f"stream {i}", max_tokens=tokens, stream=True)

        async with trio.open_nursery() as nursery:
            for i in range(6):
                nursery.start_soon(one, i)
            await held(served, 6)
            served.daemon.stop()
            late = await served.complete(BOB, "late", max_tokens=2)
            assert late.status_code == 503 and "Retry-After" in late.headers
            assert (await late.get_json())["error"]["code"] == "draining"
            ready = await served.http.get("/ready")
            assert ready.status_code == 503 and (await ready.get_json())["status"] == "draining"
            await served.daemon.drain()
        for reply in replies[:4]:
            assert events_of(reply)[-1] == "[DONE]"
        for reply in replies[4:]:
            last = events_of(reply)[-1]
            assert last != "[DONE]" and "aborted" in last, last
        assert served.named("lifecycle.drain_timeout")[-1]["aborted"] == 2
        drained = served.named("lifecycle.drained")[-1]
        assert drained["clean"] and drained["referenced_pages"] == 0
        assert served.daemon.clean
        await served.assert_whole()


async def test_kvctl_and_ready_say_why_a_daemon_is_not_ready(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A device that hangs in the start's first measured step, in the whole
    ``Daemon.run``: it stays loading, says so (and what it is doing) on
    /ready and to kvctl on its real socket, refuses requests with 503
    ``loading``, and a stop still ends it (0)."""
    monkeypatch.setenv("KVD_TESTING", "1")
    monkeypatch.setenv("KVD_FAULTS", "step:hang@1")
    config = load_config(write_config(tmp_path / "kvd.toml"))
    executors: list[SimulatedExecutor] = []
    daemon = Daemon(
        config,
        loader=simulated_loader(executors, in_thread=True),
        describe_device=lambda: DEVICE,
        exit_process=lambda code: None,
    )
    codes: list[int] = []

    async def run() -> None:
        codes.append(await daemon.run())

    with structlog.testing.capture_logs() as logs:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run)
            await until(
                lambda: any(e["event"] == "lifecycle.calibrating" for e in logs), "calibrating"
            )
            ready = await daemon.http_app.test_client().get("/ready")
            assert ready.status_code == 503
            body = await ready.get_json()
            assert body["status"] == "loading" and "lifecycle.calibrating" in body["reason"]
            status = await trio.run_process(
                [sys.executable, "-m", "kvctl.cli", "--socket", str(daemon.admin_socket), "status"],
                capture_stdout=True,
                capture_stderr=True,
                check=False,
            )
            assert status.returncode == 1
            said = status.stderr.decode()
            assert "kvd is not ready (loading)" in said and "calibrating" in said, said
            refused = await daemon.http_app.test_client().post(
                "/v1/completions",
                json={"model": "random", "prompt": "x", "max_tokens": 2},
                headers={"Authorization": f"Bearer {ALICE}"},
            )
            assert refused.status_code == 503
            assert (await refused.get_json())["error"]["code"] == "loading"
            daemon.stop()
        executors[-1].unhang.set()  # the abandoned load thread ends too
    assert codes == [0]
    assert not any(e["event"] == "lifecycle.ready" for e in logs)


# hypercorn leaves the socket whose bind failed (the address in use) to the
# garbage collector: a process exits there, this test process warns.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_start_up_failures_say_why_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each expected failure of a start is one message for the command line
    (``kvd: error: ...``, exit 1; test_processes.py runs one such start):
    reservations the pool cannot honour (refused by the real loader before
    anything is compiled), an address in use, a malformed or unauthorised
    fault spec (refused before anything is loaded)."""

    async def failure(config_path: Path, **kw: Any) -> tuple[str | None, list[Any]]:
        daemon = Daemon(
            load_config(config_path),
            describe_device=lambda: DEVICE,
            exit_process=lambda c: None,
            **kw,
        )
        with structlog.testing.capture_logs() as logs:
            try:
                await daemon.run()
            except BaseException as exc:  # noqa: BLE001  # the CLI's catch
                return startup_failure(exc), logs
        raise AssertionError("the start did not fail")

    over = write_config(tmp_path / "over.toml")
    over.write_text(over.read_text().replace('reservation = "25%"', 'reservation = "60%"'))
    said, logs = await failure(over, loader=load_engine)
    assert said is not None and "reservations would total" in said
    names = [e["event"] for e in logs]
    assert "lifecycle.pool" in names and "lifecycle.warmup" not in names  # nothing compiled

    ok = write_config(tmp_path / "ok.toml")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        said, _ = await failure(
            ok, listen=f"127.0.0.1:{port}", loader=simulated_loader([], in_thread=True)
        )
    assert said is not None and "in use" in said
    gc.collect()  # hypercorn's lost socket is closed here, under this test's filter

    for env, says in (
        ({"KVD_FAULTS": "step:raise@1"}, "for kvd's test suite only"),
        ({"KVD_TESTING": "1", "KVD_FAULTS": "step:explode"}, "step cannot 'explode'"),
        ({"KVD_TESTING": "1", "KVD_FAULTS": "disk:raise"}, "unknown point 'disk'"),
    ):
        monkeypatch.delenv("KVD_TESTING", raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        said, logs = await failure(ok, loader=simulated_loader([], in_thread=True))
        assert said is not None and says in said, said
        assert "lifecycle.loading" not in [e["event"] for e in logs]  # before loading anything


async def test_the_fault_endpoint_exists_only_under_test(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without KVD_FAULTS (armed as the daemon's start arms it) the admin API
    has no /v1/faults; with it (and KVD_TESTING=1) faults are armed live."""
    monkeypatch.delenv("KVD_FAULTS", raising=False)
    assert faults.arm_from_environment() is None
    async with serving(tmp_path) as served:
        code, _ = await served.admin_json("post", "/v1/faults", {"spec": "step:raise"})
        assert code == 404
    monkeypatch.setenv("KVD_TESTING", "1")
    monkeypatch.setenv("KVD_FAULTS", "")
    assert faults.arm_from_environment() is not None
    async with serving(tmp_path) as served:
        code, body = await served.admin_json("post", "/v1/faults", {"spec": "step:slow@9"})
        assert code == 200 and "slow" in body["faults"], body
        code, body = await served.admin_json("post", "/v1/faults", {"spec": "step:explode"})
        assert code == 400 and "explode" in json.dumps(body), body


async def test_what_start_up_built_is_frozen_out_of_full_collections(tmp_path: Path) -> None:
    """A full collection walks every tracked object; what start-up built is
    frozen before the daemon is ready (and ``lifecycle.ready`` counts it), so
    the passes that run mid-step walk only what serving made since."""
    async with serving(tmp_path, freeze_at_ready=True) as served:
        ready = served.named("lifecycle.ready")[0]
        assert ready["frozen_objects"] > 1000 and gc.get_freeze_count() > 1000
        # The runtime, built at start-up, is among the frozen.
        assert not any(obj is served.daemon.runtime for obj in gc.get_objects())
    assert gc.get_freeze_count() == 0  # unfrozen on the way out, as Daemon.run does
