"""One step's work as it is built, within its bounds: tokens, sequences, time.

Decodes join first; prefill chunks then take what is left. With a cost model
and a target step time, a chunk is cut to the tokens whose predicted time
still fits (Sarathi-Serve's stall-free batching, with the time predicted
instead of a fixed token count): so one tenant's long prompt cannot make a
step that everyone else's decodes wait on for seconds.
"""

from __future__ import annotations

from kvd.sched.costmodel import Rates
from kvd.sched.requests import Request, StepWork


class StepPlan:
    def __init__(
        self,
        max_tokens: int,
        max_seqs: int,
        rates: Rates | None = None,
        target_s: float | None = None,
        floor_tokens: int = 1,
    ) -> None:
        self.work = StepWork()
        self.tokens_left = max_tokens
        self.max_seqs = max_seqs
        self.rates = rates if target_s is not None else None
        self.target_s = target_s or 0.0
        # A step with no prefill yet may always take this many prefill tokens,
        # however long its decodes take: waiting requests always make progress.
        self.floor_tokens = floor_tokens
        self.prefill_tokens = 0
        self.tokens = 0
        self.pairs = 0  # (query, key) pairs the step's attention computes
        self.copy_s = 0.0  # swap-ins the step waits for
        # By id(request): (pairs, prefill tokens) of what ``add`` took, to take back
        # on removal (a decode of ``add_decodes`` is recomputed from its context).
        self._added: dict[int, tuple[int, int]] = {}

    def full(self) -> bool:
        return self.tokens_left <= 0 or len(self.work) >= self.max_seqs

    def room(self, context: int, want: int) -> int:
        """Most of ``want`` tokens after ``context`` computed ones the step can
        still take (0: none)."""
        if len(self.work) >= self.max_seqs:
            return 0
        most = min(want, self.tokens_left)
        if most <= 0 or self.rates is None:
            return max(0, most)
        floor = 0 if self.prefill_tokens else min(most, self.floor_tokens)
        if self._fits(most, context):
            return most
        low, high = floor, most  # low fits (or is the floor), high does not
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if self._fits(mid, context) else (low, mid)
        return low

    def _fits(self, n: int, context: int) -> bool:
        assert self.rates is not None
        pairs = self.pairs + _pairs(n, context)
        return self.copy_s + self.rates.step_s(self.tokens + n, pairs) <= self.target_s

    def add(self, request: Request, n: int, context: int, *, prefill: bool = True) -> None:
        pairs = _pairs(n, context)
        if prefill:
            self.prefill_tokens += n
        self.work.add(request, n)
        self.tokens += n
        self.tokens_left -= n
        self.pairs += pairs
        self._added[id(request)] = (pairs, n if prefill else 0)

    def add_decodes(self, requests: list[Request], contexts: int) -> None:
        """One token each for ``requests``, whose contexts sum to ``contexts``."""
        self.work.add_decodes(requests)
        self.tokens += len(requests)
        self.tokens_left -= len(requests)
        self.pairs += contexts + len(requests)

    def add_copy(self, seconds: float) -> None:
        self.copy_s += seconds

    def remove(self, request: Request) -> None:
        """Take ``request`` out again (it was preempted to make room)."""
        n = self.work.remove(request)
        if not n:
            return
        self.tokens -= n
        self.tokens_left += n
        added = self._added.pop(id(request), None)
        if added is None:  # a decode of add_decodes: it saw its context and itself
            seq = request.seq
            self.pairs -= (seq.num_computed if seq is not None else 0) + 1
        else:
            self.pairs -= added[0]
            self.prefill_tokens -= added[1]

    def predicted_s(self) -> float | None:
        if self.rates is None:
            return None
        return self.copy_s + self.rates.step_s(self.tokens, self.pairs)


def _pairs(n: int, context: int) -> int:
    """Keys the queries of ``n`` tokens after ``context`` see: each sees the
    context and the chunk's tokens up to itself."""
    return n * context + n * (n + 1) // 2
