"""The fault matrix: each row of the README's fault table, injected into a real
daemon (``KVD_FAULTS`` with ``KVD_TESTING=1``, the admin API's test-only
``/v1/faults``, or the real thing: a signal, a removed directory, a damaged
cache), ending in its written-down behaviour.

Two kinds of ending. A fault of one request's own, or one kvd recovers from,
leaves the daemon serving: every request is answered, the pool is whole, a
greedy request answers as it did before the fault. A fault of the engine
fails the daemon fast: every request in flight is answered with an error
within a second, /ready says why, and the process exits 1 within seconds, to
be restarted with its persisted state.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.conftest import (
    ALICE,
    BOB,
    DaemonEnv,
    DaemonProcess,
    serve_until_exit,
    wait_until,
    write_config,
)
from tests.server.test_admin import kvctl

MODEL = "random"
DAVE = "kvd-test-dave"
PROMPT = "the fault matrix asks the same question twice:"
ANSWERED_WITHIN_S = 5.0  # the bound: every request answered this soon after a fault


def fault_env(daemon_env: DaemonEnv, spec: str = "") -> DaemonEnv:
    return daemon_env | {"KVD_TESTING": "1", "KVD_FAULTS": spec}


def arm(daemon: DaemonProcess, spec: str) -> None:
    """Arm ``spec`` in a running daemon (counts start afresh; "" disarms)."""
    transport = httpx.HTTPTransport(uds=str(daemon.admin_socket))
    with httpx.Client(transport=transport, base_url="http://kvd", timeout=30) as admin:
        response = admin.post("/v1/faults", json={"spec": spec})
    assert response.status_code == 200, response.text


def complete(
    daemon: DaemonProcess, prompt: str = PROMPT, max_tokens: int = 24, key: str = ALICE
) -> httpx.Response:
    return httpx.post(
        f"{daemon.url}/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
    )


def text_of(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


def stream_events(
    daemon: DaemonProcess, prompt: str, max_tokens: int, out: dict[str, Any], key: str = ALICE
) -> None:
    """A streamed completion; ``out`` gets its data lines and when it ended."""
    lines: list[str] = []
    out["lines"] = lines
    try:
        with httpx.stream(
            "POST",
            f"{daemon.url}/v1/completions",
            json={
                "model": MODEL,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "stream": True,
            },
            headers={"Authorization": f"Bearer {key}"},
            timeout=60,
        ) as response:
            out["status"] = response.status_code
            if response.status_code != 200:
                out["error"] = json.loads(response.read())["error"]
            for line in response.iter_lines():
                if line.startswith("data: "):
                    lines.append(line.removeprefix("data: "))
                    out.setdefault("first_at", time.monotonic())
    except httpx.HTTPError as exc:
        out["transport_error"] = repr(exc)
    out["ended_at"] = time.monotonic()


def error_event(out: dict[str, Any]) -> dict[str, Any]:
    """The error a stream ended with (and no [DONE] after it), or the error
    body of a request refused before its stream began."""
    if "error" in out:
        return out["error"]  # type: ignore[no-any-return]
    assert out.get("lines"), out
    assert "[DONE]" not in out["lines"], out["lines"][-3:]
    last = json.loads(out["lines"][-1])
    assert "error" in last, out["lines"][-3:]
    return last["error"]  # type: ignore[no-any-return]


def assert_whole(daemon: DaemonProcess, before: str) -> None:
    """After a recoverable fault: no page held, and greedy answers as before."""
    daemon.wait_pages_released()
    assert text_of(complete(daemon)) == before


# -- faults kvd recovers from: one daemon, a fault armed per test ------------------------


@pytest.fixture(scope="module")
def faulty(
    tmp_path_factory: pytest.TempPathFactory, daemon_env: DaemonEnv
) -> Iterator[DaemonProcess]:
    """A tiny-model daemon that accepts faults armed at run time; its pool
    (32 pages of 16 tokens) makes four 150-token requests preempt each other."""
    config = write_config(tmp_path_factory.mktemp("faulty") / "kvd.toml", pool="128KiB")
    daemon = DaemonProcess(config, fault_env(daemon_env))
    yield daemon
    assert daemon.terminate() == 0, daemon.tail()


@pytest.fixture(scope="module")
def before(faulty: DaemonProcess) -> str:
    return text_of(complete(faulty))


@pytest.fixture
def disarm(faulty: DaemonProcess) -> Iterator[None]:
    yield
    arm(faulty, "")


def test_a_fault_of_one_sequence_fails_that_request_alone(
    faulty: DaemonProcess, before: str, disarm: None
) -> None:
    prompts = [f"request {i} of three asks about the weather in" for i in range(3)]
    alone = [text_of(complete(faulty, p)) for p in prompts]
    arm(faulty, "sequence:raise@2")
    results: list[httpx.Response | None] = [None] * 3
    threads = [
        threading.Thread(target=lambda i=i: results.__setitem__(i, complete(faulty, prompts[i])))
        for i in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    failed = [r for r in results if r is not None and r.status_code != 200]
    assert len(failed) == 1, [r.text for r in results if r is not None]
    error = failed[0].json()["error"]
    assert failed[0].status_code == 500 and error["code"] == "request_failed", error
    assert "injected" in error["message"]
    for response, expected in zip(results, alone, strict=True):
        if response is not None and response.status_code == 200:
            assert text_of(response) == expected  # the others ran as if nothing happened
    wait_until(lambda: faulty.named("request.failed"), "request.failed logged")
    assert_whole(faulty, before)


def test_a_request_whose_prompt_cannot_be_tokenized_fails_alone(
    faulty: DaemonProcess, before: str, disarm: None
) -> None:
    arm(faulty, "tokenize:raise@1")
    refused = complete(faulty)
    assert refused.status_code == 500, refused.text
    error = refused.json()["error"]
    assert error["code"] == "request_failed" and "prompt into tokens" in error["message"]
    wait_until(
        lambda: any(
            "prompt into tokens" in e["error"] and e["tenant"] == "alice"
            for e in faulty.named("request.failed")
        ),
        "request.failed logged with its tenant",
    )
    assert_whole(faulty, before)


def test_a_request_whose_text_cannot_be_made_fails_alone(
    faulty: DaemonProcess, before: str, disarm: None
) -> None:
    arm(faulty, "detokenize:raise@1")
    out: dict[str, Any] = {}
    stream_events(faulty, PROMPT, 16, out)
    assert out["status"] == 200
    error = error_event(out)
    assert error["code"] == "request_failed" and "text" in error["message"], error
    assert_whole(faulty, before)


def test_a_failed_swap_copy_recomputes_instead(
    faulty: DaemonProcess, before: str, disarm: None
) -> None:
    prompts = [f"sequence {i} of four grows long while the pool is small" for i in range(4)]
    alone = [text_of(complete(faulty, p, 150)) for p in prompts]
    arm(faulty, "d2h:fail@1+")  # every device-to-host copy fails
    results: list[httpx.Response | None] = [None] * 4
    threads = [
        threading.Thread(
            target=lambda i=i: results.__setitem__(
                i, complete(faulty, prompts[i], 150, key=ALICE if i % 2 else BOB)
            )
        )
        for i in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [text_of(r) for r in results if r is not None] == alone

    def failed_swaps() -> list[dict[str, Any]]:
        return [e for e in faulty.named("kv.copy_failed") if e["kind"] == "swap_out"]

    wait_until(failed_swaps, "a failed swap-out logged (else the pool is too large to preempt)")
    failed = failed_swaps()
    assert faulty.metrics()['kvd_copy_failures_total{kind="swap_out"}'] >= len(failed)
    assert_whole(faulty, before)


@pytest.mark.parametrize("kind", ["enospc", "readonly"])
def test_a_state_file_that_cannot_be_written_refuses_the_change(
    faulty: DaemonProcess, before: str, disarm: None, kind: str
) -> None:
    status = json.loads(kvctl(faulty, "status", "--json").stdout)
    state_file = Path(status["state"]["file"])
    saved = state_file.read_bytes() if state_file.exists() else None
    arm(faulty, f"statefile:{kind}@1")
    added = kvctl(faulty, "tenant", "add", "dave", "--key", DAVE)
    assert added.returncode == 1, added.stdout
    reason = "No space left" if kind == "enospc" else "Read-only file system"
    assert "the change was undone" in added.stderr and reason in added.stderr, added.stderr
    # Nothing half-written, nothing half-applied.
    assert (state_file.read_bytes() if state_file.exists() else None) == saved
    assert not [p.name for p in state_file.parent.iterdir() if p.name.endswith(".tmp")]
    tenants = json.loads(kvctl(faulty, "tenant", "list", "--json").stdout)
    assert "dave" not in [t["name"] for t in tenants]
    assert complete(faulty, key=DAVE).status_code == 401
    # The disk is back: the same change goes through, and is undone for the next test.
    arm(faulty, "")
    assert kvctl(faulty, "tenant", "add", "dave", "--key", DAVE).returncode == 0
    assert kvctl(faulty, "tenant", "remove", "dave").returncode == 0
    assert_whole(faulty, before)


def test_a_removed_admin_socket_directory_is_made_again(faulty: DaemonProcess, before: str) -> None:
    shutil.rmtree(faulty.admin_socket.parent)
    faulty.wait_for("admin.socket_lost", timeout=30)
    faulty.wait_for("admin.socket_restored", timeout=30)
    wait_until(
        lambda: kvctl(faulty, "status", "--json").returncode == 0, "kvctl reaches the daemon"
    )
    assert_whole(faulty, before)


def test_a_client_vanishing_mid_stream_leaks_nothing(
    faulty: DaemonProcess, before: str, disarm: None
) -> None:
    # Slow steps keep the request generating long after the client is gone
    # (CI once saw the tiny model finish 200 tokens before the hang-up was
    # noticed, which ends the request as "length").
    arm(faulty, "step:slow@1+")
    host, port = faulty.url.removeprefix("http://").split(":")
    body = json.dumps(
        {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "temperature": 0, "stream": True}
    ).encode()
    finished = len(faulty.named("request.finish"))
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {ALICE}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        received = b""
        while b"data: " not in received:  # streaming: then the client is gone
            chunk = sock.recv(4096)
            assert chunk, received
            received += chunk
    faulty.wait_count("request.finish", finished + 1)
    assert faulty.named("request.finish")[-1]["outcome"] == "disconnected"
    assert_whole(faulty, before)


# -- faults of the engine: the daemon fails fast and is restarted ------------------------


def poll_ready(daemon: DaemonProcess, seen: list[tuple[int, str]], stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            response = httpx.get(f"{daemon.url}/ready", timeout=2)
            seen.append((response.status_code, response.text))
        except httpx.HTTPError:
            seen.append((0, "unreachable"))
        stop.wait(0.02)  # a sampling pace, ended at once by the stop


def notify_receiver() -> tuple[str, list[str], threading.Event, threading.Thread]:
    path = f"{tempfile.mkdtemp(prefix='kvd-', dir='/tmp')}/notify"
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(path)
    receiver.settimeout(0.2)
    messages: list[str] = []
    stop = threading.Event()

    def receive() -> None:
        with receiver:
            while not stop.is_set():
                try:
                    messages.append(receiver.recv(4096).decode())
                except TimeoutError:
                    continue

    thread = threading.Thread(target=receive)
    thread.start()
    return path, messages, stop, thread


@pytest.mark.parametrize("fault", ["step:raise@3", "step:hang@3"])
def test_an_engine_failure_answers_everyone_and_exits_1_then_restarts_whole(
    tmp_path: Path, daemon_env: DaemonEnv, fault: str
) -> None:
    cause = "StepTimeout" if fault.startswith("step:hang") else "InjectedFault"
    notify_path, messages, stop_notify, notify_thread = notify_receiver()
    config = write_config(tmp_path / "kvd.toml")
    if fault.startswith("step:hang"):  # a lost device: no step comes back
        config.write_text(
            config.read_text().replace("hard_deadline", "step_timeout = 2.0\nhard_deadline")
        )
    daemon = DaemonProcess(config, fault_env(daemon_env) | {"NOTIFY_SOCKET": notify_path})
    restarted: DaemonProcess | None = None
    try:
        # An admin change before the fault: persisted, so the restart has it.
        assert kvctl(daemon, "tenant", "add", "dave", "--key", DAVE).returncode == 0
        before = text_of(complete(daemon))
        seen: list[tuple[int, str]] = []
        stop_polling = threading.Event()
        poller = threading.Thread(target=poll_ready, args=(daemon, seen, stop_polling))
        poller.start()
        arm(daemon, fault)
        streams = [{} for _ in range(3)]  # type: list[dict[str, Any]]
        threads = [
            threading.Thread(target=stream_events, args=(daemon, f"{PROMPT} {i}", 200, out))
            for i, out in enumerate(streams)
        ]
        for thread in threads:
            thread.start()
        failed_at = daemon.wait_for("lifecycle.failed", timeout=60)
        seen_at_failure = time.monotonic()
        for thread in threads:
            thread.join(timeout=30)
        code = daemon.proc.wait(timeout=30)
        exited_at = time.monotonic()
        stop_polling.set()
        poller.join()

        assert code == 1, daemon.tail()
        assert exited_at - seen_at_failure < 10  # "within a few seconds" (the deadline is 5)
        for out in streams:
            if "transport_error" in out:  # sent after the listener closed: refused, not hung
                continue
            assert out["ended_at"] - seen_at_failure < ANSWERED_WITHIN_S
            error = error_event(out)
            assert error["code"] == "engine_failed" and cause in error["message"]
        assert any(status == 200 for status, _ in seen)
        failed_ready = [json.loads(text) for status, text in seen if status == 503]
        assert failed_ready and failed_ready[-1]["status"] == "failed"
        assert cause in failed_ready[-1]["reason"]
        after_failure = seen[[s for s, _ in seen].index(503) :]
        assert all(status != 200 for status, _ in after_failure)  # never ready again
        assert cause in failed_at["error"] and failed_at["exit_status"] == 1
        if fault.startswith("step:hang"):
            assert "did not finish within 2 s" in failed_at["error"]
        assert any(m.startswith("STOPPING=1") and "failed" in m for m in messages), messages
        assert daemon.named("engine.failed")

        # What systemd's Restart= does: the same config, the state it persisted.
        restarted = DaemonProcess(config, daemon_env)
        assert text_of(complete(restarted, key=DAVE)) == before
        status = json.loads(kvctl(restarted, "status", "--json").stdout)
        assert status["engine_failures"]["count"] == 1
        assert cause in status["engine_failures"]["last_cause"]
        human = kvctl(restarted, "status").stdout
        assert "engine failures recorded: 1" in human, human
        assert restarted.metrics()["kvd_engine_failures_total"] == 1
        restarted.wait_pages_released()
        assert restarted.terminate() == 0
    finally:
        stop_notify.set()
        notify_thread.join()
        daemon.kill()
        if restarted is not None:
            restarted.kill()


def test_a_step_that_always_fails_never_serves_and_exits_1(
    tmp_path: Path, daemon_env: DaemonEnv
) -> None:
    """Every step raising (a broken device) ends the start at warm-up's first
    measured step: one line, exit 1, and systemd's start limit ends the restarts."""
    result = serve_until_exit(
        write_config(tmp_path / "k.toml"), fault_env(daemon_env, "step:raise@1+"), timeout=300
    )
    assert result.returncode == 1
    assert "kvd: error:" in result.stderr and "injected" in result.stderr, result.stderr[-2000:]
    events = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    names = [e["event"] for e in events]
    assert "lifecycle.failed" in names and "lifecycle.ready" not in names


def test_kvctl_and_ready_say_why_a_daemon_is_not_ready(
    tmp_path: Path, daemon_env: DaemonEnv
) -> None:
    """A device that hangs in the start's first measured step: the daemon
    stays loading, says so (and what it is doing) on /ready and to kvctl, and
    a SIGTERM still ends it."""
    config = write_config(tmp_path / "kvd.toml")
    daemon = DaemonProcess(config, fault_env(daemon_env, "step:hang@1"), wait_ready=False)
    try:
        daemon.wait_for("lifecycle.calibrating", timeout=300)
        ready = httpx.get(f"{daemon.url}/ready", timeout=10)
        assert ready.status_code == 503
        assert ready.json()["status"] == "loading"
        assert "lifecycle.calibrating" in ready.json()["reason"]
        status = kvctl(daemon, "status")
        assert status.returncode == 1
        assert "kvd is not ready (loading)" in status.stderr, status.stderr
        assert "calibrating" in status.stderr
        refused = complete(daemon)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "loading"
        assert daemon.terminate() == 0
    finally:
        daemon.kill()


def test_fault_injection_is_refused_outside_tests(tmp_path: Path, daemon_env: DaemonEnv) -> None:
    config = str(write_config(tmp_path / "k.toml"))
    for env, says in (
        (daemon_env | {"KVD_FAULTS": "step:raise@1"}, "for kvd's test suite only"),
        (fault_env(daemon_env, "step:explode"), "step cannot 'explode'"),
        (fault_env(daemon_env, "disk:raise"), "unknown point 'disk'"),
    ):
        result = serve_until_exit(config, env)
        assert result.returncode == 1 and says in result.stderr, result.stderr[-1000:]
        assert "lifecycle.warmup" not in result.stdout  # refused before loading anything


def test_sigkill_mid_step_then_restart_loses_no_admin_change(
    tmp_path: Path, daemon_env: DaemonEnv
) -> None:
    config = write_config(tmp_path / "kvd.toml")
    daemon = DaemonProcess(config, daemon_env)
    restarted: DaemonProcess | None = None
    try:
        assert kvctl(daemon, "tenant", "add", "dave", "--key", DAVE).returncode == 0
        assert kvctl(daemon, "tenant", "set", "bob", "--weight", "3").returncode == 0
        before = text_of(complete(daemon))
        # A second daemon on the same admin socket is refused, the first untouched.
        second = serve_until_exit(config, daemon_env)
        assert second.returncode == 1
        assert "another daemon is listening on this admin socket" in second.stderr, second.stderr
        assert kvctl(daemon, "status", "--json").returncode == 0
        # Without KVD_FAULTS the test-only endpoint does not exist.
        transport = httpx.HTTPTransport(uds=str(daemon.admin_socket))
        with httpx.Client(transport=transport, base_url="http://kvd") as admin:
            assert admin.post("/v1/faults", json={"spec": "step:raise"}).status_code == 404
        out: dict[str, Any] = {}
        reader = threading.Thread(target=stream_events, args=(daemon, PROMPT, 200, out))
        reader.start()
        wait_until(lambda: "first_at" in out, "tokens streaming")
        daemon.proc.send_signal(signal.SIGKILL)  # the engine is mid-generation
        daemon.proc.wait(timeout=30)
        reader.join(timeout=30)
        assert not reader.is_alive()
        assert "[DONE]" not in out["lines"]  # the stream broke; it did not finish
        restarted = DaemonProcess(config, daemon_env)  # the stale admin socket is replaced
        tenants = {
            t["name"]: t for t in json.loads(kvctl(restarted, "tenant", "list", "--json").stdout)
        }
        assert "dave" in tenants and tenants["bob"]["weight"] == 3
        assert text_of(complete(restarted, key=DAVE)) == before
        restarted.wait_pages_released()
        assert restarted.terminate() == 0
    finally:
        daemon.kill()
        if restarted is not None:
            restarted.kill()


def test_a_damaged_compile_cache_costs_a_compile_not_the_service(
    tmp_path: Path, daemon_env: DaemonEnv, kvd_cache: Path
) -> None:
    """Every compiled program in the cache is garbage: the start compiles
    them again, replaces the entries, and serves the same answers. (In the
    session's own cache, restored after: JAX's entries are bound to the
    directory they were written in, so a copy would be no cache at all.)"""
    xla = kvd_cache / "xla"
    config = write_config(tmp_path / "kvd.toml")
    daemon = DaemonProcess(config, daemon_env)  # the entries this config needs exist
    expected = text_of(complete(daemon))
    assert daemon.terminate() == 0
    backup = tmp_path / "xla-backup"
    shutil.copytree(xla, backup)
    garbage = b"not a compiled program"
    try:
        for entry in xla.iterdir():
            entry.write_bytes(garbage)
        daemon = DaemonProcess(config, daemon_env)
        try:
            dropped = daemon.named("engine.compile_cache_entry_dropped")
            assert dropped and sum(e["dropped"] for e in dropped) >= len(dropped)
            assert text_of(complete(daemon)) == expected
            assert daemon.terminate() == 0
        finally:
            daemon.kill()
        # Healed: what the start read is written again, whole.
        rewritten = [p for p in xla.iterdir() if p.read_bytes() != garbage]
        assert len(rewritten) >= len(dropped)
    finally:
        shutil.rmtree(xla)
        shutil.move(backup, xla)
