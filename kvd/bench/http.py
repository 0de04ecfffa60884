"""``kvd bench http``: a bounded load run against a real daemon on loopback,
and the same workload through the in-process scheduler, side by side.

The daemon is started as a subprocess (``kvd serve`` on 127.0.0.1, port 0).
N clients each keep one streaming completion in flight for the duration;
every response is checked (status, [DONE]) and timed (TTFT, inter-token
latency as the client sees it). Afterwards /metrics must show no page in use.
Then, with the daemon stopped, the same prompts and concurrency run through
``Scheduler.step`` in this process, for the HTTP/in-process throughput ratio.
Clients and server share this machine's cores, as they do on any loopback
test; the figures say so.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from kvd.bench.kv import machine_description
from kvd.bench.sse import alines

KEY = "kvd-bench"


class LoadReport(msgspec.Struct, frozen=True):
    machine: str
    model: str
    clients: int
    duration_s: float
    max_tokens: int
    temperature: float
    requests: int
    errors_5xx: int
    errors_other: int
    incomplete_streams: int
    leaked_pages: int
    requests_per_s: float
    output_tokens_per_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    itl_p50_s: float
    itl_p99_s: float
    tokens_per_chunk: float  # streamed tokens per SSE chunk: above 1 when chunks coalesce
    # Event lines that were not JSON: each one counted, where one once
    # ended the whole run with a traceback.
    malformed_events: int = 0
    daemon_peak_rss_gib: float | None = None
    overlap: bool = True  # the daemon's scheduler.overlap
    inprocess_output_tokens_per_s: float | None = None
    http_vs_inprocess: float | None = None


def _config(
    model: str, clients: int, max_model_len: int, pool: str, admin_socket: str, overlap: bool
) -> str:
    import hashlib

    digest = hashlib.sha256(KEY.encode()).hexdigest()
    return f"""
[server]
listen = "127.0.0.1:0"
metrics_listen = "127.0.0.1:0"
admin_socket = "{admin_socket}"
# Beside the socket, in the run's temporary directory: a bench never
# touches (nor restores) the state of a daemon installed on this host.
state_file = "{admin_socket}.state.json"
drain_timeout = 30.0
step_log_interval = 5.0

[model]
source = "{model}"
name = "bench"
max_model_len = {max_model_len}
max_num_seqs = 32
max_num_batched_tokens = 512

[pool]
size = "{pool}"

[scheduler]
overlap = {"true" if overlap else "false"}

[[tenants]]
name = "bench"
api_key_sha256 = "{digest}"
max_queue = {max(64, clients * 2)}
"""


def prompts(count: int, system_words: int = 0) -> list[str]:
    """Story requests, each after a shared system prompt of ``system_words``
    rule sentences (~18 tokens each) when asked: a chatbot tenant's traffic."""
    topics = ["the sea", "a city at night", "mountains", "a library", "the first snow"]
    system = "".join(
        f"Rule {i}: answer questions of kind {i} politely and cite section {i} of the guide.\n"
        for i in range(system_words)
    )
    return [
        f"{system}Write a short story about {topics[i % len(topics)]} (#{i})." for i in range(count)
    ]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class _Stats:
    def __init__(self) -> None:
        self.requests = 0
        self.errors_5xx = 0
        self.errors_other = 0
        self.incomplete = 0
        self.malformed = 0
        self.tokens = 0
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.chunks = 0


async def _client(
    url: str,
    texts: list[str],
    index: int,
    max_tokens: int,
    temperature: float,
    until: float,
    stats: _Stats,
) -> None:
    import httpx
    import trio

    headers = {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(timeout=120) as http:
        n = index
        stride = max(1, len(texts) // 64)  # distinct prompts across clients when there are many
        while trio.current_time() < until:
            body = {
                "model": "bench",
                "prompt": texts[n % len(texts)],
                "max_tokens": max_tokens,
                "temperature": temperature,
                "ignore_eos": True,  # every request as long at any temperature
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            n += stride
            sent = time.monotonic()
            last: float | None = None
            done = False
            async with http.stream(
                "POST", f"{url}/v1/completions", json=body, headers=headers
            ) as r:
                if r.status_code >= 500:
                    stats.errors_5xx += 1
                    continue
                if r.status_code != 200:
                    stats.errors_other += 1
                    await trio.sleep(0.1)
                    continue
                async for line in alines(r.aiter_text()):
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        done = True  # read on to the end: the body closes cleanly
                        continue
                    try:
                        chunk = json.loads(data)
                    except json.JSONDecodeError:
                        stats.malformed += 1
                        continue
                    if chunk.get("usage"):
                        stats.tokens += chunk["usage"]["completion_tokens"]
                    if chunk["choices"]:
                        stats.chunks += 1
                        now = time.monotonic()
                        if last is None:
                            stats.ttft.append(now - sent)
                        else:
                            stats.itl.append(now - last)
                        last = now
            stats.requests += 1
            if not done:
                stats.incomplete += 1


def _start_daemon(
    config: Path, log: Callable[[str], None]
) -> tuple[subprocess.Popen[str], str, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvd.cli", "serve", "--config", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    url = metrics_url = None
    for line in proc.stdout:
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        name = event.get("event")
        if name == "lifecycle.listening":
            url = event["addresses"][0]
        elif name == "lifecycle.metrics_listening":
            metrics_url = event["addresses"][0]
        elif name == "lifecycle.warm":
            log(f"daemon warm: {event['programs']} programs in {event['seconds']} s")
        elif name == "lifecycle.ready":
            break
    else:
        raise RuntimeError("the daemon exited before it was ready")
    stdout = proc.stdout

    def drain() -> None:  # keep reading, so the daemon never blocks on a full pipe
        try:
            for _ in stdout:
                pass
        except ValueError:  # closed at the end of the run
            pass

    threading.Thread(target=drain, daemon=True).start()
    assert url is not None and metrics_url is not None
    return proc, url, metrics_url


def _peak_rss_gib(pid: int) -> float | None:
    """The daemon's peak resident set so far (Linux: VmHWM)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 2**20, 2)
    except OSError:
        pass
    return None


def _referenced_pages(url: str) -> int:
    import httpx

    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith('kvd_pool_pages{state="referenced"}'):
            return int(float(line.split()[-1]))
    raise RuntimeError("no kvd_pool_pages in /metrics")


def run_http_load(
    model: str,
    clients: int,
    duration: float,
    max_tokens: int,
    inprocess: bool,
    log: Callable[[str], None],
    system_prompt_rules: int = 0,
    max_model_len: int = 1024,
    pool: str = "512MiB",
    temperature: float = 0.0,
    overlap: bool = True,
) -> LoadReport:
    import trio

    # With a system prompt, every request is new after it (as users' questions are).
    texts = prompts(4096, system_prompt_rules) if system_prompt_rules else prompts(16)
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "bench.toml"
        config.write_text(
            _config(model, clients, max_model_len, pool, f"{tmp}/admin.sock", overlap)
        )
        log(f"starting kvd serve ({model})")
        proc, url, metrics_url = _start_daemon(config, log)
        stats = _Stats()
        try:
            log(f"{clients} streaming clients for {duration:.0f} s")

            async def load() -> float:
                start = trio.current_time()
                until = start + duration
                async with trio.open_nursery() as nursery:
                    for i in range(clients):
                        nursery.start_soon(
                            _client, url, texts, i, max_tokens, temperature, until, stats
                        )
                return trio.current_time() - start

            elapsed = trio.run(load)
            time.sleep(0.5)  # the metrics snapshot trails by < 0.3 s
            leaked = _referenced_pages(metrics_url)
            peak_rss = _peak_rss_gib(proc.pid)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
            assert proc.stdout is not None
            proc.stdout.close()
    report = dict(
        machine=machine_description(),
        model=model,
        clients=clients,
        duration_s=round(elapsed, 1),
        max_tokens=max_tokens,
        temperature=temperature,
        requests=stats.requests,
        errors_5xx=stats.errors_5xx,
        errors_other=stats.errors_other,
        incomplete_streams=stats.incomplete,
        malformed_events=stats.malformed,
        leaked_pages=leaked,
        requests_per_s=round(stats.requests / elapsed, 2),
        output_tokens_per_s=round(stats.tokens / elapsed, 1),
        ttft_p50_s=round(percentile(stats.ttft, 0.5), 3),
        ttft_p99_s=round(percentile(stats.ttft, 0.99), 3),
        itl_p50_s=round(percentile(stats.itl, 0.5), 4),
        itl_p99_s=round(percentile(stats.itl, 0.99), 4),
        tokens_per_chunk=round(stats.tokens / max(1, stats.chunks), 2),
        daemon_peak_rss_gib=peak_rss,
        overlap=overlap,
    )
    if inprocess:
        log("the same workload in-process (Scheduler.step, no HTTP)")
        rate = run_inprocess(
            model, clients, duration, max_tokens, max_model_len, pool, texts, temperature
        )
        report["inprocess_output_tokens_per_s"] = round(rate, 1)
        report["http_vs_inprocess"] = round(report["output_tokens_per_s"] / rate, 3)  # type: ignore[operator]
    return LoadReport(**report)  # type: ignore[arg-type]


def run_inprocess(
    model: str,
    clients: int,
    duration: float,
    max_tokens: int,
    max_model_len: int,
    pool: str,
    texts: list[str],
    temperature: float = 0.0,
) -> float:
    """Output tokens/s of the scheduler alone on the HTTP run's workload:
    ``clients`` requests kept in flight for ``duration``, then drained."""
    from kvd.server.config import Config, ModelSection, PoolSection, TenantEntry
    from kvd.server.loading import load

    config = Config(
        model=ModelSection(
            source=model, max_model_len=max_model_len, max_num_seqs=32, max_num_batched_tokens=512
        ),
        pool=PoolSection(size=pool),
        tenants=[TenantEntry(name="bench", api_key_sha256="0" * 64, max_queue=clients * 2)],
    )
    loaded = load(config, lambda event, fields: None)
    scheduler = loaded.scheduler
    tokenizer = loaded.tokenizer
    from kvd.sched.sampling_params import SamplingParams

    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True)
    encoded = [tokenizer.encode(t) for t in texts]
    counter = 0

    def submit() -> None:
        nonlocal counter
        scheduler.submit(f"r{counter}", "bench", encoded[counter % len(encoded)], params)
        counter += 1

    for _ in range(clients):
        submit()
    tokens = 0
    start = time.monotonic()
    # Like the HTTP clients: a finished request is replaced until the
    # duration is up, then the ones in flight run to their end.
    while scheduler.has_work():
        replace = time.monotonic() - start < duration
        for event in scheduler.step().events:
            if event.token is not None:
                tokens += 1
            if event.finished and replace:
                submit()
    return tokens / (time.monotonic() - start)


def render(report: LoadReport) -> str:
    lines = [
        f"machine: {report.machine}",
        f"model {report.model}: {report.clients} streaming clients, {report.duration_s} s, "
        f"max_tokens {report.max_tokens} (ignore_eos), temperature {report.temperature:g}, "
        f"{'overlapped' if report.overlap else 'serial'} steps",
        f"requests {report.requests} ({report.requests_per_s}/s), 5xx {report.errors_5xx}, "
        f"other errors {report.errors_other}, incomplete streams {report.incomplete_streams}, "
        f"malformed events {report.malformed_events}, leaked pages {report.leaked_pages}",
        f"output tokens/s {report.output_tokens_per_s}",
        f"TTFT p50 {report.ttft_p50_s} s, p99 {report.ttft_p99_s} s; "
        f"ITL p50 {report.itl_p50_s} s, p99 {report.itl_p99_s} s (between chunks), "
        f"{report.tokens_per_chunk} tokens per chunk",
        f"daemon peak RSS {report.daemon_peak_rss_gib} GiB",
    ]
    if report.inprocess_output_tokens_per_s is not None:
        lines.append(
            f"in-process output tokens/s {report.inprocess_output_tokens_per_s}; "
            f"HTTP / in-process = {report.http_vs_inprocess}"
        )
    return "\n".join(lines)
