"""One kvd over two processes against one process, on this machine: the real
270M split four ways (tensor parallel 4) either as one process of four
virtual CPU devices or as two processes of two (JAX's multi-controller
runtime, gloo between them; docs/howto/multi-host.md). Each setup is started
in turn, warmed, then measured at batch 1 and batch 8: greedy streaming
requests sent at once, decode tokens/s per stream (tokens after the first
over the time after the first) and TTFT, medians over the rounds.

Run: .venv/bin/python scripts/bench_multihost.py [--rounds 2] [--tokens 48] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from kvd.bench import sse

KEY = "kvd-bench-key"
PROMPTS = [
    "The history of the printing press begins",
    "Explain how a refrigerator keeps food cold:",
    "def merge_sort(items):\n    ",
    "A short story about a lighthouse keeper:",
    "The main causes of the French Revolution were",
    "Write a limerick about a cat who codes:",
    "Photosynthesis converts",
    "Ten tips for a first marathon:",
]

CONFIG = """
[server]
listen = "127.0.0.1:{port}"
metrics_listen = "127.0.0.1:0"
admin_socket = "{directory}/admin.sock"
state_file = "{directory}/state.json"

[model]
source = "gemma3-270m"
max_model_len = 512
max_num_seqs = 8
max_num_batched_tokens = 128
tensor_parallel = 4

[pool]
size = "64MiB"
host_size = "0"
{distributed}
[[tenants]]
name = "bench"
api_key_sha256 = "{digest}"
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start(processes: int, directory: Path) -> tuple[list[subprocess.Popen[bytes]], str]:
    """``processes`` kvd serve processes of 4/processes devices each; (them, URL)."""
    import hashlib

    port = free_port()
    distributed = ""
    if processes > 1:
        distributed = (
            f'\n[distributed]\ncoordinator = "127.0.0.1:{free_port()}"\n'
            f"num_processes = {processes}\n"
        )
    config = directory / f"kvd-{processes}.toml"
    digest = hashlib.sha256(KEY.encode()).hexdigest()
    config.write_text(
        CONFIG.format(port=port, directory=directory, distributed=distributed, digest=digest)
    )
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={4 // processes}"
    env["JAX_PLATFORMS"] = "cpu"
    procs = []
    for pid in reversed(range(processes)):  # followers first: the leader's start waits for them
        args = [sys.executable, "-m", "kvd.cli", "serve", "--config", str(config)]
        if processes > 1:
            args += ["--process-id", str(pid)]
        log = open(directory / f"kvd-{processes}-{pid}.log", "wb")  # noqa: SIM115
        procs.append(subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return procs, url
        except httpx.HTTPError:
            pass
        if any(p.poll() is not None for p in procs):
            break
        time.sleep(1)
    stop(procs)
    raise SystemExit(f"the {processes}-process setup did not become ready (logs in {directory})")


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    leader = procs[-1]
    leader.terminate()
    for proc in reversed(procs):
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def one_stream(url: str, prompt: str, tokens: int) -> tuple[float, float]:
    """(TTFT s, decode tokens/s after the first) of one greedy streamed completion."""
    body = {
        "model": "gemma3-270m",
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    sent = time.perf_counter()
    first = last = 0.0
    count = 0
    with httpx.stream(
        "POST",
        f"{url}/v1/completions",
        json=body,
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=600,
    ) as reply:
        reply.raise_for_status()
        for line in sse.lines(reply.iter_text()):
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0].get("text"):
                last = time.perf_counter()
                first = first or last
                count += 1
    return first - sent, (count - 1) / (last - first) if count > 1 else 0.0


def measure(url: str, batch: int, tokens: int) -> tuple[float, float]:
    """(median TTFT ms, aggregate decode tokens/s) of ``batch`` streams at once."""
    with ThreadPoolExecutor(batch) as pool:
        results = list(pool.map(lambda p: one_stream(url, p, tokens), PROMPTS[:batch]))
    ttft = statistics.median(r[0] for r in results) * 1e3
    return ttft, sum(r[1] for r in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvd-mh-", dir="/tmp") as tmp:
        for processes in (1, 2):
            started = time.monotonic()
            procs, url = start(processes, Path(tmp))
            ready_s = time.monotonic() - started
            try:
                measure(url, 1, 4)  # the first requests' page faults are nobody's figure
                for batch in (1, 8):
                    runs = [measure(url, batch, args.tokens) for _ in range(args.rounds)]
                    rows.append(
                        {
                            "setup": f"{processes} process(es) x {4 // processes} devices",
                            "batch": batch,
                            "decode_tokens_per_s": round(statistics.median(r[1] for r in runs), 2),
                            "ttft_ms": round(statistics.median(r[0] for r in runs), 1),
                            "ready_s": round(ready_s, 1),
                        }
                    )
            finally:
                stop(procs)
    if args.json:
        print(json.dumps({"machine": os.uname().nodename, "rows": rows}))
        return
    print(f"{'setup':<26} {'batch':>5} {'decode tok/s':>13} {'TTFT ms':>9} {'ready s':>8}")
    for row in rows:
        print(
            f"{row['setup']:<26} {row['batch']:>5} {row['decode_tokens_per_s']:>13} "
            f"{row['ttft_ms']:>9} {row['ready_s']:>8}"
        )


if __name__ == "__main__":
    main()
