"""The host side of an engine step: KV manager state into padded int32 arrays.

The runner owns the device pool and the jitted step. The scheduler decides
which sequences run and allocates their pages through the KV manager; the
runner turns that into one ``StepBatch`` padded to fixed buckets (so a step
after warm-up never compiles), runs it, and hands back logits.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvd.engine.model import EngineSpec, Params, StepBatch, forward
from kvd.kv.layout import PageLayout
from kvd.kv.sequence import Sequence


def bucket(n: int, buckets: Seq[int]) -> int:
    """The smallest bucket that holds ``n``."""
    for size in buckets:
        if n <= size:
            return size
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


def powers_of_two(lo: int, hi: int) -> tuple[int, ...]:
    sizes, size = [], lo
    while size < hi:
        sizes.append(size)
        size *= 2
    sizes.append(hi)
    return tuple(sizes)


class ModelRunner:
    def __init__(
        self,
        spec: EngineSpec,
        params: Params,
        layout: PageLayout,
        num_pages: int,
        kv_dtype: Any,
        *,
        token_buckets: tuple[int, ...],
        seq_buckets: tuple[int, ...],
        block_buckets: tuple[int, ...],
    ) -> None:
        self.spec = spec
        self.layout = layout
        self.params = params
        elements = layout.page_bytes // jnp.dtype(kv_dtype).itemsize
        self.pool = jnp.zeros((num_pages, elements), kv_dtype)
        self.token_buckets = token_buckets
        self.seq_buckets = seq_buckets
        self.block_buckets = block_buckets
        # Weights are arguments (not closure constants) and the pool is donated:
        # updated in place, never copied.
        self._step = jax.jit(partial(forward, spec), donate_argnums=(1,))

    def build(self, work: list[tuple[Sequence, int]]) -> tuple[StepBatch, int]:
        """Arrays for computing ``n`` more tokens of each sequence (pages allocated)."""
        bs = self.layout.block_size
        groups = self.layout.num_groups
        total = sum(n for _, n in work)
        num_tokens = bucket(total, self.token_buckets)
        num_seqs = bucket(len(work), self.seq_buckets)
        width = bucket(max(seq.num_blocks for seq, _ in work), self.block_buckets)
        tokens = np.zeros(num_tokens, np.int32)
        positions = np.zeros(num_tokens, np.int32)
        seq_index = np.zeros(num_tokens, np.int32)
        write_pages = np.zeros((groups, num_tokens), np.int32)
        tables = np.zeros((groups, num_seqs, width), np.int32)
        sample_index = np.zeros(num_seqs, np.int32)
        at = 0
        for row, (seq, n) in enumerate(work):
            start = seq.num_computed
            span = slice(at, at + n)
            tokens[span] = seq.tokens[start : start + n]
            pos = np.arange(start, start + n, dtype=np.int32)
            positions[span] = pos
            seq_index[span] = row
            for g, table in enumerate(seq.tables):
                tables[g, row, : len(table)] = table
                write_pages[g, span] = tables[g, row, pos // bs]
            at += n
            sample_index[row] = at - 1
        if at < num_tokens:
            # Padding tokens point at an empty table row (all null pages) when
            # there is one; their K/V land in the null page and are never read.
            seq_index[at:] = len(work) if len(work) < num_seqs else 0
            positions[at:] = 0
        batch = StepBatch(
            tokens=jnp.asarray(tokens),
            positions=jnp.asarray(positions),
            seq_index=jnp.asarray(seq_index),
            write_pages=jnp.asarray(write_pages),
            write_offsets=jnp.asarray(positions % bs),
            tables=jnp.asarray(tables),
            sample_index=jnp.asarray(sample_index),
        )
        return batch, len(work)

    def step(self, work: list[tuple[Sequence, int]]) -> np.ndarray[Any, Any]:
        """Compute the scheduled tokens; returns f32 logits ``[len(work), V]``."""
        batch, count = self.build(work)
        logits, self.pool = self._step(self.params, self.pool, batch)
        return np.asarray(logits[:count])
