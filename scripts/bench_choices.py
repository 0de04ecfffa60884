"""n = 4 against n = 1 on one prompt, on the real engine (the embedded 270M
unless --model says otherwise): time to the first token of each, the pages
the request holds once every choice has started, whether greedy choices
equal n = 1's, and whether a seeded n = 4 request is reproducible. Each run
uses a prompt of its own (no prefix-cache hit from an earlier run); the
scheduler and the KV manager are kvd's own.

    .venv/bin/python scripts/bench_choices.py [--prompt-tokens 1000] [--model gemma3-270m]
"""

from __future__ import annotations

import argparse
import time

from kvd.engine.engine import Engine, EngineConfig
from kvd.engine.loader import load_model
from kvd.sched.sampling_params import SamplingParams
from kvd.sched.scheduler import Scheduler, TenantConfig


def run(
    engine: Engine, prompt: list[int], n: int, max_tokens: int, seed: int | None = None
) -> tuple[float, int, list]:
    scheduler = Scheduler(engine)
    scheduler.set_tenant(TenantConfig("t"))
    params = SamplingParams(
        temperature=0.0 if seed is None else 1.0, seed=seed, max_tokens=max_tokens, ignore_eos=True
    )
    start = time.perf_counter()
    first = scheduler.submit("r", "t", prompt, params, n=n)
    ttft = None
    pages = 0
    outputs: dict[int, list[int]] = {i: [] for i in range(n)}
    while scheduler.has_work():
        for event in scheduler.step().events:
            if event.token is None:
                continue
            if ttft is None:
                ttft = time.perf_counter() - start
            outputs[event.choice].append(event.token)
        if all(
            r.seq is not None and r.seq.num_computed >= len(prompt)
            for r in (first, *first.other_choices)
        ):
            pages = max(pages, scheduler.kv.referenced_pages())
    assert ttft is not None
    return ttft, pages, [outputs[i] for i in range(n)]


def main() -> None:
    from kvd.engine import compile_cache

    compile_cache.enable_default()  # a process's entry point enables JAX's cache
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model = load_model(args.model)
    config = EngineConfig(max_model_len=2048, max_num_seqs=8, max_num_batched_tokens=512)
    engine = Engine(model, config)
    print(f"warm-up: {engine.warm_up():.1f} s")
    vocab = model.config.vocab_size
    block = engine.layout.block_size
    for repeat in range(args.repeats):
        figures = {}
        for n in (1, 4):
            seed = 1 + 2 * repeat + (n > 1)
            prompt = [
                (seed * 7919 + i * 104_729) % (vocab - 1000) + 1000
                for i in range(args.prompt_tokens)
            ]
            figures[n] = run(engine, prompt, n, args.max_tokens)
        (t1, p1, _), (t4, p4, o4) = figures[1], figures[4]
        # Same prompt, greedy: every choice of n = 4 must equal n = 1's output.
        _, _, again = run(engine, prompt, 1, args.max_tokens)
        equal = all(choice == again[0] for choice in o4)
        # Seeded sampling: the same request twice gives the same four choices.
        seeded = [run(engine, prompt, 4, args.max_tokens, seed=11)[2] for _ in range(2)]
        reproducible = seeded[0] == seeded[1] and len({tuple(c) for c in seeded[0]}) > 1
        print(
            f"run {repeat + 1}: TTFT n=1 {1000 * t1:.0f} ms, n=4 {1000 * t4:.0f} ms "
            f"({t4 / t1:.2f}x); pages held n=1 {p1}, n=4 {p4} "
            f"(prompt: {args.prompt_tokens / block:.1f} blocks a page group); "
            f"greedy choices equal n=1's: {equal}; seeded n=4 reproducible "
            f"(and its choices differ): {reproducible}"
        )


if __name__ == "__main__":
    main()
