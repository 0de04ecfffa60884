"""``kvd bench kv``: host cost of the KV core, the part that runs every step.

Per step, every running sequence appends one token (allocate room for it, commit
the K/V the engine would have written, record the sampled token); sequences
that reach their length finish, and as many new ones arrive and are prefilled
(prefix lookup against a shared public system prompt, allocation, commit).
Time is host wall time of that bookkeeping only; no model runs.
"""

from __future__ import annotations

import os
import platform
import random
import statistics
import time

import msgspec

from kvd.kv.geometry import preset
from kvd.kv.layout import build_layout
from kvd.kv.ledger import BudgetMode, TenantBudget
from kvd.kv.manager import KVManager
from kvd.kv.scope import PUBLIC_SCOPE, Scope, block_hash, chain_hashes
from kvd.kv.sequence import Sequence


class StepFigures(msgspec.Struct, frozen=True):
    running: int
    steps: int
    mean_ms: float
    p50_ms: float
    p99_ms: float
    per_sequence_us: float
    arrivals_per_step: float
    prefix_hit_rate: float


class KVBenchReport(msgspec.Struct, frozen=True):
    machine: str
    model: str
    block_size: int
    page_groups: int
    steps: list[StepFigures]
    hash_tokens_per_s: float


def machine_description() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}"


def device_description() -> str:
    """The device JAX computes on, e.g. "CPU (JAX 0.10.2, 1 device(s))" or
    "GPU NVIDIA H200 (JAX ..., 1 device(s))"."""
    import jax

    device = jax.devices()[0]
    platform_name = device.platform.upper()
    kind = str(getattr(device, "device_kind", ""))
    name = platform_name if kind.lower() in ("", device.platform) else f"{platform_name} {kind}"
    return f"{name} (JAX {jax.__version__}, {jax.device_count()} device(s))"


_SYSTEM_PROMPT = list(range(1000, 1096))  # 96 tokens: 6 full blocks, registered public
_TENANTS = ("alice", "bob", "carol", "dave")


class _Workload:
    def __init__(self, running: int, model: str, block_size: int, seed: int) -> None:
        self.rng = random.Random(seed)
        layout = build_layout(preset(model), block_size)
        per_seq = layout.pages_for_tokens(128 + 512)
        self.kv = KVManager(layout, running * per_seq * 5 // 4 + 2, mode=BudgetMode.RESERVE)
        share = self.kv.stats().capacity_pages // (2 * len(_TENANTS))
        for tenant in _TENANTS:
            self.kv.set_tenant(tenant, TenantBudget(reservation=share))
        self.kv.add_public_prefix("system", _SYSTEM_PROMPT)
        self.targets: dict[int, int] = {}
        self.live: dict[int, Sequence] = {}  # the sequences it runs, oldest first
        self.next_id = 0
        self.arrivals = 0
        for _ in range(running):
            self.arrive()
        # Spread completions so arrivals happen on most steps.
        for seq in self.live.values():
            for _ in range(self.rng.randrange(64)):
                self.decode(seq)

    def arrive(self) -> None:
        rng = self.rng
        prompt = _SYSTEM_PROMPT + [rng.randrange(2, 262144) for _ in range(rng.randrange(8, 32))]
        seq = self.kv.add_sequence(self.next_id, rng.choice(_TENANTS), prompt)
        self.targets[self.next_id] = len(prompt) + rng.randrange(64, 512)
        self.live[self.next_id] = seq
        self.next_id += 1
        hit = self.kv.lookup(seq)
        todo = len(prompt) - hit.num_tokens
        self.kv.allocate(seq, todo, hit)
        self.kv.commit(seq, todo)
        self.kv.append_tokens(seq, [rng.randrange(2, 262144)])
        self.arrivals += 1

    def decode(self, seq: Sequence) -> None:
        kv = self.kv
        kv.allocate(seq, 1)
        kv.commit(seq, 1)
        kv.append_tokens(seq, (seq.num_computed & 0xFFFF,))

    def step(self) -> None:
        done: list[Sequence] = []
        targets, decode = self.targets, self.decode
        for seq in self.live.values():
            decode(seq)
            if len(seq.tokens) >= targets[seq.seq_id]:
                done.append(seq)
        for seq in done:
            self.kv.finish(seq)
            del targets[seq.seq_id], self.live[seq.seq_id]
            self.arrive()


def bench_steps(running: int, steps: int, model: str, block_size: int) -> StepFigures:
    work = _Workload(running, model, block_size, seed=running)
    work.arrivals = 0
    hits0, queries0 = work.kv.prefix_hit_tokens, work.kv.prefix_query_tokens
    times: list[float] = []
    for _ in range(steps):
        start = time.perf_counter()
        work.step()
        times.append(time.perf_counter() - start)
    work.kv.check_invariants()
    times.sort()
    mean = statistics.fmean(times)
    queries = work.kv.prefix_query_tokens - queries0
    return StepFigures(
        running=running,
        steps=steps,
        mean_ms=mean * 1e3,
        p50_ms=times[len(times) // 2] * 1e3,
        p99_ms=times[min(len(times) - 1, int(len(times) * 0.99))] * 1e3,
        per_sequence_us=mean / running * 1e6,
        arrivals_per_step=work.arrivals / steps,
        prefix_hit_rate=(work.kv.prefix_hit_tokens - hits0) / queries if queries else 0.0,
    )


def bench_hash(block_size: int, tokens: int = 1 << 20) -> float:
    rng = random.Random(0)
    data = [rng.randrange(262144) for _ in range(tokens)]
    scope = Scope(PUBLIC_SCOPE)
    block_hash(None, PUBLIC_SCOPE, data[:block_size])  # warm the hash object path
    start = time.perf_counter()
    chain_hashes(data, block_size, scope, 0, tokens // block_size, None)
    return tokens / (time.perf_counter() - start)


def run_kv_bench(
    sizes: tuple[int, ...] = (64, 256, 1024),
    steps: int = 200,
    model: str = "gemma3-270m",
    block_size: int = 16,
) -> KVBenchReport:
    layout = build_layout(preset(model), block_size)
    return KVBenchReport(
        machine=machine_description(),
        model=model,
        block_size=block_size,
        page_groups=layout.num_groups,
        steps=[bench_steps(n, steps, model, block_size) for n in sizes],
        hash_tokens_per_s=bench_hash(block_size),
    )


def render(report: KVBenchReport) -> str:
    lines = [
        f"kvd bench kv: host time per scheduling step ({report.model} layout, "
        f"{report.page_groups} page groups, {report.block_size}-token blocks)",
        f"machine: {report.machine}",
        "",
        f"{'running':>8} {'steps':>6} {'mean ms':>9} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'us/seq':>7} {'arrivals/step':>14} {'prefix hit':>11}",
    ]
    for f in report.steps:
        lines.append(
            f"{f.running:>8} {f.steps:>6} {f.mean_ms:>9.3f} {f.p50_ms:>8.3f} {f.p99_ms:>8.3f} "
            f"{f.per_sequence_us:>7.2f} {f.arrivals_per_step:>14.2f} {f.prefix_hit_rate:>10.1%}"
        )
    lines += [
        "",
        f"prefix hashing: {report.hash_tokens_per_s / 1e6:,.2f} M tokens/s (keyed BLAKE2b chain)",
    ]
    return "\n".join(lines)
