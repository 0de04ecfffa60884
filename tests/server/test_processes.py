"""Real ``kvd serve`` processes, only where the process is the subject:
systemd's notify protocol, signals and the exit status of a drain, kill -9
and the restart from the state file, an engine failure exiting 1 and the
restart after it, the compile cache on disk, a damaged state file refused by
the command line. Everything a daemon does while it serves is tested
in-process (harness.py); these tests check what only a process shows.

The suite's ``kvd serve`` starts, all of them (tests/test_real_270m.py has
one more, the shipped configuration on the real 270M):

1. test_systemd_notify_and_a_sigterm_drain: the daemon systemd sees;
2-5. test_kill_9_then_an_engine_failure_then_a_damaged_cache: the first
   start, its restart after kill -9, the restart after its engine failed
   (over a damaged compile cache), and a start refused for a torn state file;
6. test_an_engine_failing_at_its_first_step_never_serves: the real engine
   failing during the start;
7. test_bench_http_bounded_load: ``kvd bench http`` starts its own daemon.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvd.bench import sse
from kvd.engine.heap import glibc
from tests.conftest import short_dir
from tests.server.conftest import (
    ALICE,
    DaemonEnv,
    DaemonProcess,
    serve_until_exit,
    wait_until,
    write_config,
)

MODEL = "random"
DAVE = "kvd-test-dave"
PROMPT = "the fault matrix asks the same question twice:"
ANSWERED_WITHIN_S = 5.0  # every request answered this soon after an engine failure


def kvctl(daemon: DaemonProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvctl.cli", "--socket", str(daemon.admin_socket), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def status_of(daemon: DaemonProcess) -> dict[str, Any]:
    result = kvctl(daemon, "status", "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)  # type: ignore[no-any-return]


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


@dataclass
class Stream:
    """A streamed completion read in a thread: its data lines and when it ended."""

    status: int | None = None
    lines: list[str] = field(default_factory=list)
    error: dict[str, Any] | None = None
    transport_error: str | None = None
    first_at: float | None = None
    ended_at: float | None = None
    thread: threading.Thread | None = None

    def ended_with_error(self) -> dict[str, Any]:
        """The error the stream ended with (no [DONE] after it), or the error
        body of a request refused before its stream began."""
        if self.error is not None:
            return self.error
        assert self.lines and "[DONE]" not in self.lines, self.lines[-3:]
        last = json.loads(self.lines[-1])
        assert "error" in last, self.lines[-3:]
        return last["error"]  # type: ignore[no-any-return]


def stream(daemon: DaemonProcess, prompt: str, max_tokens: int, key: str = ALICE) -> Stream:
    out = Stream()

    def read() -> None:
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
                out.status = response.status_code
                if response.status_code != 200:
                    out.error = json.loads(response.read())["error"]
                for line in sse.lines(response.iter_text()):
                    if line.startswith("data: "):
                        out.lines.append(line.removeprefix("data: "))
                        if out.first_at is None:
                            out.first_at = time.monotonic()
        except httpx.HTTPError as exc:
            out.transport_error = repr(exc)
        out.ended_at = time.monotonic()

    out.thread = threading.Thread(target=read)
    out.thread.start()
    return out


def join(streams: list[Stream]) -> None:
    for out in streams:
        assert out.thread is not None
        out.thread.join(timeout=60)
        assert not out.thread.is_alive()


def stuck_reader(daemon: DaemonProcess, prompt: str) -> socket.socket:
    """A streamed completion with logprobs (~200 bytes a token) on a socket
    with a tiny receive window that is never read: the server's sends block."""
    host, port = daemon.url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    sock.connect((host, int(port)))
    payload = json.dumps(
        {"model": MODEL, "prompt": prompt, "max_tokens": 2000, "logprobs": 0, "stream": True}
    ).encode()
    sock.sendall(
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n"
        f"Authorization: Bearer {ALICE}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    return sock


@contextmanager
def notify_socket() -> Iterator[tuple[str, list[tuple[float, str]]]]:
    """systemd's end of NOTIFY_SOCKET: (its path, the messages with their times)."""
    path = f"{short_dir()}/notify"
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(path)
    receiver.settimeout(0.2)
    messages: list[tuple[float, str]] = []
    stop = threading.Event()

    def receive() -> None:
        while not stop.is_set():
            try:
                messages.append((time.monotonic(), receiver.recv(4096).decode()))
            except TimeoutError:
                continue

    thread = threading.Thread(target=receive)
    thread.start()
    try:
        yield path, messages
    finally:
        stop.set()
        thread.join()
        receiver.close()


def refused_while_draining(daemon: DaemonProcess) -> None:
    late = httpx.post(
        f"{daemon.url}/v1/completions",
        json={"model": MODEL, "prompt": "late", "max_tokens": 2},
        headers={"Authorization": f"Bearer {ALICE}"},
        timeout=10,
    )
    assert late.status_code == 503 and "Retry-After" in late.headers, late.text
    assert httpx.get(f"{daemon.url}/ready", timeout=10).status_code == 503


def test_systemd_notify_and_a_sigterm_drain(tmp_path: Path, daemon_env: DaemonEnv) -> None:
    """What systemd sees from start to stop, and a SIGTERM's drain: streams
    that finish within drain_timeout end with [DONE], longer ones are cut with
    an error event, clients that stopped reading cannot hold the process past
    the hard deadline, and the exit status is 0 with every page released."""
    config = write_config(tmp_path / "kvd.toml", drain_timeout=3.0, max_model_len=2048)
    with notify_socket() as (notify_path, messages):
        env = daemon_env | {"NOTIFY_SOCKET": notify_path, "WATCHDOG_USEC": "400000"}
        daemon = DaemonProcess(config, env)
        try:
            ready_at = time.monotonic()
            # Ready: start-up's objects frozen, the heap keeping freed memory.
            ready = daemon.wait_for("lifecycle.ready")
            assert ready["frozen_objects"] > 0
            assert ready["heap_kept"] is (glibc() is not None), ready
            wait_until(
                lambda: sum(text == "WATCHDOG=1" for _, text in messages) >= 3,
                "three watchdog pings",
            )
            stuck = [stuck_reader(daemon, f"never read {i}") for i in range(2)]
            daemon.wait_count("request.accepted", 2)
            # Far more than the socket buffers hold (a logprobs chunk is ~200 bytes).
            wait_until(
                lambda: (
                    daemon.metrics().get('kvd_tenant_completion_tokens_total{tenant="alice"}', 0)
                    >= 2 * 300
                ),
                "the stuck streams ran past their socket buffers",
            )
            # Four short streams and two far longer than the drain timeout: with
            # the stuck two, as many as a step runs (max_num_seqs), none waits.
            streams = [stream(daemon, f"stream {i}", 8 if i < 4 else 2000) for i in range(6)]
            daemon.wait_count("request.accepted", 8)
            sent = time.monotonic()
            daemon.proc.send_signal(signal.SIGTERM)
            daemon.wait_for("lifecycle.draining")
            refused_while_draining(daemon)
            code = daemon.proc.wait(timeout=30)
            elapsed = time.monotonic() - sent
            join(streams)
            for sock in stuck:
                sock.close()
        finally:
            daemon.kill()
    assert code == 0, daemon.tail()
    assert elapsed < 3.0 + 1.5 + 2.5, elapsed  # drain + hard deadline + a busy exit
    for out in streams[:4]:
        assert out.lines[-1] == "[DONE]", out
    for out in streams[4:]:  # cut at the drain timeout: an error event, no [DONE]
        assert "aborted" in json.dumps(out.ended_with_error()), out.lines[-3:]
    drained = daemon.wait_for("lifecycle.drained")
    assert drained["clean"] and drained["referenced_pages"] == 0
    # Whether the stuck sends really blocked depends on the kernel's buffer
    # sizing; when they did, the hard deadline is what ended the process.
    for event in daemon.named("lifecycle.hard_exit"):
        assert event["clean"] and event["status"] == 0
    if not daemon.named("lifecycle.hard_exit"):
        assert daemon.wait_for("lifecycle.stopped")["referenced_pages"] == 0

    texts = [text for _, text in messages if text != "WATCHDOG=1"]
    assert texts[0].startswith("STATUS=loading") and texts[1] == "READY=1\nSTATUS=serving"
    ready = [at for at, text in messages if "READY=1" in text]
    assert len(ready) == 1 and ready[0] <= ready_at + 2.0  # slack for a busy machine
    assert any(text.startswith("STOPPING=1") for text in texts)


def poll_ready(daemon: DaemonProcess, seen: list[tuple[int, str]], stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            response = httpx.get(f"{daemon.url}/ready", timeout=2)
            seen.append((response.status_code, response.text))
        except httpx.HTTPError:
            seen.append((0, "unreachable"))
        stop.wait(0.02)  # a sampling pace, ended at once by the stop


def arm(daemon: DaemonProcess, spec: str) -> None:
    """Arm ``spec`` in a running daemon started with KVD_TESTING=1."""
    transport = httpx.HTTPTransport(uds=str(daemon.admin_socket))
    with httpx.Client(transport=transport, base_url="http://kvd", timeout=30) as admin:
        response = admin.post("/v1/faults", json={"spec": spec})
    assert response.status_code == 200, response.text


def test_kill_9_then_an_engine_failure_then_a_damaged_cache(
    tmp_path: Path, daemon_env: DaemonEnv
) -> None:
    """One daemon's life as systemd's Restart= lives it, each restart from
    the state file the last one persisted:

    1. admin changes, then kill -9 mid-generation: the stream breaks;
    2. the restart has every change (and says its state file overrides the
       config); then a step raises: every stream in flight gets an error at
       once, /ready says failed, systemd hears STOPPING=1, the exit is 1;
    3. the restart after the failure, over a compile cache whose every
       entry is garbage: it compiles again, heals the cache, counts the
       recorded failure and answers as before; a second signal during its
       drain exits 1 at once;
    4. a torn state file: the start is refused in one line, exit 1, and the
       file is left as it was.

    The compile cache is this test process's own (no other process reads
    it meanwhile), and it is put back as it was after."""
    cache = Path(daemon_env["KVD_CACHE_DIR"])  # this test process's own (tests/conftest.py)
    env = daemon_env
    config = write_config(tmp_path / "kvd.toml", drain_timeout=30.0, max_model_len=2048)
    first = DaemonProcess(config, env | {"KVD_TESTING": "1", "KVD_FAULTS": ""})
    try:
        for change in (
            ("tenant", "set", "bob", "--reservation", "40%", "--weight", "3"),
            ("sharing", "set", "shared"),
            ("budget", "set", "static"),
            ("tenant", "add", "dave", "--key", DAVE, "--tier", "batch", "--reservation", "5%"),
        ):
            assert kvctl(first, *change).returncode == 0, change
        before = text_of(complete(first))
        out = stream(first, PROMPT, 200)
        wait_until(lambda: out.first_at is not None, "tokens streaming")
        first.proc.send_signal(signal.SIGKILL)  # the engine is mid-generation
        first.proc.wait(timeout=30)
        join([out])
        assert "[DONE]" not in out.lines  # the stream broke; it did not finish
    finally:
        first.kill()

    with notify_socket() as (notify_path, messages):
        second = DaemonProcess(  # the stale admin socket is replaced
            config, env | {"KVD_TESTING": "1", "KVD_FAULTS": "", "NOTIFY_SOCKET": notify_path}
        )
        try:
            data = status_of(second)
            tenants = {t["name"]: t for t in data["tenants"]}
            assert tenants["bob"]["reservation"] == "40%" and tenants["bob"]["weight"] == 3
            assert data["sharing_policy"] == "shared" and data["budget_mode"] == "static"
            overrides = ["tenants", "budget.mode", "sharing.policy"]
            assert data["state"]["restored"]["overrides"] == overrides
            restored = second.wait_for("lifecycle.state_restored")
            assert restored["level"] == "warning" and restored["overrides"] == overrides
            assert "overrides the config's tenants" in kvctl(second, "status").stdout
            assert len(json.loads(kvctl(second, "audit", "--json").stdout)) == 4
            assert text_of(complete(second, key=DAVE)) == before

            seen: list[tuple[int, str]] = []
            stop_polling = threading.Event()
            poller = threading.Thread(target=poll_ready, args=(second, seen, stop_polling))
            poller.start()
            try:
                # the failure must come after a ready answer was seen, or the
                # "never ready again" check below has nothing to compare with
                wait_until(lambda: any(status == 200 for status, _ in seen), "ready seen")
                arm(second, "step:raise@3")
                streams = [stream(second, f"{PROMPT} {i}", 200) for i in range(3)]
                failed_at = second.wait_for("lifecycle.failed", timeout=60)
                seen_at_failure = time.monotonic()
                join(streams)
                code = second.proc.wait(timeout=30)
                exited_at = time.monotonic()
            finally:
                stop_polling.set()
                poller.join()
        finally:
            second.kill()
    assert code == 1, second.tail()
    assert exited_at - seen_at_failure < 10  # "within a few seconds" (the deadline is 5)
    for out in streams:
        if out.transport_error is not None:  # sent after the listener closed: refused
            continue
        assert out.ended_at is not None and out.ended_at - seen_at_failure < ANSWERED_WITHIN_S
        error = out.ended_with_error()
        assert error["code"] == "engine_failed" and "InjectedFault" in error["message"]
    assert any(status == 200 for status, _ in seen)
    after_failure = seen[[s for s, _ in seen].index(503) :]
    assert all(status != 200 for status, _ in after_failure)  # never ready again
    failed_ready = [json.loads(text) for status, text in after_failure if status == 503]
    assert failed_ready[-1]["status"] == "failed"
    assert "InjectedFault" in failed_ready[-1]["reason"]
    assert "InjectedFault" in failed_at["error"] and failed_at["exit_status"] == 1
    texts = [text for _, text in messages]
    assert any(t.startswith("STOPPING=1") and "failed" in t for t in texts), texts

    garbage = b"not a compiled program"
    xla = cache / "xla"
    backup = tmp_path / "xla-backup"
    shutil.copytree(xla, backup)
    entries = list(xla.iterdir())
    assert entries
    for entry in entries:
        entry.write_bytes(garbage)
    third = DaemonProcess(config, env)
    try:
        dropped = third.named("engine.compile_cache_entry_dropped")
        assert dropped and sum(e["dropped"] for e in dropped) >= len(dropped)
        data = status_of(third)
        assert data["engine_failures"]["count"] == 1
        assert "InjectedFault" in data["engine_failures"]["last_cause"]
        assert "engine failures recorded: 1" in kvctl(third, "status").stdout
        assert third.metrics()["kvd_engine_failures_total"] == 1
        assert text_of(complete(third, key=DAVE)) == before
        third.wait_pages_released()
        long = stream(third, "long", 2000)
        third.wait_count("request.accepted", 2)
        third.proc.send_signal(signal.SIGTERM)
        third.wait_for("lifecycle.draining")
        sent = time.monotonic()
        third.proc.send_signal(signal.SIGINT)
        code = third.proc.wait(timeout=10)
        assert time.monotonic() - sent < 5.0  # at once, against a 30 s drain
        join([long])
        # Healed: what the start read is written again, whole.
        rewritten = [p for p in xla.iterdir() if p.read_bytes() != garbage]
        assert len(rewritten) >= len(dropped)
    finally:
        third.kill()
        shutil.rmtree(xla)
        shutil.move(backup, xla)
    assert code == 1

    state = tmp_path / "state.json"
    good = state.read_bytes()
    state.write_bytes(good[: len(good) // 2])  # a torn write
    refused = serve_until_exit(config, env)
    assert refused.returncode == 1
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvd: error: "), refused.stderr
    assert "state file is corrupt" in lines[0] and "state.json.prev" in lines[0]
    assert state.read_bytes() == good[: len(good) // 2]  # nothing overwritten


def test_an_engine_failing_at_its_first_step_never_serves(
    tmp_path: Path, daemon_env: DaemonEnv
) -> None:
    """Every step raising (a broken device) ends the start at warm-up's first
    measured step: one line, exit 1, never ready (systemd's start limit ends
    the restarts)."""
    result = serve_until_exit(
        write_config(tmp_path / "k.toml"),
        daemon_env | {"KVD_TESTING": "1", "KVD_FAULTS": "step:raise@1+"},
        timeout=300,
    )
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("kvd: error:") and "injected" in lines[-1], result.stderr[-2000:]
    events = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    names = [e["event"] for e in events]
    assert "lifecycle.failed" in names and "lifecycle.ready" not in names


def test_bench_http_bounded_load(daemon_env: DaemonEnv, monkeypatch: pytest.MonkeyPatch) -> None:
    """`kvd bench http` in small, on the daemon it starts, drawing at
    temperature 1: no 5xx, every stream complete, no page leaked."""
    from kvd.bench.http import render, run_http_load

    monkeypatch.setenv("KVD_CACHE_DIR", daemon_env["KVD_CACHE_DIR"])
    report = run_http_load(
        "random", 12, 4.0, 16, inprocess=False, log=lambda _: None, temperature=1.0
    )
    print(render(report))
    assert report.requests > 12
    assert report.errors_5xx == report.errors_other == report.incomplete_streams == 0
    assert report.malformed_events == 0
    assert report.leaked_pages == 0
