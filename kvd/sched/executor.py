"""What the scheduler needs from whatever computes tokens: the executor protocol.

The scheduler is sans-IO: it decides, the executor computes. ``Engine``
(kvd/engine/engine.py) implements this on a device; ``SimulatedExecutor``
(kvd/sched/simulated.py) implements it in pure Python for policy tests and
host-overhead benchmarks. Nothing here imports JAX.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import msgspec
import numpy as np

from kvd.kv.layout import PageLayout
from kvd.kv.manager import KVManager, StepColumns
from kvd.kv.sequence import Sequence
from kvd.sched.sampling_params import SamplingParams

Array = np.ndarray[Any, Any]


class SequenceFault(Exception):
    """A step could not be run because of one sequence's own inputs (its
    sampling parameters, say), found before anything reached the device:
    ``index`` is its position in the step. The scheduler fails that request
    alone; the others run in the next step."""

    def __init__(self, index: int, cause: BaseException) -> None:
        super().__init__(f"sequence {index} of the step: {cause!r}")
        self.index, self.cause = index, cause


class ExecutorSizes(msgspec.Struct, frozen=True):
    """The shapes an executor can run: the scheduler plans within them."""

    max_model_len: int  # a sequence's whole context, prompt and output
    max_num_seqs: int  # sequences in one step
    max_num_batched_tokens: int  # tokens in one step
    vocab_size: int
    token_buckets: tuple[int, ...] = ()  # a step of T tokens runs as the next bucket >= T
    max_copy_pages: int = 1 << 30  # pages one copy_out or copy_in may move


class ParamsLookup(Protocol):
    """Sampling parameters by position in a step (a list will do); an
    executor may read only the entries of sequences running for the first
    time (the engine does: it keeps them for the sequence's life). The
    prompt is the sequence's tokens at that first step but the last
    ``resumed_output`` (``min_tokens`` and the penalties count from its end)."""

    def __getitem__(self, index: int, /) -> SamplingParams | None: ...


class PromptScores(NamedTuple):
    """A prompt's own logprobs from one step's chunk of it: those of prompt
    tokens ``first``, ``first + 1``, ... (each given the tokens before it)
    and, when asked, each position's likeliest tokens with theirs."""

    first: int
    logprobs: list[float]
    top: list[tuple[tuple[int, float], ...]] | None


class StepOutput(NamedTuple):
    """Per sequence of a step: its sampled token and that token's logprob
    (whether it ends the generation is the scheduler's to decide); and, when
    some sequence asked for alternatives, the most
    likely tokens and their logprobs, best first (``[S, MAX_TOP_LOGPROBS]``);
    and, when a sequence asked for its prompt's own logprobs and computed
    some of its prompt, those (None for the others)."""

    tokens: Array
    logprobs: Array
    top_ids: Array | None = None
    top_logprobs: Array | None = None
    prompt: list[PromptScores | None] | None = None


class PendingStep(Protocol):
    def result(self) -> StepOutput:
        """What each sequence of the step sampled (waits until it has)."""
        ...


class Executor(Protocol):
    layout: PageLayout  # the pool's pages: one size, grouped by attention kind
    num_pages: int  # pages in the pool, the null page included
    limits: ExecutorSizes
    stop_ids: frozenset[int]  # tokens that end every generation (EOS, end of turn)

    def bind(self, kv: KVManager) -> None:
        """From now on the block tables are ``kv``'s (its owner calls this once,
        before the first step, and again only with a new manager)."""

    def run(
        self,
        seqs: list[Sequence],
        counts: list[int],
        params: ParamsLookup,
        slots: Array,
        before: StepColumns,
        masks: Array | None = None,
    ) -> StepOutput:
        """Compute ``counts[i]`` tokens of ``seqs[i]`` (pages already allocated;
        ``slots``: their ``kv.slots_of``; ``before``: their columns before the
        step) and return what each sampled. ``masks``, when a sequence has a
        grammar: a token bitmask row per sequence (kvd/sched/constraint.py;
        all ones for a free row), and sequence i samples only what row i
        allows. The caller commits the computed tokens to the KV manager.

        Raises SequenceFault, with nothing computed, when one sequence's own
        inputs cannot be built; any other exception is the executor's failure."""
        ...

    def dispatch(
        self,
        seqs: list[Sequence],
        counts: list[int],
        params: ParamsLookup,
        slots: Array,
        before: StepColumns,
        masks: Array | None = None,
        sources: Array | None = None,
    ) -> PendingStep:
        """``run``, returning as soon as the step is under way: its
        ``result()`` waits for what it sampled. ``sources``: per sequence, the
        row of the step dispatched last whose sampled token is the sequence's
        newest, which the host holds only as a placeholder (such a sequence
        computes one token), or -1. The next step may be dispatched before
        this one's result is read; steps run in the order dispatched."""
        ...

    def copy_out(self, pages: list[int]) -> Array:
        """The contents of ``pages``, on the host, one row per page."""
        ...

    def copy_in(self, pages: list[int], data: Array) -> None:
        """Write host rows into ``pages`` before the next step (may be asynchronous)."""

    def barrier(self) -> None:
        """Wait until every dispatched copy and step has completed (for timing)."""
