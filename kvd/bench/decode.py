"""``kvd bench decode``: kvd's engine next to transformers, same workload, same run.

Workload: ``batch`` prompts of ``prompt_len`` random tokens, greedy, exactly
``new_tokens`` generated each. Reported per batch size: decode tokens/s
(aggregate, after the first token), time to first token, and for kvd the
fraction of this machine's GEMM roofline (f32 matmul measured in the same run)
that the decode achieves.

kvd runs each batch in interleaved rounds with overlapped steps on and off
(``scheduler.overlap``), so that the machine's drift between rounds falls on
both alike; each figure is the median of its rounds.

By default the engine is sized for the workload alone (as many rows as the
largest batch, a context just long enough). With a daemon's config file it
is the engine ``kvd serve`` builds from that file (its rows, context length,
pool, weights and products): the step time a client of that daemon should
see between tokens, which the engine's size changes (a batch-1 step with a
128-token prompt measured 19.2 ms on the workload's engine and 16.6 ms on
the dev config's, four engines in one process, 2026-12-05).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from kvd.bench.kv import machine_description

if TYPE_CHECKING:
    from kvd.engine.engine import Engine
    from kvd.engine.loader import LoadedModel


class DecodeFigures(msgspec.Struct, frozen=True):
    system: str
    batch: int
    ttft_s: float
    decode_tokens_per_s: float
    total_s: float
    rounds: list[float] = []  # decode tokens/s of each round (kvd)


class DecodeReport(msgspec.Struct, frozen=True):
    machine: str
    model: str
    dtype: str
    prompt_len: int
    new_tokens: int
    gemm_gflops: float
    flops_per_token: float
    warm_up_s: float
    kvd: list[DecodeFigures]
    transformers: list[DecodeFigures]
    transformers_note: str | None = None
    # The daemon config the engine was built from (None: sized for the workload).
    config: str | None = None
    engine: str = ""  # the engine's size, in words


def gemm_roofline(size: int = 2048, repeats: int = 5) -> float:
    """f32 GEMM GFLOP/s of this machine (numpy, best of a few)."""
    a = np.random.default_rng(0).standard_normal((size, size), dtype=np.float32)
    b = np.random.default_rng(1).standard_normal((size, size), dtype=np.float32)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


def _prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    # Token ids from the ordinary text range (past the specials and byte tokens).
    return [
        [2, *rng.integers(1000, min(vocab, 200_000), length - 1).tolist()] for _ in range(batch)
    ]


def _one_run(generator: Any, prompts: list[list[int]], params: Any) -> tuple[float, float, float]:
    """(time to the last first token, decode tokens/s after it, total seconds)."""
    generator.kv.flush_cache()
    start = time.perf_counter()
    results = generator.generate(prompts, [params] * len(prompts))
    total = time.perf_counter() - start
    ttft = max(r.first_token_s or 0.0 for r in results)
    produced = sum(len(r.completion_ids) - 1 for r in results)
    return ttft, produced / (total - ttft), total


def matrix_elements(value: Any) -> int:
    """Parameters in a weight: an array's elements, an int8 weight's values."""
    from kvd.engine.wquant import matrix_shape

    return math.prod(matrix_shape(value))


def run_decode_bench(
    batches: tuple[int, ...] = (1, 8, 32),
    prompt_len: int = 128,
    new_tokens: int = 64,
    dtype: str = "float32",
    baseline: bool = True,
    say: Callable[[str], None] = lambda _text: None,
    quantization: str = "auto",
    rounds: int = 3,
    matmul: str = "xla",
    config_path: Path | None = None,
) -> DecodeReport:
    """``config_path``: a daemon's config file, whose engine is measured
    (``dtype``, ``quantization`` and ``matmul`` are then the file's)."""
    from kvd.engine.heap import keep_freed_memory
    from kvd.engine.loader import EMBEDDED_MODEL, embedded_gguf_path
    from kvd.oneshot.batch import BatchGenerator
    from kvd.sched.sampling_params import SamplingParams

    say("measuring the GEMM roofline")
    roofline = gemm_roofline()
    if config_path is None:
        say(f"loading {EMBEDDED_MODEL}")
        model, engine = _workload_engine(
            batches, prompt_len, new_tokens, dtype, quantization, matmul
        )
        name = EMBEDDED_MODEL
    else:
        say(f"building the engine of {config_path}")
        model, engine, name = _daemon_engine(config_path, batches, prompt_len, new_tokens)
        dtype = engine.config.dtype
    cfg = model.config
    size = engine.config
    described = (
        f"{size.max_num_seqs} rows, max_model_len {size.max_model_len}, "
        f"{size.pool_tokens:,} pool tokens, matmul {size.matmul}"
    )
    say("compiling")
    warm = engine.warm_up()
    keep_freed_memory()  # as a daemon does once it is ready (kvd/engine/heap.py)
    generator = BatchGenerator(engine)
    greedy = SamplingParams(temperature=0.0, max_tokens=new_tokens)
    ours: list[DecodeFigures] = []
    for batch in batches:
        prompts = _prompts(batch, prompt_len, cfg.vocab_size, seed=batch)
        runs: dict[bool, list[tuple[float, float, float]]] = {True: [], False: []}
        for round_ in range(rounds):
            for overlap in (True, False) if round_ % 2 else (False, True):
                scheduler = generator.scheduler
                scheduler.config = msgspec.structs.replace(scheduler.config, overlap=overlap)
                runs[overlap].append(_one_run(generator, prompts, greedy))
                rate = runs[overlap][-1][1]
                mode = "overlapped" if overlap else "serial"
                say(f"kvd batch {batch}, round {round_ + 1}, {mode}: {rate:.1f} tok/s")
        for overlap, system in ((True, "kvd"), (False, "kvd serial")):
            ttft, rate, total = (statistics.median(v) for v in zip(*runs[overlap], strict=True))
            rates = [round(r[1], 2) for r in runs[overlap]]
            ours.append(DecodeFigures(system, batch, ttft, rate, total, rates))
    theirs: list[DecodeFigures] = []
    note = None
    if baseline and name != EMBEDDED_MODEL:
        note = f"the transformers baseline runs the embedded model, not {name}: no baseline"
    elif baseline:
        try:
            theirs = _transformers_baseline(
                embedded_gguf_path(), batches, prompt_len, new_tokens, cfg.vocab_size, say
            )
        except ImportError:
            note = "transformers is not installed (pip install 'kvd[test]'): no baseline"
    params = sum(
        matrix_elements(value) for layer in model.params["layers"] for value in layer.values()
    )
    flops_per_token = 2.0 * (params + cfg.vocab_size * cfg.hidden_size)
    return DecodeReport(
        machine=machine_description(),
        model=name,
        dtype=dtype if model.quantization == "none" else f"{dtype}, {model.quantization} weights",
        prompt_len=prompt_len,
        new_tokens=new_tokens,
        gemm_gflops=roofline,
        flops_per_token=flops_per_token,
        warm_up_s=warm,
        kvd=ours,
        transformers=theirs,
        transformers_note=note,
        config=None if config_path is None else str(config_path),
        engine=described,
    )


def _workload_engine(
    batches: tuple[int, ...],
    prompt_len: int,
    new_tokens: int,
    dtype: str,
    quantization: str,
    matmul: str,
) -> tuple[LoadedModel, Engine]:
    """The embedded model on an engine sized for the workload alone."""
    from kvd.engine.engine import Engine, EngineConfig
    from kvd.engine.loader import EMBEDDED_MODEL, load_model

    model = load_model(EMBEDDED_MODEL, dtype, quantization)
    config = EngineConfig(
        dtype=dtype,
        max_model_len=prompt_len + new_tokens + 16,
        max_num_seqs=max(batches),
        max_num_batched_tokens=512,
        pool_tokens=max(batches) * (prompt_len + new_tokens + 32),
        matmul=matmul,
    )
    return model, Engine(model, config)


class ConfigUnfit(ValueError):
    """The daemon's engine cannot run the workload as asked: said in one line."""


def _daemon_engine(
    path: Path, batches: tuple[int, ...], prompt_len: int, new_tokens: int
) -> tuple[LoadedModel, Engine, str]:
    """The engine ``kvd serve --config path`` builds, and its model's name."""
    from kvd.server.config import load_config
    from kvd.server.loading import build_engine

    config = load_config(path)
    limits = config.model
    if max(batches) > limits.max_num_seqs:
        raise ConfigUnfit(
            f"batch {max(batches)} exceeds {path}'s max_num_seqs ({limits.max_num_seqs})"
        )
    if prompt_len + new_tokens > limits.max_model_len:
        raise ConfigUnfit(
            f"a {prompt_len}-token prompt and {new_tokens} new tokens exceed {path}'s "
            f"max_model_len ({limits.max_model_len})"
        )
    engine, model, _page_bytes = build_engine(config, lambda _event, _fields: None)
    if max(batches) * (prompt_len + new_tokens) > engine.config.pool_tokens:
        raise ConfigUnfit(
            f"batch {max(batches)} of {prompt_len + new_tokens} tokens exceeds the pool of "
            f"{path} ({engine.config.pool_tokens:,} tokens)"
        )
    return model, engine, limits.source


def load_transformers(gguf: Any, say: Callable[[str], None]) -> Any:
    """transformers' Gemma from the same GGUF file, in f32 (raises ImportError
    without the test extra)."""
    import torch
    from transformers import AutoModelForCausalLM

    say("loading the transformers baseline (f32)")
    return AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    ).eval()


def _transformers_baseline(
    gguf: Any,
    batches: tuple[int, ...],
    prompt_len: int,
    new_tokens: int,
    vocab: int,
    say: Callable[[str], None],
) -> list[DecodeFigures]:
    import torch

    model = load_transformers(gguf, say)
    figures = []
    for batch in batches:
        ids = torch.tensor(_prompts(batch, prompt_len, vocab, seed=batch))
        with torch.no_grad():
            start = time.perf_counter()
            model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
            ttft = time.perf_counter() - start
            start = time.perf_counter()
            model.generate(
                ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False
            )
            total = time.perf_counter() - start
        rate = batch * (new_tokens - 1) / max(total - ttft, 1e-9)
        figures.append(DecodeFigures("transformers", batch, ttft, rate, total))
        say(f"transformers batch {batch}: {rate:.1f} tok/s")
    return figures


def _engine_origin(report: DecodeReport) -> str:
    return "sized for the workload" if report.config is None else f"as served from {report.config}"


def render(report: DecodeReport) -> str:
    lines = [
        f"kvd bench decode: {report.model} ({report.dtype}), prompt {report.prompt_len}, "
        f"{report.new_tokens} new tokens, greedy",
        f"machine: {report.machine}; f32 GEMM roofline {report.gemm_gflops:.1f} GFLOP/s; "
        f"kvd warm-up {report.warm_up_s:.1f}s",
        f"engine: {_engine_origin(report)} ({report.engine})",
        "",
        f"{'system':<13} {'batch':>5} {'decode tok/s':>13} {'TTFT s':>8} {'total s':>8} "
        f"{'vs HF b1':>9} {'roofline':>9}",
    ]
    base = next((f for f in report.transformers if f.batch == 1), None)
    serial = {f.batch: f for f in report.kvd if f.system == "kvd serial"}
    for f in [*report.kvd, *report.transformers]:
        ratio = f"{f.decode_tokens_per_s / base.decode_tokens_per_s:.1f}x" if base else "-"
        achieved = f.decode_tokens_per_s * report.flops_per_token / 1e9 / report.gemm_gflops
        lines.append(
            f"{f.system:<13} {f.batch:>5} {f.decode_tokens_per_s:>13.1f} {f.ttft_s:>8.2f} "
            f"{f.total_s:>8.2f} {ratio:>9} {achieved:>8.1%}"
        )
    if report.transformers_note:
        lines.append(report.transformers_note)
    overlapped = [f for f in report.kvd if f.system == "kvd" and f.batch in serial]
    if overlapped:
        lines += ["", "overlapped steps against the serial loop (median of interleaved rounds):"]
        for f in overlapped:
            other = serial[f.batch]
            lines.append(
                f"  batch {f.batch:>4}: {f.decode_tokens_per_s:.1f} against "
                f"{other.decode_tokens_per_s:.1f} tok/s, "
                f"{f.decode_tokens_per_s / other.decode_tokens_per_s:.3f}x "
                f"(rounds {f.rounds} against {other.rounds})"
            )
    return "\n".join(lines)
