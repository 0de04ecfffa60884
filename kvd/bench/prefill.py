"""``kvd bench prefill``: prompt processing at growing lengths, and decode at a
long context against a short one, with transformers as the baseline in the
same run.

The engine is configured as the dev daemon is (``max_model_len`` 4096, 512
tokens per step, 32 sequences, a 1 GiB pool), so a long prompt is chunked as
the daemon chunks it. Each prompt is new to the prefix cache. Peak RSS is sampled while
each prompt runs (the process's resident set, weights and pool included), so
the growth from one length to the next is what a longer prompt costs in memory.
Decode tokens/s at a context counts the steps of decodes alone (their tokens
over their wall time, host work included) after the batch's prompts were
prefilled and cached, so every sequence of the batch decodes in them.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import msgspec
import numpy as np

from kvd.bench.decode import gemm_roofline, load_transformers
from kvd.bench.kv import machine_description


class PrefillFigures(msgspec.Struct, frozen=True):
    system: str
    prompt_tokens: int
    seconds: float
    tokens_per_s: float
    peak_rss_gib: float | None = None


class LongDecodeFigures(msgspec.Struct, frozen=True):
    batch: int
    context: int
    decode_tokens_per_s: float


class PrefillReport(msgspec.Struct, frozen=True):
    machine: str
    model: str
    dtype: str
    max_model_len: int
    max_num_batched_tokens: int
    gemm_gflops: float
    warm_up_s: float
    idle_rss_gib: float
    kvd: list[PrefillFigures]
    transformers: list[PrefillFigures]
    decode: list[LongDecodeFigures]
    late_compiles: int
    transformers_note: str | None = None


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@contextmanager
def peak_rss() -> Iterator[list[int]]:
    """Samples the resident set every 10 ms while the block runs; yields a
    one-element list that holds the peak when the block ends."""
    peak = [_rss_bytes()]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.01):
            peak[0] = max(peak[0], _rss_bytes())

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield peak
    finally:
        done.set()
        thread.join()
        peak[0] = max(peak[0], _rss_bytes())


def _prompt(length: int, vocab: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [2, *rng.integers(1000, min(vocab, 200_000), length - 1).tolist()]


GIB = float(1 << 30)


def run_prefill_bench(
    lengths: tuple[int, ...] = (128, 512, 600, 2048, 4000),
    decode_batches: tuple[int, ...] = (1, 8),
    decode_contexts: tuple[int, int] = (128, 4000),
    new_tokens: int = 32,
    dtype: str = "float32",
    baseline: bool = True,
    say: Callable[[str], None] = lambda _text: None,
    pool_bytes: int = 1 << 30,
) -> PrefillReport:
    from kvd.engine.engine import Engine, EngineConfig
    from kvd.engine.loader import EMBEDDED_MODEL, embedded_gguf_path, load_model
    from kvd.kv.layout import build_layout
    from kvd.oneshot.batch import BatchGenerator
    from kvd.sched.sampling_params import SamplingParams

    say("measuring the GEMM roofline")
    roofline = gemm_roofline()
    say(f"loading {EMBEDDED_MODEL}")
    model = load_model(EMBEDDED_MODEL, dtype)
    vocab = model.config.vocab_size
    longest = max(*lengths, decode_contexts[1])
    # The dev daemon's pool: 1 GiB, in tokens per page group as the daemon sizes it.
    block_size = EngineConfig().block_size
    layout = build_layout(model.config.kv_geometry(dtype), block_size)
    config = EngineConfig(
        dtype=dtype,
        block_size=block_size,
        max_model_len=4096,
        max_num_seqs=32,
        max_num_batched_tokens=512,
        pool_tokens=layout.pool_tokens(pool_bytes),
    )
    if longest + new_tokens >= config.max_model_len:
        raise ValueError(f"{longest} tokens plus {new_tokens} new exceed the 4096-token context")
    engine = Engine(model, config)
    say("compiling")
    warm = engine.warm_up(lambda done, total, what: say(f"  [{done}/{total}] {what}"))
    generator = BatchGenerator(engine)
    idle = _rss_bytes()
    one = SamplingParams(temperature=0.0, max_tokens=1)
    ours: list[PrefillFigures] = []
    for length in lengths:
        prompt = _prompt(length, vocab, seed=length)
        generator.kv.flush_cache()
        with peak_rss() as peak:
            start = time.perf_counter()
            generator.generate([prompt], [one])
            seconds = time.perf_counter() - start
        ours.append(PrefillFigures("kvd", length, seconds, length / seconds, peak[0] / GIB))
        say(f"kvd prefill {length}: {length / seconds:.1f} tok/s, peak RSS {peak[0] / GIB:.2f} GiB")
    late = engine.late_compiles
    del engine, generator
    # Decode gets an engine of its own, whose pool holds every prompt of the
    # largest batch at the longest context: the prompts are prefilled once and
    # cached, so that in the timed run all of a batch decodes together (with a
    # pool too small for that, early sequences finish decoding while later
    # ones still prefill, and the decode-only steps are of a smaller batch).
    need = max(decode_batches) * (max(decode_contexts) + new_tokens + 2 * block_size)
    engine = Engine(
        model, msgspec.structs.replace(config, pool_tokens=max(need, config.pool_tokens))
    )
    say("compiling the decode engine")
    engine.warm_up()
    generator = BatchGenerator(engine)
    decode: list[LongDecodeFigures] = []
    greedy = SamplingParams(temperature=0.0, max_tokens=new_tokens)
    for batch in decode_batches:
        for context in decode_contexts:
            prompts = [_prompt(context, vocab, seed=context * 100 + i) for i in range(batch)]
            generator.kv.flush_cache()
            generator.generate(prompts, [one] * batch)  # now in the prefix cache
            tokens, seconds = engine.decode_tokens, engine.decode_seconds
            generator.generate(prompts, [greedy] * batch)
            rate = (engine.decode_tokens - tokens) / (engine.decode_seconds - seconds)
            decode.append(LongDecodeFigures(batch, context, rate))
            say(f"kvd decode batch {batch} at context {context}: {rate:.1f} tok/s")
    late += engine.late_compiles
    del engine, generator
    theirs: list[PrefillFigures] = []
    note = None
    if baseline:
        try:
            theirs = _transformers_prefill(embedded_gguf_path(), lengths, vocab, say)
        except ImportError:
            note = "transformers is not installed (pip install 'kvd[test]'): no baseline"
    return PrefillReport(
        machine=machine_description(),
        model=EMBEDDED_MODEL,
        dtype=dtype,
        max_model_len=config.max_model_len,
        max_num_batched_tokens=config.max_num_batched_tokens,
        gemm_gflops=roofline,
        warm_up_s=warm,
        idle_rss_gib=idle / GIB,
        kvd=ours,
        transformers=theirs,
        decode=decode,
        late_compiles=late,
        transformers_note=note,
    )


def _transformers_prefill(
    gguf: Any, lengths: tuple[int, ...], vocab: int, say: Callable[[str], None]
) -> list[PrefillFigures]:
    import torch

    model = load_transformers(gguf, say)
    figures = []
    for length in lengths:
        ids = torch.tensor([_prompt(length, vocab, seed=length)])
        with torch.no_grad():
            start = time.perf_counter()
            model(ids, logits_to_keep=1)  # one forward over the prompt, the last row's logits
            seconds = time.perf_counter() - start
        figures.append(PrefillFigures("transformers", length, seconds, length / seconds))
        say(f"transformers prefill {length}: {length / seconds:.1f} tok/s")
    return figures


def render(report: PrefillReport) -> str:
    lines = [
        f"kvd bench prefill: {report.model} ({report.dtype}), max_model_len "
        f"{report.max_model_len}, {report.max_num_batched_tokens} tokens per step",
        f"machine: {report.machine}; f32 GEMM roofline {report.gemm_gflops:.1f} GFLOP/s; "
        f"kvd warm-up {report.warm_up_s:.1f}s; idle RSS {report.idle_rss_gib:.2f} GiB; "
        f"compiles after warm-up: {report.late_compiles}",
        "",
        f"{'system':<13} {'prompt':>7} {'seconds':>8} {'tok/s':>8} {'vs HF':>7} "
        f"{'peak RSS GiB':>13}",
    ]
    base = {f.prompt_tokens: f for f in report.transformers}
    for f in [*report.kvd, *report.transformers]:
        other = base.get(f.prompt_tokens)
        ratio = f"{f.tokens_per_s / other.tokens_per_s:.2f}x" if other else "-"
        rss = f"{f.peak_rss_gib:.2f}" if f.peak_rss_gib is not None else "-"
        lines.append(
            f"{f.system:<13} {f.prompt_tokens:>7} {f.seconds:>8.2f} {f.tokens_per_s:>8.1f} "
            f"{ratio:>7} {rss:>13}"
        )
    by_length = {f.prompt_tokens: f.tokens_per_s for f in report.kvd}
    if 512 in by_length and max(by_length) > 512:
        longest = max(by_length)
        lines.append(
            f"kvd tok/s at {longest} tokens / at 512: {by_length[longest] / by_length[512]:.2f}"
        )
    if report.decode:
        lines += ["", f"{'decode batch':>12} {'context':>8} {'tok/s':>8} {'vs shortest':>12}"]
        for d in report.decode:
            short = min((e for e in report.decode if e.batch == d.batch), key=lambda e: e.context)
            speedup = d.decode_tokens_per_s / short.decode_tokens_per_s
            lines.append(
                f"{d.batch:>12} {d.context:>8} {d.decode_tokens_per_s:>8.1f} {speedup:>11.2f}x"
            )
    if report.transformers_note:
        lines.append(report.transformers_note)
    return "\n".join(lines)
