"""``kvd bench int8``: what int8 K/V costs in accuracy and buys in capacity, on
the real model, side by side with full-precision K/V in one run.

1. **Greedy continuations.** Ten varied prompts, decoded greedily by two
   engines that differ only in the pool's dtype (the model's f32 and int8).
   Per prompt: whether the first ``tokens`` agree, and where they first differ.
2. **Logit error.** Each prompt and its f32 continuation, teacher-forced
   through the forward pass over each pool: the logits of every position
   compared (mean and max |difference|, and the mean |logit| for scale).
3. **Scale granularity.** The model's own K/V (from the f32 pool after those
   prefills) quantised three ways: a scale per token and KV head after the
   Hadamard rotation (kvd's choice), the same without the rotation, and a
   scale per block and KV head. The relative RMS error of each.
4. **Capacity.** Two engines built on the same pool bytes, bf16 and int8
   K/V: tokens each holds, from their own pool arrays (``nbytes``, pages).
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from kvd.bench.kv import machine_description

PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time, in a village at the edge of a dark forest, there lived",
    "Translate to German: The weather is lovely today, so we will walk to the market.",
    "List three primary colours:\n1.",
    "Q: What is 17 multiplied by 23?\nA:",
    "The mitochondria is the powerhouse of the cell. Its main function is",
    "SELECT name, COUNT(*) FROM orders GROUP BY",
    "Dear hiring manager, I am writing to apply for the position of",
    "In 1969, the Apollo 11 mission",
)


class PromptResult(msgspec.Struct, frozen=True):
    prompt_tokens: int
    equal: bool  # the first ``tokens`` greedy tokens agree
    first_difference: int | None  # index of the first differing generated token
    mean_abs_logit_error: float
    max_abs_logit_error: float


class Int8Report(msgspec.Struct, frozen=True):
    machine: str
    model: str
    chat: bool  # prompts in the model's chat turn format (as /v1/chat/completions sends them)
    tokens: int
    prompts: list[PromptResult]
    equal_prompts: int
    mean_abs_logit_error: float
    mean_abs_logit: float
    max_abs_logit_error: float
    per_token_relative_rms: float  # kvd's int8: rotated rows, a scale per row
    unrotated_per_token_relative_rms: float
    per_block_relative_rms: float  # a scale per 16-token block and KV head, rotated
    pool_bytes: int
    bf16_pool_tokens: int
    bf16_pool_array_bytes: int
    int8_pool_tokens: int
    int8_pool_array_bytes: int
    capacity_ratio: float  # int8 tokens per array byte / bf16 tokens per array byte


def run_int8_bench(
    model_name: str = "gemma3-270m", tokens: int = 32, pool: str = "256MiB", chat: bool = True
) -> Int8Report:
    from kvd.engine.engine import Engine, EngineConfig
    from kvd.engine.loader import load_model
    from kvd.oneshot.batch import BatchGenerator
    from kvd.sched.sampling_params import SamplingParams
    from kvd.units import parse_size

    loaded = load_model(model_name, "float32")
    from kvd.engine.tokenizer import ChatMessage

    tokenizer = loaded.tokenizer
    prompts = [
        tokenizer.chat_prompt([ChatMessage("user", text)]) if chat else tokenizer.encode(text)
        for text in PROMPTS
    ]
    longest = max(len(p) for p in prompts) + tokens
    greedy = SamplingParams(temperature=0.0, max_tokens=tokens)
    continuations: dict[str, list[list[int]]] = {}
    for kv_dtype in ("float32", "int8"):
        engine = Engine(
            loaded,
            EngineConfig(
                kv_dtype=kv_dtype,
                max_model_len=256,
                max_num_seqs=len(prompts),
                max_num_batched_tokens=512,
                pool_tokens=len(prompts) * (longest + 32),
            ),
        )
        generated = BatchGenerator(engine).generate(prompts, [greedy] * len(prompts))
        continuations[kv_dtype] = [g.completion_ids[:tokens] for g in generated]
        del engine
    forced = _TeacherForced(loaded)
    results: list[PromptResult] = []
    errors: list[np.ndarray[Any, Any]] = []
    scale: list[float] = []
    token_rms: list[float] = []
    plain_rms: list[float] = []
    block_rms: list[float] = []
    for prompt, exact, quantised in zip(
        prompts, continuations["float32"], continuations["int8"], strict=True
    ):
        full = prompt + exact
        reference, kv_rows = forced.logits(full, "float32")
        ours, _ = forced.logits(full, "int8")
        # The logits that chose each continuation token and the one after it.
        diff = np.abs(ours[len(prompt) - 1 :] - reference[len(prompt) - 1 :])
        errors.append(diff)
        scale.append(float(np.abs(reference[len(prompt) - 1 :]).mean()))
        first = next(
            (i for i, (a, b) in enumerate(zip(exact, quantised, strict=False)) if a != b), None
        )
        if first is None and len(exact) != len(quantised):
            first = min(len(exact), len(quantised))
        results.append(
            PromptResult(len(prompt), first is None, first, float(diff.mean()), float(diff.max()))
        )
        token_rms.append(_relative_rms(kv_rows, per="token", rotate=True))
        plain_rms.append(_relative_rms(kv_rows, per="token"))
        block_rms.append(_relative_rms(kv_rows, per="block", block=forced.block_size, rotate=True))
    pool_bytes = parse_size(pool)
    capacity = {d: _pool_capacity(loaded, d, pool_bytes) for d in ("bfloat16", "int8")}
    (bf16_tokens, bf16_bytes), (int8_tokens, int8_bytes) = capacity["bfloat16"], capacity["int8"]
    return Int8Report(
        machine=machine_description(),
        model=loaded.config.name,
        chat=chat,
        tokens=tokens,
        prompts=results,
        equal_prompts=sum(r.equal for r in results),
        mean_abs_logit_error=float(np.mean([e.mean() for e in errors])),
        mean_abs_logit=float(np.mean(scale)),
        max_abs_logit_error=float(max(e.max() for e in errors)),
        per_token_relative_rms=float(np.mean(token_rms)),
        unrotated_per_token_relative_rms=float(np.mean(plain_rms)),
        per_block_relative_rms=float(np.mean(block_rms)),
        pool_bytes=pool_bytes,
        bf16_pool_tokens=bf16_tokens,
        bf16_pool_array_bytes=bf16_bytes,
        int8_pool_tokens=int8_tokens,
        int8_pool_array_bytes=int8_bytes,
        capacity_ratio=(int8_tokens / int8_bytes) / (bf16_tokens / bf16_bytes),
    )


class _TeacherForced:
    """The engine's forward pass over one sequence, returning every position's
    logits (the engine samples only the last): the paged pool, tables and
    kernels are the engine's own."""

    block_size = 16

    def __init__(self, loaded: Any) -> None:
        import jax

        self.loaded = loaded
        self.params = jax.device_put(loaded.params)

    def logits(
        self, tokens: list[int], kv_dtype: str
    ) -> tuple[np.ndarray[Any, Any], list[np.ndarray[Any, Any]]]:
        """(logits ``[T, V]``, each layer's K/V rows read back from an f32
        pool; none for int8)."""
        import jax
        import jax.numpy as jnp

        from kvd.engine.batching import bucket, build_step_batch, powers_of_two
        from kvd.engine.model import EngineSpec, forward
        from kvd.kv import BudgetMode, KVManager, TenantBudget, build_layout

        config = self.loaded.config
        layout = build_layout(config.kv_geometry(kv_dtype), self.block_size)
        blocks = -(-len(tokens) // self.block_size)
        pages = blocks * layout.num_groups + 1
        kv = KVManager(layout, pages, mode=BudgetMode.FREE)
        kv.set_tenant("t", TenantBudget())
        seq = kv.add_sequence(1, "t", tokens)
        kv.allocate(seq, len(tokens))
        spec = EngineSpec.build(config, layout)
        dtype = jnp.dtype(kv_dtype)
        pool = jnp.zeros((pages, layout.page_bytes // dtype.itemsize), dtype)
        padded = bucket(len(tokens), powers_of_two(16, 4096))
        width = bucket(blocks, powers_of_two(4, 256))
        batch = build_step_batch([(seq, len(tokens))], layout, padded, padded, width)
        batch = batch._replace(sample_index=jnp.arange(padded, dtype=jnp.int32))
        logits, pool = jax.jit(lambda p, pool, b: forward(spec, p, pool, b))(
            self.params, pool, batch
        )
        rows: list[np.ndarray[Any, Any]] = []
        if kv_dtype == "float32":
            rows = self._rows(np.asarray(pool), layout, seq.tables, len(tokens))
        return np.asarray(logits[: len(tokens)]), rows

    def _rows(
        self, pool: np.ndarray[Any, Any], layout: Any, tables: list[list[int]], length: int
    ) -> list[np.ndarray[Any, Any]]:
        """Each layer's K/V rows ``[2, T, K, H]``, read back through the tables."""
        config = self.loaded.config
        out = []
        for layer in range(config.num_layers):
            group, place = layout.group_of_layer(layer)
            kind = config.layer_kinds[layer]
            shape = (
                layout.groups[group].places, 2, self.block_size,
                config.kv_heads_of(kind), config.head_dim_of(kind),
            )  # fmt: skip
            pages = [p for p in tables[group] if p]
            view = pool[pages].reshape(len(pages), *shape)[:, place]  # [B, 2, L, K, H]
            # Sliding groups released nothing here (one prefill), so blocks are whole.
            out.append(view.transpose(1, 0, 2, 3, 4).reshape(2, -1, *shape[3:])[:, :length])
        return out


def _relative_rms(
    layers: list[np.ndarray[Any, Any]], *, per: str, block: int = 16, rotate: bool = False
) -> float:
    """RMS error of int8 absmax quantisation / RMS of the values, with one scale
    per row (token, KV head) or per block of ``block`` tokens and KV head;
    ``rotate``: rows turned by kvd's Hadamard rotation first (an orthonormal
    turn: the error's RMS is the same in either basis)."""
    from kvd.engine.kvquant import rotation

    squared_error = squared = 0.0
    for rows in layers:
        x = np.asarray(rows, np.float64)  # [2, T, K, H]
        turn = rotation(x.shape[-1]) if rotate else None
        if turn is not None:
            x = x @ turn
        if per == "token":
            absmax = np.abs(x).max(axis=-1, keepdims=True)
        else:
            absmax = np.empty_like(x)
            for start in range(0, x.shape[1], block):
                part = np.abs(x[:, start : start + block])
                absmax[:, start : start + block] = part.max(axis=(1, 3), keepdims=True)
        step = np.where(absmax > 0, absmax / 127, 1.0)
        squared_error += float(((np.round(x / step) * step - x) ** 2).sum())
        squared += float((x**2).sum())
    return float(np.sqrt(squared_error / squared))


def _pool_capacity(loaded: Any, kv_dtype: str, pool_bytes: int) -> tuple[int, int]:
    """(tokens, pool array bytes) of an engine built on ``pool_bytes`` of ``kv_dtype`` K/V."""
    from kvd.engine.engine import Engine, EngineConfig
    from kvd.kv.layout import build_layout

    layout = build_layout(loaded.config.kv_geometry(kv_dtype), 16)
    engine = Engine(
        loaded,
        EngineConfig(
            kv_dtype=kv_dtype,
            max_model_len=256,
            max_num_seqs=1,
            max_num_batched_tokens=64,
            pool_tokens=layout.pool_tokens(pool_bytes),
        ),
    )
    tokens = (engine.num_pages - 1) // engine.layout.num_groups * engine.layout.block_size
    return tokens, int(engine.pool.nbytes)


def render(report: Int8Report) -> str:
    lines = [
        f"kvd bench int8: {report.model}, greedy {report.tokens} tokens, f32 vs int8 K/V, "
        + ("chat prompts" if report.chat else "raw text prompts"),
        f"machine: {report.machine}",
        "",
        "prompt  tokens  equal  first difference  mean |dlogit|  max |dlogit|",
    ]
    for i, r in enumerate(report.prompts):
        first = "-" if r.first_difference is None else str(r.first_difference)
        lines.append(
            f"{i:>6}  {r.prompt_tokens:>6}  {'yes' if r.equal else 'no':>5}  {first:>16}"
            f"  {r.mean_abs_logit_error:>13.4f}  {r.max_abs_logit_error:>12.4f}"
        )
    lines += [
        "",
        f"equal continuations: {report.equal_prompts} of {len(report.prompts)}",
        f"logit error: mean {report.mean_abs_logit_error:.4f}, max "
        f"{report.max_abs_logit_error:.4f} (mean |logit| {report.mean_abs_logit:.3f})",
        f"K/V relative RMS error: a scale per token and head {report.per_token_relative_rms:.3%}"
        f" (kvd; {report.unrotated_per_token_relative_rms:.3%} without the rotation), per "
        f"16-token block and head {report.per_block_relative_rms:.3%}",
        f"pool of {report.pool_bytes:,} bytes: bf16 {report.bf16_pool_tokens:,} tokens in "
        f"{report.bf16_pool_array_bytes:,} array bytes; int8 {report.int8_pool_tokens:,} "
        f"tokens in {report.int8_pool_array_bytes:,}: {report.capacity_ratio:.3f}x the tokens "
        "per byte",
    ]
    return "\n".join(lines)
