"""Question 5, where recompute stops beating swap: both preemptions executed
on the real engine for victims of 16 to 4,096 tokens, each timed from the
preemption to the victim's KV being back (a recompute drops the pages and
prefills again chunk by chunk; a swap copies the private pages to host
memory and back into new pages), next to the cost model the scheduler uses
(rates it measures at start-up) and the crossover it picks.

Both ways are timed until the victim has its K/V back and has decoded its
next token (the step either resume needs). The swapped-in pages are compared
byte for byte with what was copied out, so the experiment checks that the
swap brought the K/V back, not only how long it took.
Runs on whatever device JAX has (a TPU or GPU too); the result says which.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any

import msgspec

from kvd.bench.kv import device_description
from kvd.experiments.results import ExperimentResult, Say, new_result, pyplot, save_plot, timed
from kvd.kv.ledger import BudgetMode, TenantBudget
from kvd.kv.manager import KVManager
from kvd.kv.sequence import Sequence
from kvd.sched.sampling_params import SamplingParams

QUESTION = "where recompute stops beating swap"
TENANT = "victims"


class VictimTimes(msgspec.Struct, frozen=True):
    tokens: int  # computed when preempted
    pages: int  # private pages a swap copies
    recompute_s: float  # release, then prefill every token again and the next one
    swap_out_s: float
    swap_in_s: float  # copy back into new pages, then decode the next token
    predicted_recompute_s: float = 0.0
    predicted_swap_s: float = 0.0
    pages_restored: bool = True  # the swapped-in pages hold exactly what was copied out
    tokens_agree: bool = True  # both resumes decoded the same next token

    @property
    def swap_s(self) -> float:
        return self.swap_out_s + self.swap_in_s


class _Runner:
    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.kv = KVManager(engine.layout, engine.num_pages, mode=BudgetMode.FREE)
        self.kv.set_tenant(TENANT, TenantBudget())
        engine.bind(self.kv)
        self.chunk = engine.limits.max_num_batched_tokens
        self.greedy = SamplingParams(temperature=0.0, max_tokens=4)
        self.ids = itertools.count(1)

    def compute(self, seq: Sequence) -> int:
        """Compute every token of ``seq`` not yet computed; the sampled token."""
        kv = self.kv
        token = -1
        while seq.num_computed < len(seq.tokens):
            n = min(self.chunk, len(seq.tokens) - seq.num_computed)
            kv.allocate(seq, n)
            slots = kv.slots_of([seq])
            before = kv.step_columns(slots)
            sampled = self.engine.run([seq], [n], [self.greedy], slots, before).tokens
            kv.commit(seq, n)
            token = int(sampled[0])
        self.engine.barrier()
        return token

    def victim(self, tokens: int, vocab: int) -> VictimTimes:
        """A sequence of ``tokens`` computed tokens, preempted both ways; each
        way is timed until the victim has its K/V back and its next token."""
        kv, engine = self.kv, self.engine
        seq_id = next(self.ids)
        prompt = [(seq_id * 7919 + i * 104_729) % (vocab - 3) + 3 for i in range(tokens - 1)]
        seq = kv.add_sequence(seq_id, TENANT, prompt)
        try:
            kv.append_tokens(seq, [self.compute(seq)])  # ``tokens`` - 1 computed, one to decode
            kv.append_tokens(seq, [self.compute(seq)])  # ``tokens`` computed
            pages = kv.swap_out_pages(seq)
            start = time.perf_counter()
            copies = kv.begin_swap_out(seq)
            data = engine.copy_out([c.page for c in copies])
            kv.finish_swap_out(seq)
            out_s = time.perf_counter() - start
            start = time.perf_counter()
            back = kv.swap_in(seq)
            rows = {(c.group, c.block): i for i, c in enumerate(copies)}
            order = [rows[(c.group, c.block)] for c in back]
            engine.copy_in([c.page for c in back], data[order])
            engine.barrier()
            in_s = time.perf_counter() - start
            # Checked before the decode writes the next token into the last page.
            restored = bool((engine.copy_out([c.page for c in back]) == data[order]).all())
            start = time.perf_counter()
            after_swap = self.compute(seq)
            in_s += time.perf_counter() - start
            kv.finish(seq)
            # The same victim recomputed: pages dropped, everything prefilled again.
            seq = kv.add_sequence(next(self.ids), TENANT, prompt)
            kv.append_tokens(seq, [self.compute(seq)])
            kv.append_tokens(seq, [self.compute(seq)])
            start = time.perf_counter()
            kv.release(seq)
            after_recompute = self.compute(seq)
            recompute_s = time.perf_counter() - start
        finally:
            kv.finish(seq)
        return VictimTimes(
            tokens=tokens,
            pages=pages,
            recompute_s=recompute_s,
            swap_out_s=out_s,
            swap_in_s=in_s,
            pages_restored=restored,
            tokens_agree=after_swap == after_recompute,
        )


def run(out: Path, quick: bool, say: Say) -> ExperimentResult:
    from kvd.engine.engine import Engine, EngineConfig
    from kvd.engine.loader import EMBEDDED_MODEL, load_model, random_model
    from kvd.sched.costmodel import measure_rates

    result = new_result(
        "crossover",
        QUESTION,
        quick,
        [
            "victim tokens",
            "pages",
            "recompute ms",
            "swap ms (out+in)",
            "model recompute ms",
            "model swap ms",
            "measured winner",
            "model's pick",
            "swap restored",
        ],
    )
    with timed(result):
        longest = 256 if quick else 4096
        model = random_model(256, 32, max_position=512) if quick else load_model(EMBEDDED_MODEL)
        config = EngineConfig(
            max_model_len=longest + 64,
            pool_tokens=2 * (longest + 64),
            max_num_seqs=4,
            max_num_batched_tokens=64 if quick else 512,
        )
        say(f"warming up {model.config.name} ({device_description()})")
        engine = Engine(model, config)
        engine.warm_up()
        say("measuring the cost model's rates, as the daemon does at start-up")
        rates = measure_rates(engine)
        runner = _Runner(engine)
        vocab = model.config.vocab_size
        victims: list[VictimTimes] = []
        tokens = 16
        while tokens <= longest:
            say(f"  victim of {tokens} tokens")
            runs = [runner.victim(tokens, vocab) for _ in range(1 if tokens >= 1024 else 2)]
            victims.append(
                msgspec.structs.replace(
                    runs[0],
                    # The best of each (less noise); every run's checks must hold.
                    recompute_s=min(r.recompute_s for r in runs),
                    swap_out_s=min(r.swap_out_s for r in runs),
                    swap_in_s=min(r.swap_in_s for r in runs),
                    pages_restored=all(r.pages_restored for r in runs),
                    tokens_agree=all(r.tokens_agree for r in runs),
                    # What preemption_kind compares; both resumes also decode one token.
                    predicted_recompute_s=rates.recompute_s(tokens + 1),
                    predicted_swap_s=rates.swap_s(runs[0].pages) + rates.step_s(1, tokens + 1),
                )
            )
            tokens *= 2
        crossover = rates.crossover_tokens()
        measured_cross = _from_on(victims, lambda v: v.swap_s < v.recompute_s)
        for v in victims:
            result.rows.append(
                [
                    f"{v.tokens:,}",
                    str(v.pages),
                    f"{v.recompute_s * 1e3:,.1f}",
                    f"{v.swap_s * 1e3:,.1f}",
                    f"{v.predicted_recompute_s * 1e3:,.1f}",
                    f"{v.predicted_swap_s * 1e3:,.1f}",
                    "swap" if v.swap_s < v.recompute_s else "recompute",
                    "swap" if v.predicted_swap_s < v.predicted_recompute_s else "recompute",
                    ("pages exact" if v.pages_restored else "PAGES DIFFER")
                    + ("" if v.tokens_agree else ", tokens differ"),
                ]
            )
        result.data = {
            "device": device_description(),
            "model": model.config.name,
            "rates": msgspec.to_builtins(rates),
            "model_crossover_tokens": crossover,
            "measured_crossover_tokens": measured_cross,
            "victims": [msgspec.to_builtins(v) | {"swap_s": v.swap_s} for v in victims],
        }
        model_says = (
            f"the cost model (the scheduler's) picks swap from {crossover:,} "
            f"token{'s' if crossover != 1 else ''}"
            if crossover is not None
            else "the cost model never picks swap"
        )
        measured_says = (
            f"swap measured faster at every length from {measured_cross:,} tokens"
            if measured_cross is not None
            else f"recompute measured faster at every length up to {longest:,} tokens"
        )
        result.answer = (
            f"on {device_description()} with {model.config.name}: {measured_says}; {model_says} "
            f"(prefill {rates.prefill_tokens_per_s:,.0f} tokens/s, host copies "
            f"{rates.copy_bytes_per_s / 1e9:,.2f} GB/s)"
        )
        result.notes.append(
            "recompute = releasing the pages and prefilling every computed token again; swap = "
            "copying private pages out and into new pages, timed to completion; the model's "
            "figures are Rates.recompute_s and Rates.swap_s, which the scheduler's "
            "preemption_kind compares"
        )
        _plot(result, victims, crossover, out)
    return result


def _from_on(victims: list[VictimTimes], wins: Any) -> int | None:
    """The shortest victim from which ``wins`` holds at every longer one too."""
    first = None
    for v in reversed(victims):
        if not wins(v):
            break
        first = v.tokens
    return first


def _plot(
    result: ExperimentResult, victims: list[VictimTimes], crossover: int | None, out: Path
) -> None:
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(7, 4))
    x = [v.tokens for v in victims]
    axis.plot(x, [v.recompute_s * 1e3 for v in victims], "o-", label="recompute (measured)")
    axis.plot(x, [v.swap_s * 1e3 for v in victims], "s-", label="swap out + in (measured)")
    axis.plot(x, [v.predicted_recompute_s * 1e3 for v in victims], "--", label="recompute (model)")
    axis.plot(x, [v.predicted_swap_s * 1e3 for v in victims], ":", label="swap (model)")
    if crossover is not None and crossover <= x[-1] * 2:
        axis.axvline(crossover, color="grey", lw=0.8, label=f"model's crossover {crossover}")
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_xlabel("victim length (tokens)")
    axis.set_ylabel("ms")
    axis.set_title(
        f"Preemption cost, {result.data['model']} on {result.data['device']}", fontsize=9
    )
    axis.legend(fontsize=8)
    save_plot(figure, result, out)
