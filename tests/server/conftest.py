"""The server tests' shared pieces: the demo keys, the tiny config, and a
real ``kvd serve`` in a subprocess on 127.0.0.1 (port 0: the OS picks), its
JSON log lines read from stdout, for the few tests where the process is the
subject (test_processes.py, tests/e2e).

The daemons a test process starts share its cache directory
(tests/conftest.py): the embedded model is assembled once per run and
compiled programs are reused from JAX's persistent cache.
"""

from __future__ import annotations

import hashlib
import json
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from tests.conftest import short_dir

ALICE, BOB, CAROL = "kvd-dev-alice", "kvd-dev-bob", "kvd-test-carol"
DaemonEnv = dict[str, str]


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


TINY_CONFIG = f"""
tiers = ["interactive", "batch"]

[server]
listen = "127.0.0.1:0"
metrics_listen = "127.0.0.1:0"
admin_socket = "{{admin_socket}}"
state_file = "{{state_file}}"
drain_timeout = {{drain_timeout}}
max_in_flight = {{max_in_flight}}
hard_deadline = 1.5
max_body = "64KiB"
step_log_interval = 1.0

[model]
source = "random"
kv_dtype = "{{kv_dtype}}"
max_model_len = {{max_model_len}}
max_num_seqs = {{max_num_seqs}}
max_num_batched_tokens = {{max_num_batched_tokens}}
tensor_parallel = {{tensor_parallel}}

[pool]
size = "{{pool}}"
host_size = "{{host_size}}"

[[tenants]]
name = "alice"
api_key_sha256 = "{digest(ALICE)}"
reservation = "25%"

[[tenants]]
name = "bob"
api_key_sha256 = "{digest(BOB)}"
reservation = "25%"

[[tenants]]
name = "carol"
api_key_sha256 = "{digest(CAROL)}"
tier = "batch"
requests_per_minute = 2
"""


def wait_until(condition: Callable[[], object], what: str, timeout: float = 60) -> None:
    """Poll ``condition`` until it holds: tests wait for states, not for time
    (a busy machine stretches every duration)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.05)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text exposition as {name{labels}: value}."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            values[key] = float(value)
    return values


class DaemonProcess:
    """A running ``kvd serve``; its log events are collected as they come."""

    def __init__(
        self,
        config: Path,
        env: dict[str, str],
        ready_timeout: float = 300,
        wait_ready: bool = True,
        args: tuple[str, ...] = (),
    ) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvd.cli", "serve", "--config", str(config), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            text=True,
        )
        self.events: list[dict[str, Any]] = []
        self._lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.stderr: list[str] = []
        self._readers = [
            threading.Thread(target=self._read_stdout, daemon=True),
            threading.Thread(target=self._read_stderr, daemon=True),
        ]
        for reader in self._readers:
            reader.start()
        try:
            listening = self.wait_for("lifecycle.listening", ready_timeout)
            self.url = listening["addresses"][0]
            self.metrics_url = self.wait_for("lifecycle.metrics_listening")["addresses"][0]
            self.admin_socket = Path(self.wait_for("lifecycle.admin_socket")["path"])
            if wait_ready:
                self.wait_for("lifecycle.ready", ready_timeout)
        except BaseException:
            self.kill()
            raise

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(event, dict):
                continue  # a library's own output that happens to parse (a bare number)
            self.events.append(event)
            self._lines.put(event)
        self._lines.put(None)

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr.append(line)

    def wait_for(self, name: str, timeout: float = 30) -> dict[str, Any]:
        for event in self.events:
            if event.get("event") == name:
                return event
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no {name} within {timeout} s; stderr:\n{self.tail()}")
            try:
                line = self._lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                raise RuntimeError(f"the daemon exited before {name}; stderr:\n{self.tail()}")
            if line.get("event") == name:
                return line

    def tail(self) -> str:
        return "".join(self.stderr[-40:])

    def named(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") == name]

    def wait_count(self, name: str, count: int, timeout: float = 60) -> None:
        """Until ``count`` events named ``name`` have been logged."""
        wait_until(lambda: len(self.named(name)) >= count, f"{count} x {name}", timeout)

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(f"{self.metrics_url}/metrics").text)

    def wait_pages_released(self, timeout: float = 10) -> None:
        """Until no page is in use (the metrics snapshot lags by < 0.3 s)."""
        deadline = time.monotonic() + timeout
        while True:
            metrics = self.metrics()
            if (
                metrics['kvd_pool_pages{state="referenced"}'] == 0
                and metrics["kvd_requests_in_flight"] == 0
            ):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"pages still in use: {metrics}")
            time.sleep(0.1)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        # The readers end at the pipes' EOF; closing a pipe under a reader
        # still in it would raise in its thread.
        for reader in self._readers:
            reader.join(timeout=30)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()

    def terminate(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self.kill()
        return code


def serve_until_exit(
    config: Path | str, env: dict[str, str], *args: str, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """``kvd serve`` run to its end (a start expected to fail), its output kept."""
    return subprocess.run(
        [sys.executable, "-m", "kvd.cli", "serve", "--config", str(config), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def write_config(path: Path, **values: Any) -> Path:
    # Unix socket paths are limited to 107 bytes: keep them out of pytest's
    # long temporary paths.
    socket_dir = short_dir()
    settings = {
        "drain_timeout": 5.0,
        "max_model_len": 256,
        "pool": "8MiB",
        "host_size": "0",
        "kv_dtype": "float32",
        "max_in_flight": 4096,
        "tensor_parallel": 1,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 64,
        "admin_socket": f"{socket_dir}/admin.sock",
        "state_file": "state.json",
    } | values
    path.write_text(TINY_CONFIG.format(**settings))
    return path
