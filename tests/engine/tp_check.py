"""Run as a script with several (simulated) devices: the sharded engine next
to the single-device one on the same model, for each case named; prints one
JSON object, keyed by case:

- ``tiny``: a random model with 6 KV heads, so its pool is split by head over
  2 devices (3 a device) and replicated over 4;
- ``tiny_int8``: the same with int8 weights, over 2 devices;
- ``real``: the 270M's greedy tokens over 2 devices;
- ``server``: the daemon (its real loader, the HTTP app, the tests' tiny
  config on the random model) with ``tensor_parallel = 2``: its greedy text
  next to a single-device engine's.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 \
        python -m tests.engine.tp_check
"""

from __future__ import annotations

import json
from functools import partial

import jax
import jax.numpy as jnp
import msgspec
import numpy as np

from kvd.engine.batching import build_step_batch
from kvd.engine.config import ModelConfig
from kvd.engine.engine import Engine, EngineConfig
from kvd.engine.loader import LoadedModel, load_model, random_model_with_tokenizer
from kvd.engine.model import forward
from kvd.engine.weights import quantised_params, random_params
from kvd.kv.geometry import interleaved_kinds
from kvd.kv.ledger import BudgetMode, TenantBudget
from kvd.kv.manager import KVManager
from kvd.oneshot.batch import BatchGenerator
from kvd.sched.sampling_params import SamplingParams

SERVER_PROMPT = "Split me in two"
SERVER_TOKENS = 12


def tiny() -> LoadedModel:
    config = ModelConfig(
        name="tiny-kv6",
        family="gemma3",
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_heads=12,
        num_kv_heads=6,
        head_dim=16,
        layer_kinds=interleaved_kinds(6, 3),
        sliding_window=12,
        max_position=256,
        query_pre_attn_scalar=16.0,
    )
    return LoadedModel(config, random_params(config, 7), None, "random", 0.0)  # type: ignore[arg-type]


def decode_logits(engine: Engine, prompts: list[list[int]]) -> np.ndarray:
    """Full logits of a decode step: each prompt but its last token is
    prefilled in one ragged step, then the last tokens decode together (past
    the sliding window for long prompts). Run by ``forward`` on the engine's
    (possibly sharded) weights and pool."""
    kv = KVManager(engine.layout, engine.num_pages, mode=BudgetMode.FREE)
    kv.set_tenant("t", TenantBudget())
    step = jax.jit(partial(forward, engine.spec))
    seqs = [kv.add_sequence(1000 + i, "t", p) for i, p in enumerate(prompts)]
    pool = engine.pool
    logits = None
    for chunk in ("prefill", "decode"):
        work = [(s, len(s.tokens) - 1 if chunk == "prefill" else 1) for s in seqs]
        for seq, n in work:
            kv.allocate(seq, n)
        batch = build_step_batch(
            work, engine.layout, 64, engine.config.max_num_seqs, engine.block_buckets[-1]
        )
        logits, pool = step(engine.params, pool, jax.tree_util.tree_map(jnp.asarray, batch))
        for seq, n in work:
            kv.commit(seq, n)
    for seq in seqs:
        kv.finish(seq)
    return np.asarray(logits)[: len(prompts)]


def server_case() -> dict[str, object]:
    """The daemon split over two devices gives the single-device engine's greedy text."""
    import tempfile
    from pathlib import Path

    import trio

    from kvd.server.daemon import load_engine
    from tests.server.harness import serving

    async def answer(directory: Path) -> str:
        # A short context, small steps, two rows: few programs to compile at
        # warm-up (each head program samples over the tokenizer's 262k vocabulary).
        async with serving(
            directory,
            loader=load_engine,
            tensor_parallel=2,
            max_model_len=64,
            max_num_seqs=2,
            max_num_batched_tokens=16,
        ) as served:
            reply = await served.complete(prompt=SERVER_PROMPT, max_tokens=SERVER_TOKENS)
            body = await reply.get_json()
            assert reply.status_code == 200, body
            await served.assert_whole()
            return str(body["choices"][0]["text"])

    model = random_model_with_tokenizer(max_position=256)  # as the daemon loads "random"
    reference = Engine(
        model, EngineConfig(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16)
    )
    tokenizer = model.tokenizer
    greedy = SamplingParams(temperature=0.0, max_tokens=SERVER_TOKENS)
    (one,) = BatchGenerator(reference).generate([tokenizer.encode(SERVER_PROMPT)], [greedy])
    with tempfile.TemporaryDirectory() as directory:
        text = trio.run(answer, Path(directory))
    expected = tokenizer.decode(one.completion_ids)
    return {"same_text": text == expected, "texts": [expected, text]}


def weight_values(weight: object) -> jax.Array:
    """A weight's array, or an int8 weight's values (its scales share its sharding)."""
    return getattr(weight, "values", weight)  # type: ignore[return-value]


def first_layer(params: dict) -> dict:
    """The first layer's weights, per layer or layer-stacked (``scan_layers``)."""
    return params["stack"] if "stack" in params else params["layers"][0]


def compare(
    model: LoadedModel,
    config: EngineConfig,
    prompts: list[list[int]],
    new: int,
    sizes: tuple[int, ...],
    with_logits: bool,
) -> dict[str, object]:
    """For each size, how the sharded engine compares with the single-device one."""
    greedy = SamplingParams(temperature=0.0, max_tokens=new, logprobs=True)
    report: dict[str, object] = {}
    reference = Engine(model, config)
    base_logits = decode_logits(reference, prompts) if with_logits else None
    base = BatchGenerator(reference).generate(prompts, [greedy] * len(prompts))
    for n in sizes:
        engine = Engine(model, msgspec.structs.replace(config, tensor_parallel=n))
        out = BatchGenerator(engine).generate(prompts, [greedy] * len(prompts))
        entry: dict[str, object] = {
            "same_tokens": [g.completion_ids for g in out] == [g.completion_ids for g in base],
            "max_logprob_diff": max(
                abs(a - b)
                for g, h in zip(out, base, strict=True)
                for a, b in zip(g.logprobs, h.logprobs, strict=False)
            ),
            "param_shards": len(weight_values(first_layer(engine.params)["q"]).sharding.device_set),
            "pool_split": engine.pool.sharding.shard_shape(engine.pool.shape) != engine.pool.shape,
        }
        data = engine.copy_out([1, 2, 3])  # pages the run wrote, now free
        engine.copy_in([7, 8, 9], data)
        entry["swap_roundtrip"] = bool(
            np.abs(data).sum() > 0 and np.array_equal(engine.copy_out([7, 8, 9]), data)
        )
        if base_logits is not None:
            entry["max_logit_diff"] = float(
                np.abs(decode_logits(engine, prompts) - base_logits).max()
            )
        report[str(n)] = entry
    return report


def main() -> dict[str, object]:
    from kvd.engine import compile_cache

    compile_cache.enable_default()  # a process's entry point enables JAX's cache
    report: dict[str, object] = {"devices": jax.device_count()}
    tiny_config = EngineConfig(
        block_size=4, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, pool_tokens=512
    )
    tiny_prompts = [[2, *range(10, 30)], [2, 5, 7], [2, *range(40, 49)]]
    # 30 new tokens: decodes well past the 12-token window.
    report["tiny"] = compare(tiny(), tiny_config, tiny_prompts, 30, (2, 4), with_logits=True)
    # int8 weights, values and scales split together (o's 192 rows are 6
    # blocks of 32: 3 a device over 2; over 4 the split would cut a block).
    quantised = tiny()
    quantised.params = quantised_params(quantised.params)
    small = msgspec.structs.replace(tiny_config, max_num_batched_tokens=32)  # fewer programs
    report["tiny_int8"] = compare(quantised, small, tiny_prompts, 30, (2,), with_logits=True)
    model = load_model("gemma3-270m", "float32")
    prompts = [model.tokenizer.encode(p) for p in ("The capital of France is", "def add(a, b):")]
    # Its layers scanned: the same sharding rules (stacked on a leading
    # axis), a fraction of the unrolled 18 layers' compile time; the tiny
    # model and the server case check the unrolled form.
    config = EngineConfig(
        max_model_len=256,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        pool_tokens=2048,
        scan_layers=True,
    )
    report["real"] = compare(model, config, prompts, 24, (2,), with_logits=False)
    report["server"] = server_case()
    return report


if __name__ == "__main__":
    print(json.dumps(main()))
