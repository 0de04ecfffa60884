"""Recompute or swap: a cost model on two rates kvd measures on its own device.

Recomputing a victim costs a prefill of its computed tokens; swapping costs
copying its pages to host memory and back. Each is fitted as a fixed cost
plus a per-unit cost, from two measurements at start-up, so the crossover
sequence length (where swapping starts to win, if ever) is known on every
machine instead of guessed.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from kvd.engine.engine import Engine


class Rates(msgspec.Struct, frozen=True):
    prefill_fixed_s: float  # per prefill step
    prefill_s_per_token: float
    copy_fixed_s: float  # per copy (one direction)
    copy_s_per_page: float
    page_bytes: int
    pages_per_token: float  # pages a long sequence holds per token (global groups)

    @property
    def prefill_tokens_per_s(self) -> float:
        return 1.0 / self.prefill_s_per_token

    @property
    def copy_bytes_per_s(self) -> float:
        return self.page_bytes / self.copy_s_per_page

    def recompute_s(self, tokens: int) -> float:
        return self.prefill_fixed_s + tokens * self.prefill_s_per_token

    def swap_s(self, pages: int) -> float:
        return 2 * (self.copy_fixed_s + pages * self.copy_s_per_page)

    def crossover_tokens(self) -> int | None:
        """Sequence length above which swapping is cheaper; None if it never is."""
        per_token_gap = self.prefill_s_per_token - 2 * self.pages_per_token * self.copy_s_per_page
        fixed_gap = 2 * self.copy_fixed_s - self.prefill_fixed_s
        if per_token_gap <= 0:
            return None  # recompute grows no faster than swap: swap never catches up
        return max(0, int(fixed_gap / per_token_gap) + 1)


def measure_rates(engine: Engine, repeats: int = 3) -> Rates:
    """Time prefills and page copies of two sizes on this engine (after warm-up)."""
    from kvd.engine.sampling import SamplingParams

    kv = engine.kv
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    big = min(engine.config.max_num_batched_tokens, engine.config.max_model_len - 1)
    small = max(1, big // 4)
    prefill: dict[int, float] = {}
    for length in (small, big):
        best = float("inf")
        for attempt in range(repeats):
            seq = kv.add_sequence(-1 - attempt, engine.TENANT, list(range(3, 3 + length)))
            kv.allocate(seq, length)
            start = time.perf_counter()
            engine.step([(seq, length, greedy)])
            best = min(best, time.perf_counter() - start)
            kv.finish(seq)
        prefill[length] = best
    per_token = max((prefill[big] - prefill[small]) / (big - small), 1e-9)
    pool_pages = kv.pool.capacity
    few, many = 1, max(2, min(engine.page_buckets[-1], pool_pages) // 2)
    copies: dict[int, float] = {}
    for count in (few, many):
        pages = list(range(1, count + 1))
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            data = engine.copy_out(pages)
            engine.copy_in(pages, data)
            best = min(best, (time.perf_counter() - start) / 2)
        copies[count] = best
    per_page = max((copies[many] - copies[few]) / (many - few), 1e-12)
    layout = engine.layout
    global_groups = sum(1 for g in layout.groups if g.window is None)
    return Rates(
        prefill_fixed_s=max(0.0, prefill[small] - small * per_token),
        prefill_s_per_token=per_token,
        copy_fixed_s=max(0.0, copies[few] - few * per_page),
        copy_s_per_page=per_page,
        page_bytes=layout.page_bytes,
        pages_per_token=global_groups / layout.block_size,
    )
