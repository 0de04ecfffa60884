"""``kvd bench host-cache``: the host cache on and off, one run.

A workload whose reused prefixes do not fit the device pool: ``documents``
prefixes of ``doc_tokens`` tokens (together several times the pool), asked
about in rounds, each request the document and a short question of its own.
Requests go one at a time (so each TTFT is its own prefill, not a queue),
through the real scheduler and engine, with the cost model calibrated on
this machine; the same engine serves both runs, each on a fresh KV manager.

Per run: prompt tokens, tokens served from the cache (and of them from the
host cache), prefill tokens computed, TTFT p50 and mean, and whether every
greedy continuation equals the other run's.
"""

from __future__ import annotations

import time

import msgspec
import numpy as np

from kvd.bench.kv import machine_description


class HostCacheRun(msgspec.Struct, frozen=True):
    host_cache: bool
    host_pages: int
    requests: int
    prompt_tokens: int
    cached_tokens: int
    host_hit_tokens: int
    prefill_tokens: int  # computed: prompt tokens the cache did not serve
    ttft_p50_s: float
    ttft_mean_s: float
    host_offloads: int


class HostCacheReport(msgspec.Struct, frozen=True):
    machine: str
    model: str
    pool_tokens: int
    documents: int
    doc_tokens: int
    rounds: int
    off: HostCacheRun
    on: HostCacheRun
    outputs_equal: bool
    prefill_saved: float  # 1 - on.prefill_tokens / off.prefill_tokens
    ttft_p50_ratio: float  # on / off


def run_host_cache_bench(
    model_name: str = "gemma3-270m",
    *,
    documents: int = 6,
    doc_tokens: int = 384,
    rounds: int = 3,
    pool_tokens: int = 1024,
    host_size: int = 1 << 30,
) -> HostCacheReport:
    from kvd.engine.engine import Engine, EngineConfig
    from kvd.engine.loader import load_model
    from kvd.sched.sampling_params import SamplingParams
    from kvd.sched.scheduler import Scheduler, SchedulerConfig, TenantConfig

    loaded = load_model(model_name, "float32")
    engine = Engine(
        loaded,
        EngineConfig(
            max_model_len=1024,
            max_num_seqs=4,
            max_num_batched_tokens=512,
            pool_tokens=pool_tokens,
        ),
    )
    engine.warm_up()
    rng = np.random.default_rng(0)
    bos = 2
    docs = [[bos, *rng.integers(1000, 100_000, doc_tokens - 1).tolist()] for _ in range(documents)]
    prompts = [
        docs[d] + rng.integers(1000, 100_000, 12).tolist()
        for _ in range(rounds)
        for d in range(documents)
    ]
    runs: dict[bool, HostCacheRun] = {}
    outputs: dict[bool, list[list[int]]] = {}
    rates = None
    for host_cache in (False, True):
        host_pages = host_size // engine.layout.page_bytes if host_cache else 0
        scheduler = Scheduler(engine, SchedulerConfig(host_pages=host_pages))
        scheduler.set_tenant(TenantConfig("t"))
        rates = rates or scheduler.calibrate(repeats=1)
        scheduler.rates = rates
        greedy = SamplingParams(temperature=0.0, max_tokens=4)
        ttfts: list[float] = []
        outs: list[list[int]] = []
        for i, ids in enumerate(prompts):
            name = f"r{i}"
            start = time.perf_counter()
            scheduler.submit(name, "t", ids, greedy)
            first: float | None = None
            tokens: list[int] = []
            while scheduler.has_work():
                for event in scheduler.step().events:
                    if event.token is not None:
                        tokens.append(event.token)
                        if first is None:
                            first = time.perf_counter() - start
            assert first is not None
            ttfts.append(first)
            outs.append(tokens)
        stats = scheduler.kv.stats()
        scheduler.kv.check_invariants()
        prompt_tokens = sum(len(p) for p in prompts)
        runs[host_cache] = HostCacheRun(
            host_cache=host_cache,
            host_pages=host_pages,
            requests=len(prompts),
            prompt_tokens=prompt_tokens,
            cached_tokens=stats.prefix_hit_tokens,
            host_hit_tokens=stats.host_hit_tokens,
            prefill_tokens=prompt_tokens - stats.prefix_hit_tokens,
            ttft_p50_s=float(np.median(ttfts)),
            ttft_mean_s=float(np.mean(ttfts)),
            host_offloads=stats.host_offloads,
        )
        outputs[host_cache] = outs
    off, on = runs[False], runs[True]
    return HostCacheReport(
        machine=machine_description(),
        model=loaded.config.name,
        pool_tokens=pool_tokens,
        documents=documents,
        doc_tokens=doc_tokens,
        rounds=rounds,
        off=off,
        on=on,
        outputs_equal=outputs[False] == outputs[True],
        prefill_saved=1 - on.prefill_tokens / off.prefill_tokens,
        ttft_p50_ratio=on.ttft_p50_s / off.ttft_p50_s,
    )


def render(report: HostCacheReport) -> str:
    lines = [
        f"kvd bench host-cache: {report.model}, pool of {report.pool_tokens:,} tokens per group, "
        f"{report.documents} documents x {report.doc_tokens} tokens, {report.rounds} rounds",
        f"machine: {report.machine}",
        "",
        "host cache        prompt tokens  cached  of them host  prefill computed  TTFT p50  "
        "TTFT mean",
    ]
    for run in (report.off, report.on):
        label = f"on ({run.host_pages} pages)" if run.host_cache else "off"
        lines.append(
            f"{label:<16}  {run.prompt_tokens:>13,}  {run.cached_tokens:>6,}  "
            f"{run.host_hit_tokens:>12,}  {run.prefill_tokens:>16,}  {run.ttft_p50_s:>7.3f}s"
            f"  {run.ttft_mean_s:>8.3f}s"
        )
    lines += [
        "",
        f"prefill tokens saved by the host cache: {report.prefill_saved:.1%}; TTFT p50 on/off: "
        f"{report.ttft_p50_ratio:.2f}x; greedy outputs equal: {report.outputs_equal}",
    ]
    return "\n".join(lines)
