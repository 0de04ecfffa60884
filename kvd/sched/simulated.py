"""A deterministic, pure-Python executor: the scheduler's policy tested and
benchmarked without JAX.

Its "model" is a pure function of the tokens (``next_token``), so every
request's output is known in advance (``expected_output``). It keeps the
tokens each step writes in a pool of its own, page by page, as a device keeps
K/V, and computes a sampled token from the context it reads back through the
block tables: a page handed to two sequences, a stale prefix hit, a window
slid too early or a swap that lost a page raises ``CorruptKV`` naming the
page, instead of passing unseen.

It reaches the engine's fault points (``step``, ``sequence``, ``d2h``: see
kvd/faults.py) as the engine does, so the daemon's handling of each can be
tested without a device. A ``step:hang`` waits on ``unhang`` (a test's
teardown sets it) rather than forever.
"""

from __future__ import annotations

import bisect
import threading
import time
from typing import Any

import numpy as np

from kvd import faults
from kvd.kv.layout import PageLayout
from kvd.kv.manager import KVManager, StepColumns
from kvd.kv.sequence import Sequence
from kvd.sched.constraint import allowed_tokens
from kvd.sched.executor import (
    ExecutorSizes,
    ParamsLookup,
    PromptScores,
    SequenceFault,
    StepOutput,
)
from kvd.sched.sampling_params import MAX_TOP_LOGPROBS, SamplingParams

Array = np.ndarray[Any, Any]
UNWRITTEN = -1


class CorruptKV(AssertionError):
    """A page did not hold what the sequence's block table says it holds."""


def next_token(context: list[int] | Array, params: SamplingParams, vocab_size: int) -> int:
    """The model: a hash of the whole context (and the seed, when sampling)."""
    tokens = np.asarray(context, np.int64)
    weights = np.arange(1, len(tokens) + 1, dtype=np.int64)
    value = int((tokens * weights).sum()) * 1_000_003 + len(tokens) * 7919
    if params.temperature > 0:
        value += (params.seed or 0) * 104_729
    return value % vocab_size


def allowed_token(
    context: list[int] | Array,
    params: SamplingParams,
    vocab_size: int,
    banned: frozenset[int] | tuple[int, ...],
) -> int:
    """``next_token``, or while the end tokens and stop ids are ``banned``
    (short of min_tokens), the first token after it that is not."""
    token = next_token(context, params, vocab_size)
    while token in banned:
        token = (token + 1) % vocab_size
    return token


def masked_token(
    token: int, mask: Array, vocab_size: int, banned: frozenset[int] | tuple[int, ...]
) -> int:
    """The first token from ``token`` on (cyclically) that a structured
    output's bitmask row allows and min_tokens does not ban; ``token`` itself
    if there is none (the scheduler then finds the grammar broken)."""
    allowed = [t for t in allowed_tokens(mask, vocab_size).tolist() if t not in banned]
    if not allowed:
        return token
    at = bisect.bisect_left(allowed, token)
    return allowed[at % len(allowed)]


def expected_output(
    prompt: list[int], params: SamplingParams, limits: ExecutorSizes, stop_ids: frozenset[int]
) -> tuple[list[int], str]:
    """What a request must produce, computed without any KV: (tokens, finish reason)."""
    tokens = list(prompt)
    max_length = len(prompt) + min(params.max_tokens, limits.max_model_len - len(prompt))
    ends = stop_ids | frozenset(params.stop_token_ids)
    enders = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else stop_ids)
    out: list[int] = []
    while True:
        banned = ends if len(out) < params.min_tokens else frozenset()
        token = allowed_token(tokens, params, limits.vocab_size, banned)
        out.append(token)
        tokens.append(token)
        if token in enders:
            return out, "stop"
        if len(tokens) >= max_length:
            return out, "length"


class Finished:
    """A step whose results are already there."""

    def __init__(self, output: StepOutput) -> None:
        self.output = output

    def result(self) -> StepOutput:
        return self.output


class SimulatedExecutor:
    def __init__(
        self,
        layout: PageLayout,
        num_pages: int,
        limits: ExecutorSizes,
        stop_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.layout = layout
        self.num_pages = num_pages
        self.limits = limits
        self.stop_ids = stop_ids
        groups, block = layout.num_groups, layout.block_size
        # The token each page holds at each offset, per page group (a page
        # belongs to one group at a time, but the pool does not say which).
        self.pool = np.full((num_pages, block), UNWRITTEN, np.int64)
        self.windows = [g.window for g in layout.groups]
        self.groups = groups
        self.kv: KVManager | None = None
        self.steps = 0
        self.device_seconds = 0.0
        self.unhang = threading.Event()
        self._started: set[int] = set()  # sequences that have run (their params read)
        self._min_end: dict[int, int] = {}  # by sequence: end tokens allowed from this length
        # By sequence, when its prompt's own logprobs were asked: (prompt end, alternatives).
        self._scoring: dict[int, tuple[int, int]] = {}
        self._last_sampled = np.zeros(0, np.int64)  # the last step's, for ``sources``
        # By sequence: (position, token) of the newest token the host had as
        # a placeholder when it last ran (``sources``).
        self._overrides: dict[int, tuple[int, int]] = {}

    def bind(self, kv: KVManager) -> None:
        if kv.layout != self.layout or kv.num_pages != self.num_pages:
            raise ValueError("the KV manager's layout or pool size is not this executor's")
        self.kv = kv
        # What it kept per sequence was keyed by the other manager's ids (a
        # calibration's scratch manager numbers its sequences from 1 too).
        self._started.clear()
        self._min_end.clear()
        self._scoring.clear()
        self._overrides.clear()

    def run(
        self,
        seqs: list[Sequence],
        counts: list[int],
        params: ParamsLookup,
        slots: Array,
        before: StepColumns,
        masks: Array | None = None,
        sources: Array | None = None,
    ) -> StepOutput:
        started = time.perf_counter()
        self._inject_faults(seqs, params)
        if len(seqs) > self.limits.max_num_seqs:
            raise ValueError(f"{len(seqs)} sequences exceed max_num_seqs")
        if sum(counts) > self.limits.max_num_batched_tokens:
            raise ValueError(f"{sum(counts)} tokens exceed max_num_batched_tokens")
        self.steps += 1
        computed = before.computed.tolist()
        sampled = np.zeros(len(seqs), np.int64)
        wanted: list[SamplingParams | None] = []
        prompt: list[PromptScores | None] | None = None
        for i, (seq, n) in enumerate(zip(seqs, counts, strict=True)):
            start = computed[i]
            end = start + n
            if sources is not None and sources[i] >= 0:
                # As the device: the newest token, which the host holds only
                # as a placeholder, is the one the last step sampled.
                self._overrides[seq.seq_id] = (start, int(self._last_sampled[sources[i]]))
            self._write(seq, start, end)
            scores = self._prompt_scores(seq, start, end)
            if scores is not None:
                prompt = prompt or [None] * len(seqs)
                prompt[i] = scores
            if end == len(seq.tokens):
                p = params[i]
                wanted.append(p)
                if p is None:
                    raise ValueError(f"no sampling parameters for sequence {seq.seq_id}")
                early = end < self._min_end.get(seq.seq_id, 0)
                banned = self.stop_ids | frozenset(p.stop_token_ids) if early else frozenset()
                token = allowed_token(self._read(seq, end), p, self.limits.vocab_size, banned)
                if masks is not None and not (masks[i] == -1).all():
                    token = masked_token(token, masks[i], self.limits.vocab_size, banned)
                sampled[i] = token
        self.device_seconds += time.perf_counter() - started
        self._last_sampled = sampled
        top_ids = top_logprobs = None
        if any(p is not None and p.top_logprobs for p in wanted):
            # The model's alternatives: the sampled token first, then the next ids.
            top_ids = (sampled[:, None] + np.arange(MAX_TOP_LOGPROBS)) % self.limits.vocab_size
            top_logprobs = np.broadcast_to(
                -0.5 - np.arange(MAX_TOP_LOGPROBS, dtype=np.float32), top_ids.shape
            )
        return StepOutput(
            sampled, np.full(len(seqs), -0.5, np.float32), top_ids, top_logprobs, prompt
        )

    def dispatch(
        self,
        seqs: list[Sequence],
        counts: list[int],
        params: ParamsLookup,
        slots: Array,
        before: StepColumns,
        masks: Array | None = None,
        sources: Array | None = None,
    ) -> Finished:
        """``run``, already done when it returns (a device of no latency)."""
        return Finished(self.run(seqs, counts, params, slots, before, masks, sources))

    def _tokens(self, seq: Sequence, start: int, end: int) -> Array:
        """``seq``'s tokens ``[start, end)`` as the device knows them."""
        values = np.asarray(seq.tokens[start:end], np.int64)
        override = self._overrides.get(seq.seq_id)
        if override is not None and start <= override[0] < end:
            values[override[0] - start] = override[1]
        return values

    def _prompt_scores(self, seq: Sequence, start: int, end: int) -> PromptScores | None:
        """As the engine's, for a sequence that asked: prompt tokens
        ``start + 1`` up to the prompt's end, each given logprob -0.25 and
        its own id first among its alternatives."""
        scoring = self._scoring.get(seq.seq_id)
        if scoring is None:
            return None
        prompt_end, k = scoring
        stop = min(end, prompt_end - 1)
        if stop <= start:
            return None
        targets = seq.tokens[start + 1 : stop + 1]
        top = None
        if k:
            values = (-0.25 - np.arange(k, dtype=np.float32)).tolist()
            vocab = self.limits.vocab_size
            top = [tuple(((t + j) % vocab, values[j]) for j in range(k)) for t in targets]
        return PromptScores(start + 1, [-0.25] * len(targets), top)

    def _inject_faults(self, seqs: list[Sequence], params: ParamsLookup) -> None:
        action = faults.fire("step")
        if action == "raise":
            raise faults.InjectedFault("injected: the engine step failed")
        if action == "hang":
            self.unhang.wait()
        if action == "slow":
            time.sleep(faults.SLOW_STEP_S)
        for i, seq in enumerate(seqs):
            if seq.seq_id not in self._started and params[i] is not None:
                if faults.fire("sequence") == "raise":
                    raise SequenceFault(i, faults.InjectedFault("injected: a sequence's inputs"))
                self._started.add(seq.seq_id)
                # As the engine: min_tokens count from the end of the prompt.
                own = params[i]
                prompt = len(seq.tokens) - own.resumed_output if own is not None else 0
                if own is not None and own.min_tokens:
                    self._min_end[seq.seq_id] = prompt + own.min_tokens
                if own is not None and own.prompt_logprobs is not None:
                    self._scoring[seq.seq_id] = (prompt, own.prompt_logprobs)

    def _pages(self, seq: Sequence, group: int, positions: Array) -> Array:
        table = np.asarray(seq.tables[group], np.int64)
        blocks = positions // self.layout.block_size
        if len(blocks) and int(blocks.max()) >= len(table):
            raise CorruptKV(f"sequence {seq.seq_id}: no block for position {int(positions.max())}")
        pages = table[blocks]
        if (pages == 0).any():
            at = int(positions[np.flatnonzero(pages == 0)[0]])
            raise CorruptKV(f"sequence {seq.seq_id}, group {group}: null page at position {at}")
        return pages

    def _write(self, seq: Sequence, start: int, end: int) -> None:
        positions = np.arange(start, end)
        values = self._tokens(seq, start, end)
        offsets = positions % self.layout.block_size
        for g in range(self.groups):
            self.pool[self._pages(seq, g, positions), offsets] = values

    def _read(self, seq: Sequence, end: int) -> list[int]:
        """The context a token at ``end`` sees, read from the pages, checked
        against the sequence's tokens in every group."""
        expected = self._tokens(seq, 0, end)
        for g, window in enumerate(self.windows):
            first = 0 if window is None else max(0, end - window)
            positions = np.arange(first, end)
            pages = self._pages(seq, g, positions)
            held = self.pool[pages, positions % self.layout.block_size]
            wrong = np.flatnonzero(held != expected[first:end])
            if len(wrong):
                at = int(positions[wrong[0]])
                raise CorruptKV(
                    f"sequence {seq.seq_id}, group {g}: page {int(pages[wrong[0]])} holds "
                    f"{int(held[wrong[0]])} at position {at}, not {int(expected[at])}"
                )
        return expected.tolist()  # type: ignore[no-any-return]

    def copy_out(self, pages: list[int]) -> Array:
        if faults.fire("d2h") == "fail":
            raise faults.InjectedFault("injected: a device-to-host copy failed")
        return self.pool[pages].copy()

    def copy_in(self, pages: list[int], data: Array) -> None:
        self.pool[pages] = data

    def barrier(self) -> None:
        pass
