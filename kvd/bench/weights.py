"""``kvd bench weights``: the embedded model with float weights (f32, or bf16
as an accelerator would hold them) next to int8 weights (its GGUF blocks kept,
``kvd.engine.wquant``, dequantised to the same compute dtype inside each
step), in one process, rounds interleaved (this machine's speed drifts by up
to 2x within minutes).

Reported per format: the weights' bytes, decode tokens/s at each batch size
(aggregate, decode steps alone), prefill tokens/s at each prompt length, and
for int8 against the float weights: greedy agreement on varied prompts (code, several
languages, prompts past the sliding window), with each divergence's top-2
logit gap in the float run (a divergence at a near tie is summation order),
and programs compiled after warm-up.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np

from kvd.bench.kv import device_description, machine_description

_STORY = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting each "
    "of the one hundred and twelve steps, checking the brass fittings, trimming the wick "
    "and polishing the great lens until it shone. Ships passed far out on the grey water, "
    "and on clear nights he could see the lights of the harbour town across the bay. "
)
# Varied on purpose: prose, code, arithmetic, several scripts and languages,
# and two prompts past the 270M's 512-token sliding window.
PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "import numpy as np\n\ndef softmax(x):\n    ",
    "fn main() {\n    let v: Vec<i32> = (1..10).collect();\n",
    "SELECT name, COUNT(*) FROM orders GROUP BY",
    "<html>\n  <head>\n    <title>",
    "Q: What is 17 multiplied by 23?\nA:",
    "1, 1, 2, 3, 5, 8, 13,",
    "Once upon a time, in a village at the edge of a dark forest, there lived",
    "Dear hiring manager, I am writing to apply for the position of",
    "The mitochondria is the powerhouse of the cell. Its main function is",
    "In 1969, the Apollo 11 mission",
    "Les mathématiques sont",
    "Der schnellste Weg zum Bahnhof ist",
    "El clima en Madrid durante el verano es",
    "東京は日本の",
    "Москва — столица",
    "북한산은 서울의",
    "भारत की राजधानी",
    "Translate to German: The weather is lovely today, so we will walk to the market.",
    _STORY * 8 + "The keeper's name was",
    "Summarise the following.\n\n" + _STORY * 10 + "\nSummary:",
)
_SHORT = {"float32": "f32", "bfloat16": "bf16"}
NEAR_TIE = 0.05  # a top-2 logit gap below this: a divergence summation order may explain


class FormatFigures(msgspec.Struct, frozen=True):
    quantization: str
    weight_bytes: int
    warm_up_s: float
    decode_tokens_per_s: dict[str, float]  # by batch size (best round)
    prefill_tokens_per_s: dict[str, float]  # by prompt length (best round)
    late_compiles: int


class Divergence(msgspec.Struct, frozen=True):
    prompt: int
    position: int  # generated token index of the first difference
    float_top2_gap: float  # the float weights' logit gap between their best two tokens there


class WeightsReport(msgspec.Struct, frozen=True):
    machine: str
    model: str
    dtype: str  # compute dtype, and the float weights' dtype
    rounds: int
    new_tokens: int
    formats: list[FormatFigures]
    prompts: int
    equal: int
    divergences: list[Divergence]
    near_tie: float = NEAR_TIE


def first_difference(ours: list[int], theirs: list[int]) -> int | None:
    """Index of the first differing token (one ending early differs there)."""
    for index, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        if a != b:
            return index
    return None if len(ours) == len(theirs) else min(len(ours), len(theirs))


def _best(rates: list[float]) -> float:
    return max(rates) if rates else 0.0


def run_weights_bench(
    batches: tuple[int, ...] = (1, 8, 32),
    prefill: tuple[int, ...] = (512,),
    new_tokens: int = 32,
    rounds: int = 2,
    say: Callable[[str], None] = lambda _text: None,
    dtype: str = "float32",
) -> WeightsReport:
    from kvd.engine.engine import Engine, EngineConfig
    from kvd.engine.loader import EMBEDDED_MODEL, load_model
    from kvd.oneshot.batch import BatchGenerator
    from kvd.sched.sampling_params import SamplingParams

    formats = ("none", "int8")
    engines: dict[str, Any] = {}
    warm: dict[str, float] = {}
    sizes: dict[str, int] = {}
    tokenizer = None
    longest = max(max(prefill), 1024) + new_tokens + 16
    for quantization in formats:
        say(f"loading {EMBEDDED_MODEL} ({quantization})")
        model = load_model(EMBEDDED_MODEL, dtype, quantization)
        tokenizer = model.tokenizer
        sizes[quantization] = model.weight_bytes
        engine = Engine(
            model,
            EngineConfig(
                dtype=dtype,
                max_model_len=longest,
                max_num_seqs=max(max(batches), len(PROMPTS)),
                max_num_batched_tokens=512,
                pool_tokens=max(max(batches), len(PROMPTS)) * longest,
            ),
        )
        say(f"compiling ({quantization})")
        warm[quantization] = engine.warm_up()
        engines[quantization] = BatchGenerator(engine)
        del model
    assert tokenizer is not None
    rng = np.random.default_rng(0)
    steady = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    compared = SamplingParams(temperature=0.0, max_tokens=new_tokens, logprobs=True, top_logprobs=2)
    decode: dict[str, dict[int, list[float]]] = {q: {b: [] for b in batches} for q in formats}
    prompt_rate: dict[str, dict[int, list[float]]] = {q: {n: [] for n in prefill} for q in formats}
    for round_ in range(rounds):
        for quantization in formats:
            generator = engines[quantization]
            engine = generator.scheduler.executor
            for batch in batches:
                prompts = [[2, *rng.integers(1000, 200_000, 127).tolist()] for _ in range(batch)]
                generator.kv.flush_cache()
                tokens, seconds = engine.decode_tokens, engine.decode_seconds
                generator.generate(prompts, [steady] * batch)
                rate = (engine.decode_tokens - tokens) / (engine.decode_seconds - seconds)
                decode[quantization][batch].append(rate)
                say(f"round {round_ + 1} {quantization} decode batch {batch}: {rate:.1f} tok/s")
            for length in prefill:
                prompt = [2, *rng.integers(1000, 200_000, length - 1).tolist()]
                generator.kv.flush_cache()
                start = time.perf_counter()
                generator.generate([prompt], [SamplingParams(temperature=0.0, max_tokens=1)])
                rate = length / (time.perf_counter() - start)
                prompt_rate[quantization][length].append(rate)
                say(f"round {round_ + 1} {quantization} prefill {length}: {rate:.0f} tok/s")
    texts = [tokenizer.encode(text) for text in PROMPTS]
    greedy = {q: engines[q].generate(texts, [compared] * len(texts)) for q in formats}
    divergences = []
    for index, (ours, theirs) in enumerate(zip(greedy["int8"], greedy["none"], strict=True)):
        position = first_difference(ours.completion_ids, theirs.completion_ids)
        if position is not None:
            top = theirs.alternatives[position] if position < len(theirs.alternatives) else None
            gap = float(top[0][1] - top[1][1]) if top and len(top) > 1 else float("nan")
            divergences.append(Divergence(index, position, gap))
    figures = [
        FormatFigures(
            q,
            sizes[q],
            warm[q],
            {str(b): _best(decode[q][b]) for b in batches},
            {str(n): _best(prompt_rate[q][n]) for n in prefill},
            engines[q].scheduler.executor.late_compiles,
        )
        for q in formats
    ]
    return WeightsReport(
        f"{machine_description()}, on {device_description()}",
        EMBEDDED_MODEL,
        dtype,
        rounds,
        new_tokens,
        figures,
        len(PROMPTS),
        len(PROMPTS) - len(divergences),
        divergences,
    )


def render(report: WeightsReport) -> str:
    floats, int8 = report.formats
    name = _SHORT.get(report.dtype, report.dtype)
    lines = [
        f"kvd bench weights: {report.model}, {name} against int8 weights (computing in "
        f"{name}), {report.rounds} interleaved rounds (best of each)",
        f"machine: {report.machine}",
        "",
        f"{'':<22} {name:>10} {'int8':>10} {'int8/' + name:>9}",
        f"{'weight MiB':<22} {floats.weight_bytes / 2**20:>10.0f} "
        f"{int8.weight_bytes / 2**20:>10.0f} {int8.weight_bytes / floats.weight_bytes:>8.2f}x",
    ]
    for batch, rate in floats.decode_tokens_per_s.items():
        theirs = int8.decode_tokens_per_s[batch]
        lines.append(
            f"{'decode tok/s, batch ' + batch:<22} {rate:>10.1f} {theirs:>10.1f} "
            f"{theirs / rate:>8.2f}x"
        )
    for length, rate in floats.prefill_tokens_per_s.items():
        theirs = int8.prefill_tokens_per_s[length]
        lines.append(
            f"{'prefill tok/s, ' + length:<22} {rate:>10.0f} {theirs:>10.0f} {theirs / rate:>8.2f}x"
        )
    lines.append(
        f"{'warm-up s':<22} {floats.warm_up_s:>10.1f} {int8.warm_up_s:>10.1f}"
        f"   late compiles: {floats.late_compiles}, {int8.late_compiles}"
    )
    lines.append("")
    lines.append(
        f"greedy, {report.new_tokens} tokens: {report.equal} of {report.prompts} prompts equal"
    )
    for d in report.divergences:
        tie = "near tie" if d.float_top2_gap < report.near_tie else "NOT a near tie"
        lines.append(
            f"  prompt {d.prompt}: first differs at token {d.position}, {name} top-2 gap "
            f"{d.float_top2_gap:.4f} ({tie})"
        )
    return "\n".join(lines)
