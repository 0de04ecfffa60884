"""``kvd bench fleet``: kvd replicas behind a real inference gateway (smg),
routed blindly and by prefix.

N ``kvd serve`` replicas start on loopback, and ``smg`` in front of them, once
per routing policy (the replicas' caches flushed between policies). The
workload is what makes a prefix cache pay: four tenants, each with documents
of its own that it asks several questions about, sent by concurrent clients
in a shuffled order, each with its tenant's own key (which the gateway
forwards). Reported per policy: the share of prompt tokens the fleet served
from its caches (what re-prefilling costs when a gateway spreads a prefix
over replicas), TTFT and throughput as clients saw them, and the requests
each replica took. ``ideal`` is the share one unbounded cache would serve:
every prompt block already seen, of the same tenant, hit.
"""

from __future__ import annotations

import hashlib
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import httpx
import msgspec

from kvd.bench.daemon import (
    QUICK_DAEMON,
    Completion,
    DaemonShape,
    LoggedDaemon,
    stream_completion,
)
from kvd.bench.kv import machine_description

TENANTS = ("acme", "globex", "initech", "umbrella")
MODEL_ID = "fleet"


class PolicyFigures(msgspec.Struct, frozen=True):
    policy: str
    requests: int
    prompt_tokens: int
    cached_tokens: int
    hit_rate: float
    ttft_p50_s: float
    ttft_p99_s: float
    wall_s: float
    completion_tokens_per_s: float
    per_replica: list[int]  # requests each replica finished


class FleetReport(msgspec.Struct, frozen=True):
    machine: str
    model: str
    replicas: int
    clients: int
    ideal_hit_rate: float
    policies: list[PolicyFigures]


def _key(tenant: str) -> str:
    return f"kvd-fleet-{tenant}"


def _config(model: str, shape: DaemonShape, directory: Path) -> str:
    lines = [
        "[server]",
        'listen = "127.0.0.1:0"',
        'metrics_listen = "127.0.0.1:0"',
        f'admin_socket = "{directory}/admin.sock"',
        f'state_file = "{directory}/state.json"',
        "queue_timeout = 3600",
        "",
        "[model]",
        f'source = "{model}"',
        f'name = "{MODEL_ID}"',
        shape.toml(),
        "[pool]",
        f'size = "{shape.pool}"',
    ]
    for tenant in TENANTS:
        digest = hashlib.sha256(_key(tenant).encode()).hexdigest()
        lines += ["", "[[tenants]]", f'name = "{tenant}"', f'api_key_sha256 = "{digest}"']
        lines.append("max_queue = 1024")
    return "\n".join(lines) + "\n"


def workload(documents: int, questions: int, words: int, seed: int) -> list[tuple[str, str]]:
    """(tenant, prompt) pairs: each tenant's documents, each asked about
    ``questions`` times, shuffled."""
    rng = random.Random(seed)
    vocabulary = [
        "flour",
        "yeast",
        "oven",
        "crust",
        "crumb",
        "proof",
        "knead",
        "salt",
        "water",
        "rye",
        "spelt",
        "starter",
    ]
    work = []
    for tenant in TENANTS:
        for d in range(documents):
            text = " ".join(rng.choice(vocabulary) for _ in range(words))
            document = f"{tenant} handbook, part {d}: {text}\n\n"
            for q in range(questions):
                work.append((tenant, f"{document}Question {q}: what comes after step {q + d}?"))
    rng.shuffle(work)
    return work


def ideal_hit_rate(prompts: list[tuple[str, list[int]]], block: int) -> float:
    """One unbounded cache of the tenant-scoped blocks, in arrival order."""
    seen: set[tuple[str, tuple[int, ...]]] = set()
    hit = total = 0
    for tenant, ids in prompts:
        total += len(ids)
        full = (len(ids) - 1) // block  # at least one token is computed
        blocks = [(tenant, tuple(ids[: (b + 1) * block])) for b in range(full)]
        found = 0
        for key in blocks:
            if key not in seen:
                break
            found += 1
        hit += found * block
        seen.update(blocks)
    return hit / total if total else 0.0


def free_port() -> int:
    """A loopback port free now (for a process that binds it itself)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def smg_command(
    urls: list[str], policy: str, port: int, gateway_key: str, tenant_keys: dict[str, str]
) -> list[str]:
    """``smg launch`` in front of kvd replicas, as docs/scale-out.md says: the
    gateway's own key is a kvd tenant's (smg reads the model id from
    ``/v1/models`` with it), every other tenant's key is listed so the
    gateway admits it and forwards it as it came."""
    path = shutil.which("smg", path=str(Path(sys.executable).parent)) or shutil.which("smg")
    if path is None:
        raise RuntimeError("smg is not installed: pip install smg (or kvd[test])")
    args = [path, "launch", "--host", "127.0.0.1", "--port", str(port)]
    args += ["--worker-urls", *urls, "--policy", policy, "--api-key", gateway_key]
    args += [arg for t, key in tenant_keys.items() for arg in ("--tenant-api-key", f"{t}:{key}")]
    args += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    args += ["--disable-tokenizer-autoload", "--worker-startup-check-interval", "1"]
    return args


def _launch_gateway(urls: list[str], policy: str, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    others = {t: _key(t) for t in TENANTS[1:]}
    args = smg_command(urls, policy, port, _key(TENANTS[0]), others)
    with log.open("ab") as out:
        gateway = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    headers = {"Authorization": f"Bearer {_key(TENANTS[0])}"}
    while time.monotonic() < deadline:
        try:
            workers = httpx.get(f"{url}/workers", headers=headers, timeout=5).json()["workers"]
            ready = [w for w in workers if w["status"] == "ready" and w["model_id"] == MODEL_ID]
            if len(ready) == len(urls):
                return gateway, url
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        if gateway.poll() is not None:
            break
        time.sleep(0.2)
    gateway.terminate()
    raise RuntimeError(f"smg did not register the {len(urls)} replicas (its log: {log})")


def _flush(directories: list[Path]) -> None:
    for directory in directories:
        subprocess.run(
            [sys.executable, "-m", "kvctl.cli", "--socket", f"{directory}/admin.sock", "flush"],
            check=True,
            capture_output=True,
        )


def _send(url: str, tokens: int, item: tuple[str, str]) -> Completion:
    tenant, prompt = item
    body = {"model": MODEL_ID, "prompt": prompt, "max_tokens": tokens}
    return stream_completion(url, _key(tenant), body)


def _finished(daemon: LoggedDaemon) -> int:
    return sum(1 for e in daemon.events if e.get("event") == "request.finish")


def run_fleet_bench(
    replicas: int = 2,
    policies: tuple[str, ...] = ("round_robin", "cache_aware"),
    clients: int = 8,
    documents: int = 3,
    questions: int = 6,
    tokens: int = 16,
    quick: bool = False,
    say: Callable[[str], None] = lambda _text: None,
) -> FleetReport:
    from kvd.engine.loader import EMBEDDED_MODEL, embedded_tokenizer

    model = "random" if quick else EMBEDDED_MODEL
    shape = QUICK_DAEMON if quick else DaemonShape(2048, 16, 256, "96MiB")
    work = workload(documents, questions, 60 if quick else 120, seed=11)
    tokenizer = embedded_tokenizer()
    ideal = ideal_hit_rate([(t, tokenizer.encode(p)) for t, p in work], 16)
    figures = []
    with tempfile.TemporaryDirectory(prefix="kvd-fleet-", dir="/tmp") as scratch:
        root = Path(scratch)
        directories = [root / f"r{i}" for i in range(replicas)]
        daemons = []
        try:
            for directory in directories:
                directory.mkdir()
                config = directory / "kvd.toml"
                config.write_text(_config(model, shape, directory))
                daemons.append(LoggedDaemon(config))
            say(f"starting {replicas} replicas of {model}")
            urls = [daemon.wait_ready() for daemon in daemons]
            for policy in policies:
                _flush(directories)
                say(f"smg --policy {policy}: {len(work)} requests from {clients} clients")
                gateway, url = _launch_gateway(urls, policy, root / "smg.log")
                before = [_finished(d) for d in daemons]
                try:
                    started = time.monotonic()
                    with ThreadPoolExecutor(clients) as pool:
                        done = list(pool.map(partial(_send, url, tokens), work))
                    wall = time.monotonic() - started
                finally:
                    gateway.terminate()
                    gateway.wait(timeout=30)
                deadline = time.monotonic() + 30  # each replica logs its last finishes
                while time.monotonic() < deadline:
                    per_replica = [_finished(d) - b for d, b in zip(daemons, before, strict=True)]
                    if sum(per_replica) >= len(done):
                        break
                    time.sleep(0.05)
                ttfts = sorted(c.ttft_s for c in done)
                prompt_tokens = sum(c.prompt_tokens for c in done)
                cached = sum(c.cached_tokens for c in done)
                figures.append(
                    PolicyFigures(
                        policy,
                        len(done),
                        prompt_tokens,
                        cached,
                        cached / prompt_tokens if prompt_tokens else 0.0,
                        statistics.median(ttfts),
                        ttfts[min(len(ttfts) - 1, int(len(ttfts) * 0.99))],
                        wall,
                        sum(c.completion_tokens for c in done) / wall,
                        per_replica,
                    )
                )
        finally:
            for daemon in daemons:
                daemon.stop()
    return FleetReport(machine_description(), model, replicas, clients, ideal, figures)


def render(report: FleetReport) -> str:
    lines = [
        f"kvd bench fleet: {report.replicas} kvd replicas of {report.model} behind smg, "
        f"{report.clients} clients, {len(TENANTS)} tenants (each with its own key)",
        f"machine: {report.machine}",
        f"one unbounded cache would serve {report.ideal_hit_rate:.1%} of prompt tokens",
        "",
        f"{'policy':>12} {'requests':>8} {'from cache':>10} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'tok/s':>7} {'wall s':>7}  per replica",
    ]
    for p in report.policies:
        lines.append(
            f"{p.policy:>12} {p.requests:>8} {p.hit_rate:>10.1%} {p.ttft_p50_s:>8.3f}s "
            f"{p.ttft_p99_s:>8.3f}s {p.completion_tokens_per_s:>7.1f} {p.wall_s:>7.1f}  "
            f"{p.per_replica}"
        )
    return "\n".join(lines)
