"""The fault matrix in-process: each row of docs/howto/failures.md's fault table,
injected (kvd/faults.py, armed here directly) into the real daemon over the
simulated executor, which reaches the engine's fault points, ending in its
written-down behaviour. The process-level endings (exit 1, the restart, a
signal, kill -9) are in test_processes.py.

Two kinds of ending. A fault of one request's own, or one kvd recovers from,
leaves the daemon serving: every request is answered, the pool is whole, a
greedy request answers as it did before the fault. A fault of the engine
fails the daemon fast: every request in flight is answered with an error,
/ready says why, and the exit (1) is armed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from kvd import faults
from tests.server.conftest import ALICE, BOB
from tests.server.harness import MODEL, Served, serving, until

PROMPT = "the fault matrix asks the same question twice:"
DAVE = "kvd-test-dave"


@pytest.fixture(autouse=True)
def disarmed() -> Iterator[None]:
    faults.armed = None
    yield
    faults.armed = None


def arm(spec: str) -> None:
    faults.armed = faults.parse(spec)


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[Served]:
    """Its pool (32 pages of 16 tokens) makes four 150-token requests
    preempt each other."""
    async with serving(tmp_path, pool="128KiB") as daemon:
        yield daemon


async def text_of(
    served: Served, prompt: str = PROMPT, max_tokens: int = 24, key: str = ALICE
) -> str:
    response = await served.complete(key, prompt, max_tokens=max_tokens)
    body = await response.get_json()
    assert response.status_code == 200, body
    return str(body["choices"][0]["text"])


async def stream_lines(served: Served, prompt: str = PROMPT, max_tokens: int = 16) -> list[Any]:
    response = await served.complete(ALICE, prompt, max_tokens=max_tokens, stream=True)
    assert response.status_code == 200
    lines = (await response.get_data()).decode().split("\n\n")
    return [line.removeprefix("data: ") for line in lines if line]


def error_event(lines: list[str]) -> dict[str, Any]:
    """The error a stream ended with (and no [DONE] after it)."""
    assert "[DONE]" not in lines, lines[-3:]
    last = json.loads(lines[-1])
    assert "error" in last, lines[-3:]
    return last["error"]  # type: ignore[no-any-return]


async def assert_whole(served: Served, before: str) -> None:
    """After a recoverable fault: no page held, and greedy answers as before."""
    await served.assert_whole()
    assert await text_of(served) == before


async def test_a_fault_of_one_sequence_fails_that_request_alone(served: Served) -> None:
    before = await text_of(served)
    prompts = [f"request {i} of three asks about the weather in" for i in range(3)]
    alone = [await text_of(served, p) for p in prompts]
    arm("sequence:raise@2")
    results: list[Any] = [None] * 3

    async def one(i: int) -> None:
        results[i] = await served.complete(ALICE, prompts[i], max_tokens=24)

    async with trio.open_nursery() as nursery:
        for i in range(3):
            nursery.start_soon(one, i)
    failed = [r for r in results if r.status_code != 200]
    assert len(failed) == 1
    error = (await failed[0].get_json())["error"]
    assert failed[0].status_code == 500 and error["code"] == "request_failed", error
    assert "injected" in error["message"]
    for response, expected in zip(results, alone, strict=True):
        if response.status_code == 200:  # the others ran as if nothing happened
            assert (await response.get_json())["choices"][0]["text"] == expected
    assert served.named("request.failed")
    await assert_whole(served, before)


async def test_a_request_whose_prompt_cannot_be_tokenized_fails_alone(served: Served) -> None:
    before = await text_of(served)
    arm("tokenize:raise@1")
    refused = await served.complete(ALICE, PROMPT)
    assert refused.status_code == 500
    error = (await refused.get_json())["error"]
    assert error["code"] == "request_failed" and "prompt into tokens" in error["message"]
    logged = served.named("request.failed")[-1]
    assert "prompt into tokens" in logged["error"] and logged["tenant"] == "alice"
    await assert_whole(served, before)


async def test_a_request_whose_text_cannot_be_made_fails_alone(served: Served) -> None:
    before = await text_of(served)
    arm("detokenize:raise@1")
    error = error_event(await stream_lines(served))
    assert error["code"] == "request_failed" and "text" in error["message"], error
    await assert_whole(served, before)


async def test_a_failed_swap_copy_recomputes_instead(served: Served) -> None:
    before = await text_of(served)
    prompts = [f"sequence {i} of four grows long while the pool is small" for i in range(4)]
    alone = [await text_of(served, p, 150) for p in prompts]
    arm("d2h:fail@1+")  # every device-to-host copy fails
    results: list[str] = [""] * 4

    async def one(i: int) -> None:
        results[i] = await text_of(served, prompts[i], 150, key=ALICE if i % 2 else BOB)

    async with trio.open_nursery() as nursery:
        for i in range(4):
            nursery.start_soon(one, i)
    assert results == alone
    failed = [e for e in served.named("kv.copy_failed") if e["kind"] == "swap_out"]
    assert failed, "no failed swap-out (the pool is too large to preempt)"
    metrics = await served.metrics()
    assert metrics['kvd_copy_failures_total{kind="swap_out"}'] >= len(failed)
    faults.armed = None
    await assert_whole(served, before)


@pytest.mark.parametrize("kind", ["enospc", "readonly"])
async def test_a_state_file_that_cannot_be_written_refuses_the_change(
    served: Served, kind: str
) -> None:
    before = await text_of(served)
    state_file = Path((await served.status())["state"]["file"])
    saved = state_file.read_bytes() if state_file.exists() else None
    arm(f"statefile:{kind}@1")
    entry = {"name": "dave", "api_key_sha256": hashlib.sha256(DAVE.encode()).hexdigest()}
    code, body = await served.admin_json("post", "/v1/tenants", entry)
    reason = "No space left" if kind == "enospc" else "Read-only file system"
    assert code == 500 and "the change was undone" in body["error"] and reason in body["error"]
    # Nothing half-written, nothing half-applied.
    assert (state_file.read_bytes() if state_file.exists() else None) == saved
    assert not [p.name for p in state_file.parent.iterdir() if p.name.endswith(".tmp")]
    code, tenants = await served.admin_json("get", "/v1/tenants")
    assert "dave" not in [t["name"] for t in tenants]
    assert (await served.complete(DAVE)).status_code == 401
    # The disk is back: the same change goes through.
    faults.armed = None
    assert (await served.admin_json("post", "/v1/tenants", entry))[0] == 201
    assert (await served.complete(DAVE)).status_code == 200
    await assert_whole(served, before)


async def raw_stream(served: Served, body: dict[str, Any]) -> trio.SocketStream:
    """A streaming request on a plain socket (so the test controls reading)."""
    host, port = served.address
    stream = await trio.open_tcp_stream(host, port)
    payload = json.dumps({"model": MODEL, "stream": True} | body).encode()
    await stream.send_all(
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {ALICE}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    return stream


async def test_clients_vanishing_mid_stream_or_before_leak_nothing(tmp_path: Path) -> None:
    async with serving(tmp_path, http_socket=True) as served:
        before = await text_of(served)
        for i in range(12):
            stream = await raw_stream(
                served, {"prompt": f"client {i} says", "max_tokens": 200, "temperature": 0}
            )
            if i % 2:  # streaming, then the client is gone; else gone before a token
                received = b""
                while b"data: " not in received:
                    chunk = await stream.receive_some(4096)
                    assert chunk, received
                    received += chunk
            await stream.aclose()
        # Every request that reached a handler ends (one closed before its
        # request was read never does).
        await until(
            lambda: len(served.named("request.finish")) >= len(served.named("request.accepted")),
            "every accepted request finished",
        )
        outcomes = [e["outcome"] for e in served.named("request.finish")[1:]]
        assert outcomes.count("disconnected") >= 6, outcomes
        await assert_whole(served, before)


@pytest.mark.parametrize("fault", ["step:raise@3", "step:hang@3"])
async def test_an_engine_failure_answers_everyone_and_arms_the_exit(
    tmp_path: Path, fault: str
) -> None:
    """Every request in flight gets an error, /ready and kvctl say why, new
    requests are refused, the failure is recorded beside the state file, and
    the exit (1) is armed. A hang is a step that outlives step_timeout."""
    hang = fault.startswith("step:hang")
    cause = "StepTimeout" if hang else "InjectedFault"
    async with serving(
        tmp_path, step_in_thread=hang, extra_server="step_timeout = 0.5" if hang else ""
    ) as served:
        before = await text_of(served)
        arm(fault)
        streams: list[list[str]] = [[] for _ in range(3)]

        async def one(i: int) -> None:
            streams[i] = await stream_lines(served, f"{PROMPT} {i}", 200)

        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(one, i)
        for lines in streams:
            error = error_event(lines)
            assert error["code"] == "engine_failed" and cause in error["message"], error
        await until(  # the step loop's end reaches the daemon
            lambda: served.daemon.failure is not None and served.named("lifecycle.failed"),
            "the daemon heard of the failure",
        )
        ready = await served.http.get("/ready")
        assert ready.status_code == 503
        body = await ready.get_json()
        assert body["status"] == "failed" and cause in body["reason"]
        refused = await served.complete(ALICE, "after")
        assert refused.status_code == 503
        assert (await refused.get_json())["error"]["code"] == "engine_failed"
        code, status = await served.admin_json("get", "/v1/status")
        assert code == 503 and status["state"] == "failed" and cause in status["error"]
        failed = served.named("lifecycle.failed")[-1]
        assert cause in failed["error"] and failed["exit_status"] == 1
        if hang:
            assert "did not finish within 0.5 s" in failed["error"]
        assert served.named("engine.failed")
        assert (await served.metrics())["kvd_engine_failures_total"] == 1
        await until(lambda: served.exits, "the deadline that makes sure it leaves")
        assert served.exits == [1]
    async with serving(tmp_path, config_path=served.config_path) as restarted:
        status = await restarted.status()
        assert status["engine_failures"]["count"] == 1
        assert cause in status["engine_failures"]["last_cause"]
        assert (await restarted.metrics())["kvd_engine_failures_total"] == 1
        assert await text_of(restarted) == before
        await restarted.assert_whole()
