"""What a step, a recompute and a swap cost: a model on rates kvd measures on
its own device.

A step computes its tokens padded to the executor's next token bucket, plus
attention over what each token sees; recomputing a victim is a prefill of
the tokens the prefix cache will not give back; swapping copies its private
pages to host memory and back. Each rate is fitted from a few timed runs at
start-up (every one waited for to completion), so the step's time bound and
the recompute/swap crossover are known on every machine instead of guessed.
"""

from __future__ import annotations

import bisect
import itertools
import time
from typing import TYPE_CHECKING

import msgspec

from kvd.kv.ledger import BudgetMode, TenantBudget
from kvd.kv.manager import KVManager
from kvd.kv.sequence import Sequence
from kvd.sched.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvd.sched.executor import Executor

CALIBRATION_TENANT = "calibration"  # alone in a scratch KV manager: it meets no real tenant


class Rates(msgspec.Struct, frozen=True):
    prefill_fixed_s: float  # per step
    prefill_s_per_token: float  # per token of the step's bucket
    copy_fixed_s: float  # per copy (one direction)
    copy_s_per_page: float
    page_bytes: int
    pages_per_token: float  # pages a long sequence holds per token (global groups)
    attention_s_per_pair: float = 0.0  # per (query token, earlier key it sees)
    chunk_tokens: int = 512  # a step's most tokens: a long prefill takes several steps
    token_buckets: tuple[int, ...] = ()
    # Sliding groups hold pages too (a window's worth each): with these,
    # ``pages_for`` counts a victim's pages as the KV core does.
    block_size: int = 0
    sliding_groups: int = 0
    window: int = 0

    @property
    def prefill_tokens_per_s(self) -> float:
        return 1.0 / self.prefill_s_per_token

    @property
    def copy_bytes_per_s(self) -> float:
        return self.page_bytes / self.copy_s_per_page

    def padded(self, tokens: int) -> int:
        """The tokens a step of ``tokens`` really computes (its bucket)."""
        buckets = self.token_buckets
        if not buckets or tokens > buckets[-1]:
            return tokens
        return buckets[bisect.bisect_left(buckets, tokens)]

    def step_s(self, tokens: int, pairs: int) -> float:
        """One step of ``tokens`` tokens whose queries see ``pairs`` keys in all."""
        if tokens <= 0:
            return 0.0
        return (
            self.prefill_fixed_s
            + self.padded(tokens) * self.prefill_s_per_token
            + pairs * self.attention_s_per_pair
        )

    def prefill_s(self, tokens: int, start: int = 0) -> float:
        """Computing ``tokens`` tokens after ``start`` already there, chunk by chunk."""
        if tokens <= 0:
            return 0.0
        steps = -(-tokens // self.chunk_tokens)
        pairs = tokens * start + tokens * (tokens + 1) // 2
        return (
            steps * self.prefill_fixed_s
            + tokens * self.prefill_s_per_token
            + pairs * self.attention_s_per_pair
        )

    def recompute_s(self, tokens: int, cached: int = 0) -> float:
        """Recomputing ``tokens`` tokens of which the first ``cached`` will be
        found in the prefix cache (other sequences hold their pages)."""
        cached = min(cached, tokens)
        return self.prefill_s(tokens - cached, cached)

    def swap_s(self, pages: int) -> float:
        return 2 * (self.copy_fixed_s + pages * self.copy_s_per_page)

    def pages_for(self, tokens: int) -> int:
        """The pages a swap copies for a ``tokens``-token sequence, nothing shared."""
        if not self.block_size:
            return max(1, round(tokens * self.pages_per_token))
        block = self.block_size
        blocks = -(-tokens // block)
        global_groups = round(self.pages_per_token * block)
        # Between steps a sliding group holds the blocks its next query sees.
        sliding = (tokens - 1) // block - max(0, tokens - self.window + 1) // block + 1
        return global_groups * blocks + self.sliding_groups * max(0, sliding)

    def crossover_tokens(self, limit: int = 1 << 20) -> int | None:
        """Sequence length (nothing cached) from which swapping is cheaper;
        None if recompute wins up to ``limit`` tokens."""

        def swap_wins(tokens: int) -> bool:
            return self.swap_s(self.pages_for(tokens)) < self.recompute_s(tokens)

        low = 1
        if swap_wins(low):
            return low
        high = 2
        while not swap_wins(high):
            if high >= limit:
                return None
            low, high = high, high * 2
        while high - low > 1:  # the first length where swap wins, between low and high
            mid = (low + high) // 2
            low, high = (low, mid) if swap_wins(mid) else (mid, high)
        return high


def measure_rates(executor: Executor, repeats: int = 3) -> Rates:
    """Time prefills and page copies on ``executor`` (after its warm-up).

    It runs on a scratch KV manager of its own (the calibration's sequences
    are nobody's), so afterwards the executor is bound to that manager: its
    owner binds it back (``Scheduler.calibrate`` does).
    """
    kv = KVManager(executor.layout, executor.num_pages, mode=BudgetMode.FREE)
    kv.set_tenant(CALIBRATION_TENANT, TenantBudget())
    executor.bind(kv)
    limits = executor.limits
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    ids = itertools.count(1)
    vocab = limits.vocab_size

    def run(seq: Sequence, n: int) -> float:
        kv.allocate(seq, n)
        slots = kv.slots_of([seq])
        before = kv.step_columns(slots)
        start = time.perf_counter()
        executor.run([seq], [n], [greedy], slots, before)
        executor.barrier()
        spent = time.perf_counter() - start
        kv.commit(seq, n)
        return spent

    def timed_chunk(context: int, n: int) -> float:
        best = float("inf")
        for _ in range(repeats if context == 0 else 1):
            seq_id = next(ids)
            tokens = [(seq_id * 7919 + i) % span + low for i in range(context + n + 1)]
            seq = kv.add_sequence(seq_id, CALIBRATION_TENANT, tokens)
            try:
                done = 0
                while done < context:
                    step = min(big, context - done)
                    run(seq, step)
                    done += step
                best = min(best, run(seq, n))
            finally:
                kv.finish(seq)
        return best

    low = min(3, vocab - 1)
    span = max(1, vocab - low)
    layout = executor.layout
    capacity = kv.stats().capacity_pages
    big = max(1, min(limits.max_num_batched_tokens, limits.max_model_len - 1))
    while big > 1 and layout.pages_for_tokens(big + 1, big) > capacity:
        big //= 2  # a pool smaller than one step's chunk: calibrate on what it holds
    small = max(1, big // 4)
    prefill = {n: timed_chunk(0, n) for n in {small, big}}
    per_token = max((prefill[big] - prefill[small]) / max(1, big - small), 1e-9)
    attention = 0.0
    context_fits = layout.pages_for_tokens(big + small + 1, big) <= capacity
    if big + small < limits.max_model_len and context_fits:
        # The same chunk after ``big`` tokens of context: the difference is its
        # queries seeing ``big`` more keys each.
        with_context = min(timed_chunk(big, small), timed_chunk(big, small))
        attention = max(0.0, (with_context - prefill[small]) / (small * big))
    few = 1
    many = max(few, min(limits.max_copy_pages, capacity) // 2)
    copies: dict[int, float] = {}
    for count in {few, many}:
        pages = list(range(1, count + 1))
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            data = executor.copy_out(pages)
            executor.copy_in(pages, data)
            executor.barrier()  # the copy-in is dispatched asynchronously
            best = min(best, (time.perf_counter() - start) / 2)
        copies[count] = best
    per_page = max((copies[many] - copies[few]) / max(1, many - few), 1e-12)
    if many == few:  # a one-page pool: the one copy's time is all per page
        per_page = max(copies[few], 1e-12)
    global_groups = sum(1 for g in layout.groups if g.window is None)
    return Rates(
        prefill_fixed_s=max(0.0, prefill[small] - small * per_token),
        prefill_s_per_token=per_token,
        copy_fixed_s=max(0.0, copies[few] - few * per_page),
        copy_s_per_page=per_page,
        page_bytes=layout.page_bytes,
        pages_per_token=global_groups / layout.block_size,
        attention_s_per_pair=attention,
        chunk_tokens=limits.max_num_batched_tokens,
        token_buckets=limits.token_buckets,
        block_size=layout.block_size,
        sliding_groups=len(layout.groups) - global_groups,
        window=layout.geometry.window or 0,
    )
