"""A real daemon for benchmarks and experiments: ``kvd serve`` as a
subprocess whose JSON log lines are kept, and a streamed completion client."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from kvd.bench import sse


class DaemonShape(msgspec.Struct, frozen=True):
    """A benchmark daemon's engine and pool: what its warm-up compiles."""

    max_model_len: int
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    pool: str = "256MiB"

    def toml(self) -> str:
        """Its keys of the [model] section (the pool's size is ``pool``)."""
        return (
            f"max_model_len = {self.max_model_len}\n"
            f"max_num_seqs = {self.max_num_seqs}\n"
            f"max_num_batched_tokens = {self.max_num_batched_tokens}\n"
        )


# The experiments' quick daemons (a short trace of prompts under 700 tokens,
# on the random model): a short context and small steps, 12 programs to
# compile instead of 16 larger ones, and one shape for all of them, so every
# daemon after the first reads its programs from the compile cache.
QUICK_DAEMON = DaemonShape(1024, 16, 128, "32MiB")


class LoggedDaemon:
    """``kvd serve`` as a subprocess whose JSON log lines are kept."""

    def __init__(self, config: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvd.cli", "serve", "--config", str(config)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self.events: list[dict[str, Any]] = []
        self._logged = threading.Condition()
        self.ready = threading.Event()
        self.url = ""
        self.closed = False  # its output ended
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            event["_t"] = time.monotonic()
            with self._logged:
                self.events.append(event)
                self._logged.notify_all()
            if event.get("event") == "lifecycle.listening":
                self.url = event["addresses"][0]
            elif event.get("event") == "lifecycle.ready":
                self.ready.set()
        self.ready.set()
        with self._logged:
            self.closed = True
            self._logged.notify_all()

    def wait_for(
        self, condition: Callable[[list[dict[str, Any]]], bool], timeout: float | None = None
    ) -> bool:
        """Until ``condition(events)`` holds (True), the daemon's output ends
        or ``timeout`` passes (False)."""
        with self._logged:
            return self._logged.wait_for(
                lambda: condition(self.events) or self.closed, timeout
            ) and condition(self.events)

    def wait_ready(self) -> str:
        self.ready.wait()
        if self.proc.poll() is not None:
            raise RuntimeError("the daemon exited before it was ready")
        return self.url

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(timeout=30)  # to the end of its output
        if self.proc.stdout is not None:
            self.proc.stdout.close()


class Completion(msgspec.Struct):
    text: str
    ttft_s: float
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


def stream_completion(url: str, key: str, body: dict[str, Any]) -> Completion:
    """A streamed greedy completion of ``body`` (model, prompt, max_tokens, ...),
    with its usage."""
    import httpx

    body = {"temperature": 0, **body, "stream": True, "stream_options": {"include_usage": True}}
    sent = time.monotonic()
    first: float | None = None
    last = sent
    text: list[str] = []
    usage: dict[str, Any] = {}
    with (
        httpx.Client(timeout=3600) as http,
        http.stream(
            "POST",
            f"{url}/v1/completions",
            json=body,
            headers={"Authorization": f"Bearer {key}"},
        ) as response,
    ):
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"{response.status_code}: {response.text}")
        for line in sse.lines(response.iter_text()):
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            last = time.monotonic()
            if "error" in chunk:  # an aborted stream (drain, queue timeout)
                raise RuntimeError(f"the stream ended with an error: {chunk['error']}")
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", ()):
                if choice.get("text"):
                    if first is None:
                        first = last - sent
                    text.append(choice["text"])
    if not usage:
        raise RuntimeError("the stream ended without its usage chunk")
    details = usage.get("prompt_tokens_details") or {}
    return Completion(
        text="".join(text),
        # A completion whose tokens are no text yet: its first token came by the end.
        ttft_s=first if first is not None else last - sent,
        prompt_tokens=int(usage["prompt_tokens"]),
        cached_tokens=int(details.get("cached_tokens", 0)),
        completion_tokens=int(usage.get("completion_tokens", 0)),
    )
