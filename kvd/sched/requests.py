"""A request's life in the scheduler, and what one step computes and emits."""

from __future__ import annotations

import bisect
import enum
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from kvd.kv.sequence import Sequence
from kvd.sched.constraint import Constraint
from kvd.sched.sampling_params import MAX_STOP_IDS, SamplingParams
from kvd.sched.stopping import StopCondition


class Rejection(Exception):
    """A request refused at admission, with the HTTP status the API should use."""

    def __init__(self, status: int, code: str, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.retry_after = retry_after


class RequestPhase(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


# Fields a decode step reads come first: a step touches every running request,
# and on a CPU whose caches the model call has just flushed, each cache line
# of each request costs a miss.
@dataclass(slots=True, eq=False, kw_only=True)  # eq=False: compared by identity
class Request:
    seq: Sequence | None = None
    phase: RequestPhase = RequestPhase.WAITING
    request_id: str
    tenant: str
    max_length: int  # prompt + max_tokens, or the context: the sequence ends at this length
    prompt_len: int
    params: SamplingParams
    prompt: list[int]
    tier: int
    arrival: float
    deadline: float | None
    cache_salt: str | None
    order_key: tuple[int, float, int]  # (tier, arrival, serial): the running order
    finish_reason: str | None = None
    host_pages: tuple[list[tuple[int, int]], np.ndarray[Any, Any]] | None = None
    started_at: float | None = None
    charged_input: bool = False
    cached_tokens: int = 0
    preemptions: int = 0
    arrival_step: int = 0  # the scheduler's step count when it was queued
    queue_steps: int | None = None  # steps between arrival and start
    # n > 1: one request per choice. The first (``choice`` 0) prefills the
    # prompt; the others (its ``other_choices``) start once it has, sharing its full
    # blocks through the prefix cache. Events carry the client's id.
    reply_id: str  # the client's request id (events carry it)
    choice: int = 0
    first_choice: Request | None = None  # for the other choices: the first
    other_choices: list[Request] = field(default_factory=list)  # for the first choice
    # Structured output: the grammar the output follows (each choice its own copy).
    constraint: Constraint | None = None
    # Stop strings: watched in the output as each token is recorded (each
    # choice its own copy).
    stop: StopCondition | None = None
    # The prompt's own logprobs, when asked (the first choice computes them):
    # by prompt position, as the steps computing the prompt give them, until
    # they go out with the first token.
    prompt_scores: dict[int, tuple[float, tuple[tuple[int, float], ...] | None]] | None = None
    prompt_scores_sent: bool = False

    @property
    def scores_prompt(self) -> bool:
        """Whether its prompt's own logprobs are still to compute: its
        prompt then runs whole, not from the prefix cache."""
        return (
            self.params.prompt_logprobs is not None
            and self.first_choice is None
            and not self.prompt_scores_sent
        )

    @property
    def shared_prompt(self) -> int:
        """Prompt tokens another choice of the request pays for (its first's)."""
        return self.prompt_len if self.first_choice is not None else 0

    @property
    def output(self) -> list[int]:
        """The tokens generated so far (they follow the prompt in its
        sequence), but those a step in flight sampled."""
        seq = self.seq
        return [] if seq is None else seq.tokens[self.prompt_len : seq.known_tokens]


class RunningOrder:
    """The running requests, most important first (tier, then age), kept
    sorted as requests come and go instead of sorted again every step."""

    def __init__(self) -> None:
        self._keys: list[tuple[int, float, int]] = []
        self._requests: list[Request] = []
        self.version = 0  # moves with every change: what was derived from an order stays valid

    def add(self, request: Request) -> None:
        at = bisect.bisect_left(self._keys, request.order_key)
        self._keys.insert(at, request.order_key)
        self._requests.insert(at, request)
        self.version += 1

    def remove(self, request: Request) -> None:
        at = bisect.bisect_left(self._keys, request.order_key)
        if at < len(self._requests) and self._requests[at] is request:
            del self._keys[at]
            del self._requests[at]
            self.version += 1

    def snapshot(self) -> list[Request]:
        return list(self._requests)


class StepWork:
    """What one step computes: requests, and how many tokens of each, in order."""

    __slots__ = ("requests", "counts")

    def __init__(self) -> None:
        self.requests: list[Request] = []
        self.counts: list[int] = []

    def __len__(self) -> int:
        return len(self.requests)

    def add(self, request: Request, count: int) -> None:
        self.requests.append(request)
        self.counts.append(count)

    def add_decodes(self, requests: list[Request]) -> None:
        self.requests += requests
        self.counts += [1] * len(requests)

    def remove(self, request: Request) -> int:
        """Take ``request`` out; returns its token count (0 if it was not in)."""
        for i, scheduled in enumerate(self.requests):
            if scheduled is request:
                del self.requests[i]
                return self.counts.pop(i)
        return 0


class ParamsOf:
    """The sampling parameters of ``requests``, read only where the engine needs
    them (a sequence's first step): a decode step does not touch 256 of them."""

    __slots__ = ("_requests",)

    def __init__(self, requests: list[Request]) -> None:
        self._requests = requests

    def __len__(self) -> int:
        return len(self._requests)

    def __getitem__(self, index: int) -> SamplingParams:
        request = self._requests[index]
        params = request.params
        if params.prompt_logprobs is not None and not request.scores_prompt:
            params = msgspec.structs.replace(params, prompt_logprobs=None)
        if (params.min_tokens or params.penalized) and request.seq is not None:
            # A sequence recomputed after a preemption starts with its output
            # so far: min_tokens and the penalties must know where the prompt ends.
            generated = len(request.seq.tokens) - request.prompt_len
            if generated:
                return msgspec.structs.replace(params, resumed_output=generated)
        return params


class StepEvent(msgspec.Struct, frozen=True):
    request_id: str
    token: int | None  # None for an event without a token (rejection, cancel)
    logprob: float
    finished: bool
    finish_reason: str | None = None
    detail: str | None = None  # why it failed ("error"), for its client
    # The most likely tokens and their logprobs, best first, when asked for.
    top: tuple[tuple[int, float], ...] | None = None
    choice: int = 0  # which of the request's n choices
    # With a request's first token (its first choice's), when asked: the
    # prompt's own logprobs, of its tokens after the first, each with its
    # alternatives when asked.
    prompt: tuple[tuple[float, tuple[tuple[int, float], ...] | None], ...] | None = None


class SlotInfo:
    """Per KV slot, what token handling needs of the request whose sequence holds
    it: a step reads these for all its sequences as arrays, not from 256
    request objects."""

    def __init__(self) -> None:
        self.max_length = np.zeros(0, np.int64)  # the sequence ends at this length
        self.tenant = np.zeros(0, np.int64)  # index into Scheduler.tenant_names
        self.ignore_eos = np.zeros(0, np.bool_)  # the model's end tokens do not end it
        # The request's own stop_token_ids, -1 padded: sampling one ends it.
        self.stop_ids = np.full((0, MAX_STOP_IDS), -1, np.int64)
        # Its step needs its newest token on the host (a grammar's mask):
        # overlapped, it waits for a token in flight. (A penalty's history
        # takes a token in flight on the device: no wait.)
        self.waits = np.zeros(0, np.bool_)
        # What its events carry: the reply's id and which choice it is.
        self.reply_id = np.zeros(0, object)
        self.choice = np.zeros(0, np.int64)

    def start(
        self,
        slot: int,
        capacity: int,
        max_length: int,
        tenant: int,
        ignore_eos: bool,
        stop_ids: tuple[int, ...] | list[int] = (),
        *,
        waits: bool = False,
        reply_id: str = "",
        choice: int = 0,
    ) -> None:
        """A new sequence holds ``slot`` (of a KV manager with ``capacity`` slots)."""
        if len(self.max_length) < capacity:
            self._grow(capacity)
        self.max_length[slot] = max_length
        self.tenant[slot] = tenant
        self.ignore_eos[slot] = ignore_eos
        self.stop_ids[slot] = -1
        self.stop_ids[slot, : len(stop_ids)] = stop_ids
        self.waits[slot] = waits
        self.reply_id[slot] = reply_id
        self.choice[slot] = choice

    def _grow(self, capacity: int) -> None:
        old = len(self.max_length)
        columns = (
            ("max_length", 0),
            ("tenant", 0),
            ("ignore_eos", 0),
            ("stop_ids", -1),
            ("waits", 0),
            ("reply_id", None),
            ("choice", 0),
        )
        for name, fill in columns:
            column = getattr(self, name)
            grown = np.full((capacity, *column.shape[1:]), fill, column.dtype)
            grown[:old] = column
            setattr(self, name, grown)
