"""Clients that hang up, and shutdown: drain, abort, exit status and deadlines."""

from __future__ import annotations

import json
import random
import signal
import socket
import tempfile
import threading
import time
from typing import Any

import httpx

from tests.server.conftest import ALICE, BOB, DaemonProcess, serve_until_exit, wait_until

MODEL = "random"


def stream_request(body: dict[str, Any], key: str = ALICE) -> tuple[bytes, dict[str, str]]:
    payload = json.dumps({"model": MODEL, "stream": True} | body).encode()
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    return payload, headers


def raw_stream(
    daemon: DaemonProcess, body: dict[str, Any], *, rcvbuf: int | None = None
) -> socket.socket:
    """Open a streaming request on a plain socket (so the test controls reading)."""
    host, port = daemon.url.removeprefix("http://").split(":")
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect((host, int(port)))
    payload, headers = stream_request(body)
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    sock.sendall(
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n{head}"
        f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    return sock


def test_disconnecting_clients_leak_nothing(tiny_daemon: DaemonProcess) -> None:
    baseline = tiny_daemon.metrics()
    rng = random.Random(7)
    sockets = []
    for i in range(20):
        sock = raw_stream(tiny_daemon, {"prompt": f"client {i} says", "max_tokens": 200})
        sockets.append((sock, rng.uniform(0.0, 1.5), rng.random() < 0.5))
    started = time.monotonic()
    for sock, at, read_first in sorted(sockets, key=lambda s: s[1]):
        time.sleep(max(0.0, started + at - time.monotonic()))
        if read_first:
            sock.recv(4096)
        sock.close()  # hang up mid-stream (or before the first token)
    tiny_daemon.wait_pages_released(timeout=10)
    after = tiny_daemon.metrics()
    assert after['kvd_pool_pages{state="used"}'] == baseline['kvd_pool_pages{state="used"}'] == 0
    finished = tiny_daemon.named("request.finish")
    assert sum(1 for e in finished if e["outcome"] == "disconnected") >= 15
    # And it still serves.
    response = httpx.post(
        f"{tiny_daemon.url}/v1/completions",
        json={"model": MODEL, "prompt": "still there?", "max_tokens": 4},
        headers={"Authorization": f"Bearer {BOB}"},
        timeout=30,
    )
    assert response.status_code == 200


def read_stream(daemon: DaemonProcess, body: dict[str, Any], out: dict[str, Any]) -> None:
    payload, headers = stream_request(body)
    lines: list[str] = []
    try:
        with httpx.stream(
            "POST", f"{daemon.url}/v1/completions", content=payload, headers=headers, timeout=60
        ) as response:
            out["status"] = response.status_code
            for line in response.iter_lines():
                if line:
                    lines.append(line)
    except httpx.HTTPError as exc:
        out["error"] = repr(exc)
    out["lines"] = lines


def test_sigterm_drains_streams_then_exits_zero(start_daemon: Any) -> None:
    daemon: DaemonProcess = start_daemon(drain_timeout=4.0, max_model_len=2048)
    results: list[dict[str, Any]] = [{} for _ in range(10)]
    threads = []
    for i, out in enumerate(results):
        # Eight short streams and two far longer than the drain timeout.
        tokens = 30 if i < 8 else 2000
        body = {"prompt": f"stream {i}", "max_tokens": tokens, "temperature": 0}
        threads.append(threading.Thread(target=read_stream, args=(daemon, body, out)))
    for thread in threads:
        thread.start()
    daemon.wait_count("request.accepted", 10)  # every stream admitted
    sent = time.monotonic()
    daemon.proc.send_signal(signal.SIGTERM)
    daemon.wait_for("lifecycle.draining")
    refused = httpx.post(
        f"{daemon.url}/v1/completions",
        json={"model": MODEL, "prompt": "late", "max_tokens": 2},
        headers={"Authorization": f"Bearer {ALICE}"},
        timeout=10,
    )
    assert refused.status_code == 503 and "Retry-After" in refused.headers
    assert httpx.get(f"{daemon.url}/ready").status_code == 503
    code = daemon.proc.wait(timeout=30)
    elapsed = time.monotonic() - sent
    for thread in threads:
        thread.join(timeout=10)
    assert code == 0, daemon.tail()
    assert elapsed < 4.0 + 1.5 + 2.5, elapsed  # drain + hard deadline + a busy exit
    for out in results[:8]:
        assert out["lines"][-1] == "data: [DONE]", out
    for out in results[8:]:  # cut at the drain timeout: an error event, no [DONE]
        assert out["lines"][-1] != "data: [DONE]"
        assert "aborted" in out["lines"][-1]
    drained = daemon.wait_for("lifecycle.drained")
    assert drained["clean"] and drained["used_pages"] == 0
    assert daemon.wait_for("lifecycle.stopped")["used_pages"] == 0


def test_a_client_that_stops_reading_cannot_hold_shutdown(start_daemon: Any) -> None:
    daemon: DaemonProcess = start_daemon(drain_timeout=1.0, max_model_len=2048)
    # Tiny receive windows and long streams with logprobs: the server's sends block.
    stuck = [
        raw_stream(
            daemon,
            {"prompt": f"never read {i}", "max_tokens": 2000, "logprobs": 0},
            rcvbuf=1024,
        )
        for i in range(4)
    ]
    daemon.wait_count("request.accepted", 4)
    # Far more than the socket buffers hold (a logprobs chunk is ~200 bytes).
    wait_until(
        lambda: (
            daemon.metrics().get('kvd_tenant_completion_tokens_total{tenant="alice"}', 0) >= 4 * 300
        ),
        "the streams ran past their socket buffers",
    )
    sent = time.monotonic()
    daemon.proc.send_signal(signal.SIGTERM)
    code = daemon.proc.wait(timeout=30)
    elapsed = time.monotonic() - sent
    for sock in stuck:
        sock.close()
    # drain_timeout 1.0 + hard_deadline 1.5, plus process exit (slow when busy).
    assert elapsed < 1.0 + 1.5 + 2.5, elapsed
    assert code == 0, daemon.tail()
    assert daemon.wait_for("lifecycle.drained")["clean"]
    # Whether the sends really blocked depends on the kernel's buffer sizing;
    # when they did, the hard deadline is what ended the process.
    for event in daemon.named("lifecycle.hard_exit"):
        assert event["clean"]


def test_second_signal_exits_at_once(start_daemon: Any) -> None:
    daemon: DaemonProcess = start_daemon(drain_timeout=30.0, max_model_len=2048)
    out: dict[str, Any] = {}
    body = {"prompt": "long", "max_tokens": 2000}
    thread = threading.Thread(target=read_stream, args=(daemon, body, out))
    thread.start()
    daemon.wait_count("request.accepted", 1)
    daemon.proc.send_signal(signal.SIGTERM)
    daemon.wait_for("lifecycle.draining")
    sent = time.monotonic()
    daemon.proc.send_signal(signal.SIGINT)
    code = daemon.proc.wait(timeout=10)
    assert time.monotonic() - sent < 5.0  # at once, against a 30 s drain
    assert code == 1
    thread.join(timeout=10)


def test_bounded_load_run(daemon_env: dict[str, str], monkeypatch: Any) -> None:
    """`kvd bench http` in small: no 5xx, every stream complete, no page leaked."""
    from kvd.bench.http import render, run_http_load

    monkeypatch.setenv("KVD_CACHE_DIR", daemon_env["KVD_CACHE_DIR"])
    report = run_http_load("random", 12, 4.0, 16, inprocess=False, log=lambda _: None)
    print(render(report))
    assert report.requests > 12
    assert report.errors_5xx == report.errors_other == report.incomplete_streams == 0
    assert report.leaked_pages == 0


def test_startup_failures_are_one_line_and_exit_1(
    tmp_path: Any, daemon_env: dict[str, str]
) -> None:
    from tests.server.conftest import write_config

    config = write_config(tmp_path / "over.toml").read_text()
    config = config.replace('reservation = "25%"', 'reservation = "60%"')
    (tmp_path / "over.toml").write_text(config)
    result = serve_until_exit(tmp_path / "over.toml", daemon_env)
    assert result.returncode == 1
    assert "kvd: error: reservations would total" in result.stderr
    assert "lifecycle.failed" in result.stdout
    assert "lifecycle.warmup" not in result.stdout  # refused before compiling anything

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = serve_until_exit(
            write_config(tmp_path / "ok.toml"), daemon_env, "--listen", f"127.0.0.1:{port}"
        )
    assert result.returncode == 1
    assert "kvd: error:" in result.stderr and "in use" in result.stderr


def test_systemd_notify_ready_status_watchdog(tmp_path: Any, daemon_env: dict[str, str]) -> None:
    from tests.server.conftest import write_config

    notify_path = f"{tempfile.mkdtemp(prefix='kvd-', dir='/tmp')}/notify"
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(notify_path)
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
    env = daemon_env | {"NOTIFY_SOCKET": notify_path, "WATCHDOG_USEC": "400000"}
    try:
        daemon = DaemonProcess(write_config(tmp_path / "kvd.toml"), env)
        ready_at = time.monotonic()
        wait_until(
            lambda: sum(text == "WATCHDOG=1" for _, text in messages) >= 3,
            "three watchdog pings",
        )
        assert daemon.terminate() == 0
    finally:
        stop.set()
        thread.join()
        receiver.close()
    texts = [text for _, text in messages if text != "WATCHDOG=1"]
    assert texts[0].startswith("STATUS=loading") and texts[1] == "READY=1\nSTATUS=serving"
    texts = [text for _, text in messages]
    ready = [at for at, text in messages if "READY=1" in text]
    assert len(ready) == 1 and ready[0] <= ready_at + 2.0  # slack for a busy machine
    assert sum(text == "WATCHDOG=1" for text in texts) >= 3
    assert any(text.startswith("STOPPING=1") for text in texts)


def test_overload_is_a_503_with_retry_after(start_daemon: Any) -> None:
    daemon: DaemonProcess = start_daemon(max_in_flight=2, max_model_len=2048)
    held = [raw_stream(daemon, {"prompt": f"hold {i}", "max_tokens": 1500}) for i in range(2)]
    try:
        for sock in held:
            sock.recv(1024)  # both admitted and streaming
        response = httpx.post(
            f"{daemon.url}/v1/completions",
            json={"model": MODEL, "prompt": "one more", "max_tokens": 2},
            headers={"Authorization": f"Bearer {BOB}"},
            timeout=30,
        )
        assert response.status_code == 503, response.text
        assert response.json()["error"]["code"] == "overloaded"
        assert int(response.headers["Retry-After"]) >= 1
    finally:
        for sock in held:
            sock.close()
    daemon.wait_pages_released()
