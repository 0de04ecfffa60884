"""``kvd bench fleet``: kvd replicas behind a real inference gateway (smg),
routed blindly, by the gateway's own prefix tree, and by the replicas' KV
events.

N ``kvd serve`` replicas start on loopback, and ``smg`` in front of them, once
per smg routing policy (the replicas' caches flushed between policies).
``kv_events`` is the precise prefix routing of llm-d and Dynamo: NVIDIA
Dynamo's KV indexer (PyPI ``ai-dynamo-runtime``) follows every replica's
events, and each request goes straight to the replica it scores highest for
the prompt in the tenant's namespace (the least busy one on a tie).
``one_replica`` sends everything to the first replica: the baseline. The
workload is what makes a prefix cache pay: four tenants, each with documents
of its own that it asks several questions about, sent by concurrent clients
in a shuffled order, each with its tenant's own key (which the gateway
forwards). Reported per policy: the share of prompt tokens the fleet served
from its caches (what re-prefilling costs when a gateway spreads a prefix
over replicas), TTFT and throughput as clients saw them, and the requests
each replica took. ``ideal`` is the share one unbounded cache would serve:
every prompt block already seen, of the same tenant, hit. Two tenants also
ask about one shared document, identical text: at the end of ``kv_events``
the indexer must score it 0 for the tenants that never sent it, and 0
without a namespace (no cross-tenant score), and hold per replica as many
blocks as ``kvctl status`` counts full-attention blocks in its pool.
"""

from __future__ import annotations

import hashlib
import itertools
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

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
SMG_POLICIES = ("round_robin", "cache_aware", "power_of_two", "random")
KV_EVENTS, ONE_REPLICA = "kv_events", "one_replica"
POLICIES = (*SMG_POLICIES, KV_EVENTS, ONE_REPLICA)
SHARED_BY = TENANTS[:2]  # the tenants that ask about the shared document


class TenantLatency(msgspec.Struct, frozen=True):
    tenant: str
    ttft_p50_s: float
    ttft_p99_s: float


class IndexerCheck(msgspec.Struct, frozen=True):
    """Dynamo's indexer against the replicas, at the end of ``kv_events``."""

    version: str
    decode_errors: int  # lines of its log that say a batch did not decode
    blocks: list[int]  # device blocks it holds per replica
    pool_blocks: list[int]  # full-attention blocks each pool holds (kvctl status)
    cross_tenant_scores: int  # queries that scored where the tenant never sent the text
    queries: int


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
    tenants: list[TenantLatency] = []
    indexer: IndexerCheck | None = None


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
        "",
        "[kv_events]",  # what the kv_events policy's indexer follows
        "enable = true",
        f'endpoint = "ipc://{directory}/events"',
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
    shared = "Shared handbook: " + " ".join(rng.choice(vocabulary) for _ in range(words))
    for tenant in SHARED_BY:
        for q in range(questions):
            work.append((tenant, f"{shared}\n\nQuestion {q}: which step is the longest?"))
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
    """``smg launch`` in front of kvd replicas, as docs/howto/scale-out.md says: the
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


class DynamoIndexer:
    """NVIDIA Dynamo's standalone KV indexer following every replica's events
    (worker ``i + 1`` is replica ``i``), asked over its HTTP API."""

    def __init__(self, endpoints: list[str], block_size: int, log: Path) -> None:
        try:
            from importlib.metadata import version

            self.version = version("ai-dynamo-runtime")
        except Exception as exc:  # PackageNotFoundError
            raise RuntimeError(
                "the kv_events policy needs NVIDIA Dynamo's indexer: pip install ai-dynamo-runtime"
            ) from exc
        self.log = log
        port = free_port()
        workers = ",".join(f"{i + 1}={endpoint}" for i, endpoint in enumerate(endpoints))
        command = [sys.executable, "-m", "dynamo.indexer", "--workers", workers]
        command += ["--block-size", str(block_size), "--port", str(port), "--threads", "1"]
        with log.open("ab") as out:
            self.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if self.http.get("/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        self.close()
        raise RuntimeError(f"Dynamo's indexer did not start (its log: {log})")

    def scores(self, tokens: list[int], namespace: str | None) -> dict[int, int]:
        """Prompt tokens each replica holds a prefix of, in ``namespace``."""
        body: dict[str, Any] = {"token_ids": tokens, "model_name": "default"}
        if namespace is not None:
            body["cache_salt"] = namespace
        reply = self.http.post("/query", json=body)
        reply.raise_for_status()
        found = reply.json()["scores"]
        return {int(worker) - 1: sum(ranks.values()) for worker, ranks in found.items()}

    def held(self, replicas: int) -> list[set[int]]:
        """The device blocks' hashes it holds per replica, from its dump."""
        held: list[set[int]] = [set() for _ in range(replicas)]
        for index in self.http.get("/dump").json().values():
            for entry in index["events"]:
                stored = entry["event"]["data"].get("stored")
                if stored is not None and entry["storage_tier"] == "device":
                    held[entry["worker_id"] - 1] |= {b["block_hash"] for b in stored["blocks"]}
        return held

    def blocks(self, replicas: int) -> list[int]:
        return [len(h) for h in self.held(replicas)]

    def caught_up(self, pools: list[int], timeout: float = 30) -> list[int]:
        """The blocks it holds per replica once they are ``pools`` (it applies
        batches on threads of its own), or as they are after ``timeout``."""
        deadline = time.monotonic() + timeout
        held = self.blocks(len(pools))
        while held != pools and time.monotonic() < deadline:
            time.sleep(0.1)
            held = self.blocks(len(pools))
        return held

    def decode_errors(self) -> int:
        return sum("Failed to decode" in line for line in self.log.read_text().splitlines())

    def close(self) -> None:
        self.http.close()
        self.proc.terminate()
        self.proc.wait(timeout=30)


class EventsRouter:
    """Each request to the replica that holds the longest prefix of its prompt
    in its tenant's namespace or in none (a public prefix), by Dynamo's
    indexer, or will hold it: a
    request routed but not finished yet counts for its replica (its blocks
    are not cached, so not published, until it computes them; Dynamo's own
    router and llm-d count in-flight prefixes the same way). On a tie, the
    replica with the fewest requests in flight."""

    def __init__(
        self, indexer: DynamoIndexer, urls: list[str], encode: Any, block_size: int
    ) -> None:
        self.indexer, self.urls, self.encode = indexer, urls, encode
        self.block_size = block_size
        self.busy = [0] * len(urls)
        self.routed: dict[int, tuple[int, str, list[int]]] = {}  # in flight: replica, tenant, ids
        self.tickets = itertools.count()
        self.lock = threading.Lock()

    def send(self, tokens: int, item: tuple[str, str]) -> Completion:
        tenant, prompt = item
        ids = self.encode(prompt)
        scores = self.indexer.scores(ids, f"tenant:{tenant}")
        # Public prefixes are indexed without a namespace, and Dynamo seeds every
        # block of a salted query with the salt: they score only when asked so.
        for replica, tokens in self.indexer.scores(ids, None).items():
            scores[replica] = max(scores.get(replica, 0), tokens)
        with self.lock:
            for replica, owner, other in self.routed.values():
                if owner == tenant:
                    shared = _common_prefix(ids, other) // self.block_size * self.block_size
                    scores[replica] = max(scores.get(replica, 0), shared)
            i = max(range(len(self.urls)), key=lambda r: (scores.get(r, 0), -self.busy[r], -r))
            self.busy[i] += 1
            ticket = next(self.tickets)
            self.routed[ticket] = (i, tenant, ids)
        try:
            return _send(self.urls[i], tokens, item)
        finally:
            with self.lock:
                self.busy[i] -= 1
                del self.routed[ticket]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _kvctl(directory: Path, *args: str) -> bytes:
    """The real kvctl on a replica's admin socket; its standard output."""
    command = [sys.executable, "-m", "kvctl.cli", "--socket", f"{directory}/admin.sock", *args]
    return subprocess.run(command, check=True, capture_output=True).stdout


def _status(directory: Path) -> dict[str, Any]:
    """``kvctl status --json`` of a replica."""
    return msgspec.json.decode(_kvctl(directory, "status", "--json"))  # type: ignore[no-any-return]


def _check_indexer(
    indexer: DynamoIndexer,
    directories: list[Path],
    work: list[tuple[str, str]],
    encode: Any,
) -> IndexerCheck:
    """Once the indexer has caught up with the pools (each replica idle):
    what it holds per replica against ``kvctl status``, and whether any
    query scores text a tenant never sent (the shared document, for the
    tenants that never asked about it; anything, without a namespace)."""
    pools = [_status(d)["pool"]["findable_blocks"]["global"] for d in directories]
    held = indexer.caught_up(pools)
    crossings = queries = 0
    strangers = [f"tenant:{t}" for t in TENANTS if t not in SHARED_BY]
    for _tenant, prompt in work:
        tokens = encode(prompt)
        # No namespace finds anything (no public prefix here); the shared
        # document is nobody's in the namespaces of those who never sent it.
        for namespace in [None, *(strangers if prompt.startswith("Shared") else [])]:
            queries += 1
            crossings += any(indexer.scores(tokens, namespace).values())
    return IndexerCheck(indexer.version, indexer.decode_errors(), held, pools, crossings, queries)


def _flush(directories: list[Path]) -> None:
    for directory in directories:
        _kvctl(directory, "flush")


def _send(url: str, tokens: int, item: tuple[str, str]) -> Completion:
    tenant, prompt = item
    body = {"model": MODEL_ID, "prompt": prompt, "max_tokens": tokens}
    return stream_completion(url, _key(tenant), body)


def _finished(daemon: LoggedDaemon) -> int:
    return sum(1 for e in daemon.events if e.get("event") == "request.finish")


def run_fleet_bench(
    replicas: int = 2,
    policies: tuple[str, ...] = (ONE_REPLICA, "round_robin", "cache_aware", KV_EVENTS),
    clients: int = 8,
    documents: int = 3,
    questions: int = 6,
    tokens: int = 16,
    quick: bool = False,
    say: Callable[[str], None] = lambda _text: None,
) -> FleetReport:
    from kvd.engine.loader import EMBEDDED_MODEL, embedded_tokenizer

    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise ValueError(f"unknown policy {unknown[0]!r}: one of {', '.join(POLICIES)}")
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
        indexer = None
        try:
            if KV_EVENTS in policies:  # first: it follows the replicas from their start
                endpoints = [f"ipc://{d}/events" for d in directories]
                indexer = DynamoIndexer(endpoints, 16, root / "indexer.log")
            for directory in directories:
                directory.mkdir()
                config = directory / "kvd.toml"
                config.write_text(_config(model, shape, directory))
                daemons.append(LoggedDaemon(config))
            say(f"starting {replicas} replicas of {model}")
            urls = [daemon.wait_ready() for daemon in daemons]
            for policy in policies:
                _flush(directories)
                before = [_finished(d) for d in daemons]
                gateway = None
                if policy == KV_EVENTS:
                    assert indexer is not None
                    say(f"{policy} (Dynamo's indexer): {len(work)} requests, {clients} clients")
                    send = EventsRouter(indexer, urls, tokenizer.encode, 16).send
                elif policy == ONE_REPLICA:
                    say(f"{policy}: {len(work)} requests from {clients} clients")
                    send = partial(_send, urls[0])
                else:
                    say(f"smg --policy {policy}: {len(work)} requests from {clients} clients")
                    gateway, url = _launch_gateway(urls, policy, root / "smg.log")
                    send = partial(_send, url)
                try:
                    started = time.monotonic()
                    with ThreadPoolExecutor(clients) as pool:
                        done = list(pool.map(partial(send, tokens), work))
                    wall = time.monotonic() - started
                finally:
                    if gateway is not None:
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
                check = None
                if policy == KV_EVENTS:
                    assert indexer is not None
                    say("checking the indexer against the pools")
                    check = _check_indexer(indexer, directories, work, tokenizer.encode)
                figures.append(
                    PolicyFigures(
                        policy,
                        len(done),
                        prompt_tokens,
                        cached,
                        cached / prompt_tokens if prompt_tokens else 0.0,
                        statistics.median(ttfts),
                        _p99(ttfts),
                        wall,
                        sum(c.completion_tokens for c in done) / wall,
                        per_replica,
                        _by_tenant(work, done),
                        check,
                    )
                )
        finally:
            for daemon in daemons:
                daemon.stop()
            if indexer is not None:
                indexer.close()
    return FleetReport(machine_description(), model, replicas, clients, ideal, figures)


def _p99(values: list[float]) -> float:
    return values[min(len(values) - 1, int(len(values) * 0.99))]


def _by_tenant(work: list[tuple[str, str]], done: list[Completion]) -> list[TenantLatency]:
    figures = []
    for tenant in TENANTS:
        ttfts = sorted(c.ttft_s for (t, _), c in zip(work, done, strict=True) if t == tenant)
        if ttfts:
            figures.append(TenantLatency(tenant, statistics.median(ttfts), _p99(ttfts)))
    return figures


def render(report: FleetReport) -> str:
    lines = [
        f"kvd bench fleet: {report.replicas} kvd replicas of {report.model}, routed by smg or by "
        "their KV events, "
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
    lines += ["", "TTFT p50 / p99 by tenant:"]
    for p in report.policies:
        cells = [f"{t.tenant} {t.ttft_p50_s:.3f}/{t.ttft_p99_s:.3f}s" for t in p.tenants]
        lines.append(f"{p.policy:>12}  " + ", ".join(cells))
    for p in report.policies:
        if p.indexer is not None:
            check = p.indexer
            lines += [
                "",
                f"Dynamo's indexer (ai-dynamo-runtime {check.version}) after {p.policy}:",
                f"  decode errors in its log: {check.decode_errors}",
                f"  blocks it holds per replica {check.blocks}, full-attention blocks in "
                f"each pool (kvctl status) {check.pool_blocks}",
                f"  queries scoring text the tenant never sent: {check.cross_tenant_scores} "
                f"of {check.queries}",
            ]
    return "\n".join(lines)
