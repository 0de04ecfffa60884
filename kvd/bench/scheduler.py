"""``kvd bench scheduler``: host overhead per step, and the recompute/swap crossover.

Host overhead is everything a scheduling step does on the host (admission,
fair-share order, KV bookkeeping, batch assembly, token handling) and not the
model call: the step's wall time minus the time the engine spent in device
programs and their results. The model is a small random Gemma 3 so 1,024
sequences fit in one step; the bookkeeping does not depend on its size.

The anchor, nano-vllm's scheduler, is timed the same way: each of its steps
right after one of kvd's device steps of as many sequences, because the host
work that follows a device step finds its objects evicted from the caches
(on this machine's CPU backend the model streams its weights and KV through
them; measured: a batch's stop decisions took 0.18 ms right after the
device step and 0.02 ms when repeated at once). That device step is the
program alone (kvd's last timed step dispatched again, its result read), not
a whole scheduling step of kvd's: kvd's own host work after it would run
between the device and nano-vllm's step, and warm the caches for it. Timed
back to back, with no device step between, it is also shown.

The crossover comes from the cost model's two rates, measured on the embedded
Gemma 3 270M on this machine (the rates a daemon measures at start-up).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from kvd.bench.kv import machine_description


class OverheadFigures(msgspec.Struct, frozen=True):
    running: int
    steps: int
    mean_ms: float
    p50_ms: float
    p99_ms: float
    device_ms: float
    # nano-vllm's schedule() + postprocess() at as many sequences, timed in
    # the same run (kvd.bench.nanovllm): each step after one of kvd's device
    # steps, and back to back; None without a checkout.
    anchor_p50_ms: float | None = None
    anchor_back_to_back_p50_ms: float | None = None


class SchedulerBenchReport(msgspec.Struct, frozen=True):
    machine: str
    overhead: list[OverheadFigures]
    rates_model: str | None = None
    prefill_tokens_per_s: float | None = None
    copy_bytes_per_s: float | None = None
    crossover_tokens: int | None = None
    crossover_note: str | None = None
    anchor: str | None = None


def bench_overhead(running: int, steps: int) -> tuple[OverheadFigures, Callable[[], object]]:
    """kvd's host time per decode step with ``running`` sequences, and a
    function running the device program of its last timed step again (the
    anchor's device steps; it leaves the KV manager as it is)."""
    from kvd.engine.engine import Engine, EngineConfig
    from kvd.engine.loader import random_model
    from kvd.sched.sampling_params import SamplingParams
    from kvd.sched.scheduler import Scheduler, SchedulerConfig, TenantConfig

    engine = Engine(
        random_model(vocab_size=256, sliding_window=32),
        EngineConfig(
            block_size=16,
            max_model_len=256,
            max_num_seqs=running,
            max_num_batched_tokens=max(64, running),
            pool_tokens=running * 256,  # every sequence to its end: nothing preempted
        ),
    )
    engine.warm_up()
    # Serial steps: the host's own work is the wall time less the device's,
    # which an overlapped step would hide (the same work either way).
    scheduler = Scheduler(engine, SchedulerConfig(overlap=False))
    for name in ("alice", "bob", "carol", "dave"):
        scheduler.set_tenant(TenantConfig(name, max_queue=running * 2))
    rng = np.random.default_rng(running)
    # Long enough for the anchor's steps after the timed ones.
    params = SamplingParams(temperature=0.0, max_tokens=240)
    for i in range(running):
        prompt = [2, *rng.integers(10, 250, 8).tolist()]
        scheduler.submit(f"r{i}", ("alice", "bob", "carol", "dave")[i % 4], prompt, params)
    while scheduler.stats().waiting:  # admit everyone: the measured steps are all decode
        scheduler.step()
    dispatch = engine.dispatch
    last: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def remembered(*args: Any, **kwargs: Any) -> Any:
        last[:] = [(args, kwargs)]
        return dispatch(*args, **kwargs)

    engine.dispatch = remembered  # type: ignore[method-assign]
    times: list[float] = []
    device: list[float] = []
    for _ in range(steps):
        before = engine.device_seconds
        start = time.perf_counter()
        scheduler.step()
        wall = time.perf_counter() - start
        spent = engine.device_seconds - before
        times.append(wall - spent)
        device.append(spent)
    times.sort()
    figures = OverheadFigures(
        running=running,
        steps=steps,
        mean_ms=statistics.fmean(times) * 1e3,
        p50_ms=times[len(times) // 2] * 1e3,
        p99_ms=times[min(len(times) - 1, int(len(times) * 0.99))] * 1e3,
        device_ms=statistics.fmean(device) * 1e3,
    )
    engine.dispatch = dispatch  # type: ignore[method-assign]
    ((args, kwargs),) = last

    def device_step() -> object:
        return dispatch(*args, **kwargs).result()

    return figures, device_step


def run_scheduler_bench(
    sizes: tuple[int, ...] = (64, 256, 1024),
    steps: int = 50,
    measure_crossover: bool = True,
    say: Callable[[str], None] = lambda _text: None,
    nano_vllm: Path | None = None,
) -> SchedulerBenchReport:
    """``nano_vllm``: a nano-vllm checkout, whose scheduler is timed at each
    size right after kvd's (``kvd.bench.nanovllm``)."""
    from kvd.bench import nanovllm

    # Loaded first: a missing checkout fails before the long part.
    nano = None if nano_vllm is None else nanovllm.load(nano_vllm)
    overhead = []
    for running in sizes:
        say(f"scheduler overhead at {running} running sequences")
        figures, device_step = bench_overhead(running, steps)
        if nano is not None:
            say(f"nano-vllm's scheduler at {running} running sequences")
            after, _mean = nanovllm.overhead_ms(nano, running, steps, between=device_step)
            back_to_back, _mean = nanovllm.overhead_ms(nano, running, steps)
            figures = msgspec.structs.replace(
                figures, anchor_p50_ms=after, anchor_back_to_back_p50_ms=back_to_back
            )
        overhead.append(figures)
    anchor = None if nano_vllm is None else f"nano-vllm at {nano_vllm}"
    if not measure_crossover:
        return SchedulerBenchReport(machine_description(), overhead, anchor=anchor)
    from kvd.engine.engine import Engine, EngineConfig
    from kvd.engine.loader import EMBEDDED_MODEL, load_model
    from kvd.sched.costmodel import measure_rates

    say(f"measuring recompute and swap rates on {EMBEDDED_MODEL}")
    engine = Engine(load_model(EMBEDDED_MODEL), EngineConfig(max_model_len=2048, pool_tokens=16384))
    engine.warm_up()
    rates = measure_rates(engine)  # on a scratch KV manager of its own
    crossover = rates.crossover_tokens()
    note = None
    if crossover is None:
        note = "recompute is cheaper at every length: swapping never pays on this machine"
    return SchedulerBenchReport(
        machine_description(),
        overhead,
        EMBEDDED_MODEL,
        rates.prefill_tokens_per_s,
        rates.copy_bytes_per_s,
        crossover,
        note,
        anchor,
    )


def render(report: SchedulerBenchReport) -> str:
    lines = [
        "kvd bench scheduler: host time per step (scheduling, KV bookkeeping, batch assembly;",
        "the model call excluded), all sequences decoding, four tenants",
        f"machine: {report.machine}",
        "",
        f"{'running':>8} {'steps':>6} {'mean ms':>9} {'p50 ms':>8} {'p99 ms':>8} {'model ms':>9}"
        + ("" if report.anchor is None else f" {'nano-vllm p50':>14} {'ratio':>6} {'b2b':>7}"),
    ]
    for f in report.overhead:
        line = (
            f"{f.running:>8} {f.steps:>6} {f.mean_ms:>9.3f} {f.p50_ms:>8.3f} {f.p99_ms:>8.3f} "
            f"{f.device_ms:>9.2f}"
        )
        if f.anchor_p50_ms is not None:
            line += f" {f.anchor_p50_ms:>14.3f} {f.p50_ms / f.anchor_p50_ms:>5.2f}x"
            if f.anchor_back_to_back_p50_ms is not None:
                line += f" {f.anchor_back_to_back_p50_ms:>7.3f}"
        lines.append(line)
    if report.anchor is not None:
        lines += [
            f"anchor: {report.anchor}, schedule() + postprocess() per decode step, 256-token",
            "blocks, each sequence a 256-token shared prefix + 256 unique tokens (PERF.md);",
            "each step timed right after a device step of kvd's of as many sequences, as",
            "kvd's are (b2b: its p50 back to back, with no device step between)",
        ]
    if report.prefill_tokens_per_s is not None and report.copy_bytes_per_s is not None:
        lines += [
            "",
            f"preemption cost model on {report.rates_model}:",
            f"  prefill        {report.prefill_tokens_per_s:,.0f} tokens/s",
            f"  device<->host  {report.copy_bytes_per_s / 1e9:,.2f} GB/s",
            "  crossover      "
            + (
                f"swap is cheaper above {report.crossover_tokens:,} tokens"
                if report.crossover_tokens is not None
                else str(report.crossover_note)
            ),
        ]
    return "\n".join(lines)
