"""The host side of an engine step: KV manager state into padded int32 arrays.

The scheduler decides which sequences run and allocates their pages through
the KV manager; this turns that into one ``StepBatch`` padded to fixed
buckets, so a step after warm-up never compiles.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import jax.numpy as jnp
import numpy as np

from kvd.engine.model import StepBatch
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


def build_step_batch(
    work: Seq[tuple[Sequence, int]], layout: PageLayout, num_tokens: int, num_seqs: int, width: int
) -> StepBatch:
    """Arrays for computing ``n`` more tokens of each sequence (pages allocated).

    ``num_tokens``, ``num_seqs`` and ``width`` are the padded bucket sizes.
    Padding tokens write into the null page and, when a spare row exists,
    read an all-null table row; their outputs are never used.
    """
    bs = layout.block_size
    groups = layout.num_groups
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
    if at < num_tokens and len(work) < num_seqs:
        seq_index[at:] = len(work)
    return StepBatch(
        tokens=jnp.asarray(tokens),
        positions=jnp.asarray(positions),
        seq_index=jnp.asarray(seq_index),
        write_pages=jnp.asarray(write_pages),
        write_offsets=jnp.asarray(positions % bs),
        tables=jnp.asarray(tables),
        sample_index=jnp.asarray(sample_index),
    )
