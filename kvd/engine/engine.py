"""The engine: a loaded model, the KV pool and the compiled step, ready to run.

``Engine.step`` runs one ragged step for sequences the caller has allocated
pages for, and returns sampled tokens (the only device-to-host transfer of a
step). ``Engine.generate`` is a small continuous-batching loop for one-shot use
(``kvd generate``, tests, benchmarks); the multi-tenant scheduler drives
``step`` itself.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import msgspec
import numpy as np

from kvd.engine.batching import bucket, build_step_batch, powers_of_two
from kvd.engine.loader import LoadedModel
from kvd.engine.model import EngineSpec, Params, StepBatch, forward
from kvd.engine.sampling import MAX_STOP_IDS, SamplingBatch, SamplingParams, sample
from kvd.kv.layout import build_layout
from kvd.kv.ledger import BudgetMode, TenantBudget
from kvd.kv.manager import KVManager
from kvd.kv.sequence import Sequence

Progress = Callable[[int, int, str], None]


class EngineConfig(msgspec.Struct, frozen=True):
    dtype: str = "float32"  # weights and activations
    kv_dtype: str | None = None  # None: the compute dtype
    block_size: int = 16
    max_model_len: int = 4096
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    pool_tokens: int = 65_536  # KV capacity, in tokens of a global layer group


class EngineError(ValueError):
    pass


def step_and_sample(
    spec: EngineSpec, params: Params, pool: jax.Array, batch: StepBatch, sampling: SamplingBatch
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    logits, pool = forward(spec, params, pool, batch)
    tokens, logprobs, stopped = sample(logits, sampling)
    return tokens, logprobs, stopped, pool


@dataclass
class Generation:
    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    cached_tokens: int = 0
    first_token_s: float | None = None


class Engine:
    TENANT = "local"

    def __init__(self, model: LoadedModel, config: EngineConfig | None = None) -> None:
        self.model = model
        self.config = cfg = config or EngineConfig()
        if cfg.max_model_len > model.config.max_position:
            raise EngineError(
                f"max_model_len {cfg.max_model_len} exceeds the model's {model.config.max_position}"
            )
        kv_dtype = cfg.kv_dtype or cfg.dtype
        self.layout = build_layout(model.config.kv_geometry(kv_dtype), cfg.block_size)
        pages = cfg.pool_tokens // cfg.block_size * self.layout.num_groups + 1
        self.kv = KVManager(self.layout, pages, mode=BudgetMode.FREE)
        self.kv.set_tenant(self.TENANT, TenantBudget())
        self.spec = EngineSpec.build(model.config, self.layout)
        self.params = jax.device_put(model.params)
        elements = self.layout.page_bytes // jnp.dtype(kv_dtype).itemsize
        self.pool = jnp.zeros((pages, elements), jnp.dtype(kv_dtype))
        max_blocks = math.ceil(cfg.max_model_len / cfg.block_size)
        self.token_buckets = powers_of_two(16, max(16, cfg.max_num_batched_tokens))
        self.block_buckets = tuple(
            sorted({max(1, max_blocks // 16), max(1, max_blocks // 4), max_blocks})
        )
        self._step = jax.jit(partial(step_and_sample, self.spec), donate_argnums=(1,))
        self._next_id = 0

    # -- shapes ----------------------------------------------------------------------

    def seqs_for(self, tokens_bucket: int) -> int:
        return min(tokens_bucket, self.config.max_num_seqs)

    def shape_buckets(self) -> list[tuple[int, int]]:
        return [(t, w) for t in self.token_buckets for w in self.block_buckets]

    def compiled_shapes(self) -> int:
        """How many programs the step has compiled (a recompile shows up here)."""
        return int(self._step._cache_size())

    def warm_up(self, progress: Progress | None = None) -> float:
        """Compile every bucket before serving; returns seconds spent."""
        start = time.perf_counter()
        shapes = self.shape_buckets()
        for done, (tokens, width) in enumerate(shapes, 1):
            batch, sampling = self._empty_batch(tokens, width)
            out = self._step(self.params, self.pool, batch, sampling)
            self.pool = out[3]
            jax.block_until_ready(out[0])
            if progress is not None:
                progress(done, len(shapes), f"tokens={tokens} blocks={width}")
        return time.perf_counter() - start

    def _empty_batch(self, tokens: int, width: int) -> tuple[StepBatch, SamplingBatch]:
        seqs = self.seqs_for(tokens)
        zeros_t = jnp.zeros(tokens, jnp.int32)
        batch = StepBatch(
            tokens=zeros_t,
            positions=zeros_t,
            seq_index=zeros_t,
            write_pages=jnp.zeros((self.layout.num_groups, tokens), jnp.int32),
            write_offsets=zeros_t,
            tables=jnp.zeros((self.layout.num_groups, seqs, width), jnp.int32),
            sample_index=jnp.zeros(seqs, jnp.int32),
        )
        return batch, _sampling_arrays([], seqs)

    # -- one step ------------------------------------------------------------------------

    def step(
        self, work: list[tuple[Sequence, int, SamplingParams]]
    ) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        """Compute the scheduled tokens (pages already allocated), commit them to
        the KV manager, and return sampled (tokens, logprobs, stopped) per entry."""
        total = sum(n for _, n, _ in work)
        tokens_bucket = bucket(total, self.token_buckets)
        seqs = self.seqs_for(tokens_bucket)
        if len(work) > seqs:
            raise EngineError(f"{len(work)} sequences exceed the step's {seqs}")
        width = bucket(max(seq.num_blocks for seq, _, _ in work), self.block_buckets)
        batch = build_step_batch(
            [(seq, n) for seq, n, _ in work], self.layout, tokens_bucket, seqs, width
        )
        sampling = _sampling_arrays([(p, seq.num_computed + n) for seq, n, p in work], seqs)
        tokens, logprobs, stopped, self.pool = self._step(self.params, self.pool, batch, sampling)
        for seq, n, _ in work:
            self.kv.commit(seq, n)
        count = len(work)
        return (
            np.asarray(tokens)[:count],
            np.asarray(logprobs)[:count],
            np.asarray(stopped)[:count],
        )

    # -- one-shot generation ---------------------------------------------------------

    def validate_prompt(self, prompt: list[int], params: SamplingParams) -> None:
        limit = self.config.max_model_len
        if not prompt:
            raise EngineError("the prompt is empty")
        if len(prompt) >= limit:
            raise EngineError(
                f"the prompt has {len(prompt)} tokens; the context is {limit} tokens "
                "(at least one must be left to generate)"
            )
        if any(not 0 <= t < self.model.config.vocab_size for t in prompt):
            raise EngineError("the prompt holds token ids outside the vocabulary")

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[Generation]:
        """Run every prompt to completion with continuous batching and chunked prefill."""
        for prompt, p in zip(prompts, params, strict=True):
            self.validate_prompt(prompt, p)
        start = time.perf_counter()
        results = [Generation(list(prompt)) for prompt in prompts]
        pending = list(range(len(prompts)))
        live: dict[int, tuple[Sequence, SamplingParams]] = {}
        while pending or live:
            work: list[tuple[Sequence, int, SamplingParams]] = []
            owners: list[int] = []
            budget = self.config.max_num_batched_tokens
            for index, (seq, p) in live.items():  # decodes (and unfinished prefills) first
                n = min(len(seq.tokens) - seq.num_computed, budget)
                if n and len(work) < self.config.max_num_seqs:
                    self.kv.allocate(seq, n)
                    work.append((seq, n, p))
                    owners.append(index)
                    budget -= n
            while pending and budget > 0 and len(work) < self.config.max_num_seqs:
                index = pending[0]
                seq = self.kv.add_sequence(self._next_id, self.TENANT, prompts[index])
                hit = self.kv.lookup(seq)
                n = min(len(seq.tokens) - hit.num_tokens, budget)
                if not self.kv.can_allocate(seq, n, hit):
                    self.kv.finish(seq)
                    if not work:
                        raise EngineError("the KV pool is too small for this prompt")
                    break
                self._next_id += 1
                self.kv.allocate(seq, n, hit)
                results[index].cached_tokens = hit.num_tokens
                pending.pop(0)
                live[index] = (seq, params[index])
                work.append((seq, n, params[index]))
                owners.append(index)
                budget -= n
            tokens, logprobs, stopped = self.step(work)
            for row, index in enumerate(owners):
                seq, p = live[index]
                if seq.num_computed < len(seq.tokens):
                    continue  # a prefill chunk: nothing sampled yet
                result = results[index]
                if result.first_token_s is None:
                    result.first_token_s = time.perf_counter() - start
                token = int(tokens[row])
                result.completion_ids.append(token)
                result.logprobs.append(float(logprobs[row]))
                reason = self._finish_reason(result, p, bool(stopped[row]), token, seq)
                if reason is None:
                    self.kv.append_tokens(seq, [token])
                else:
                    result.finish_reason = reason
                    self.kv.finish(seq)
                    del live[index]
        return results

    def _finish_reason(
        self, result: Generation, p: SamplingParams, stopped: bool, token: int, seq: Sequence
    ) -> str | None:
        if stopped or token in self.model.tokenizer.stop_ids():
            return "stop"
        if len(result.completion_ids) >= p.max_tokens:
            return "length"
        if len(seq.tokens) + 1 >= self.config.max_model_len:
            return "length"
        return None


def _sampling_arrays(entries: list[tuple[SamplingParams, int]], rows: int) -> SamplingBatch:
    temperature = np.zeros(rows, np.float32)
    top_k = np.zeros(rows, np.int32)
    top_p = np.ones(rows, np.float32)
    seeds = np.zeros(rows, np.uint32)
    positions = np.zeros(rows, np.int32)
    stop_ids = np.full((rows, MAX_STOP_IDS), -1, np.int32)
    for row, (p, position) in enumerate(entries):
        temperature[row] = p.temperature
        top_k[row] = p.top_k
        top_p[row] = p.top_p
        seeds[row] = p.seed if p.seed is not None else np.random.randint(0, 2**31)
        positions[row] = position
        stop_ids[row, : len(p.stop_token_ids)] = p.stop_token_ids
    return SamplingBatch(
        jnp.asarray(temperature),
        jnp.asarray(top_k),
        jnp.asarray(top_p),
        jnp.asarray(seeds),
        jnp.asarray(positions),
        jnp.asarray(stop_ids),
    )
