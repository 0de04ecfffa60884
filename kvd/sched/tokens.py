"""Turning a step's sampled tokens into outcomes, as array operations over the
batch: which rows sampled a token (not a prefill chunk), which finished and why.
"""

from __future__ import annotations

from itertools import repeat
from typing import Any

import msgspec
import numpy as np

from kvd.kv.manager import KVManager, StepColumns
from kvd.kv.sequence import Sequence
from kvd.sched.book import RequestBook
from kvd.sched.executor import PromptScores, StepOutput
from kvd.sched.requests import Request, RequestPhase, SlotInfo, StepEvent, StepWork

Array = np.ndarray[Any, Any]


class Outcome:
    """One step's sampled rows: ``keep`` indexes the step's work; the other
    arrays are per kept row."""

    __slots__ = ("keep", "slots", "length", "tokens", "logprobs", "finished", "by_stop")

    def __init__(
        self,
        keep: Array | None,
        slots: Array,
        length: Array,
        tokens: Array,
        logprobs: Array,
        finished: Array,
        by_stop: Array,
    ) -> None:
        self.keep = keep  # None: every row
        self.slots = slots
        self.length = length
        self.tokens = tokens
        self.logprobs = logprobs
        self.finished = finished
        self.by_stop = by_stop


def sampling_rows(counts: list[int], before: StepColumns) -> Array:
    """Which rows of a step sample a token they keep (bool per row): those
    whose step reaches their known length, not a prefill chunk short of its
    prompt's end. ``before``: their columns before the step."""
    # One token each (a decode step) is the common case: counting in a list
    # is cheaper than making an array of it.
    steps = 1 if counts.count(1) == len(counts) else np.asarray(counts)
    return before.computed + steps == before.length  # type: ignore[no-any-return]


def outcome(
    counts: list[int],
    slots: Array,
    before: StepColumns,
    tokens: Array,
    logprobs: Array,
    is_stop: Array,
    info: SlotInfo,
    stop_ids: bool = True,
) -> Outcome:
    """``before``: the step's sequences' columns before it; ``is_stop`` by token
    id (the model's end tokens); ``info`` by slot: the length at which a
    sequence ends, whether end tokens end it, and its own stop ids
    (``stop_ids``: whether any live request has some).

    This is where a generation's end is decided for a token: the model's end
    tokens, a request's stop ids and its length here, its stop strings and
    its grammar's end by the recorder that follows."""
    length = before.length
    sampled = sampling_rows(counts, before)
    keep = None
    if not sampled.all():
        keep = np.flatnonzero(sampled)
        slots, length = slots[keep], length[keep]
        tokens, logprobs = tokens[keep], logprobs[keep]
    by_stop = is_stop[tokens] & ~info.ignore_eos[slots]
    if stop_ids:
        by_stop |= (info.stop_ids[slots] == tokens[:, None]).any(axis=1)
    finished = by_stop | (length >= info.max_length[slots] - 1)  # with this token
    return Outcome(keep, slots, length, tokens, logprobs, finished, by_stop)


class TokenRecorder:
    """A step's sampled tokens become events, finished requests end, and
    fair share is charged, as array operations over the batch.

    Changes: the sequences' tokens (through the KV manager); through the
    book's methods, requests ended (``finish``), the fault log
    (``log_fault``), the fair-share counters and the tenants' completion
    tokens (``served``); owns the prompt scores held until a first
    token (``scoring``)."""

    def __init__(
        self, book: RequestBook, kv: KVManager, slot_info: SlotInfo, is_stop: Array
    ) -> None:
        self.book = book
        self.kv = kv
        self.slot_info = slot_info
        self.is_stop = is_stop  # by token id: the model's end tokens
        # Requests holding their prompt's own logprobs until their first token.
        self.scoring: set[Request] = set()

    def record(
        self,
        work: StepWork,
        seqs: list[Sequence],
        slots: np.ndarray[Any, Any],
        before: StepColumns,
        output: StepOutput,
        events: list[StepEvent],
        constrained: bool = False,
        *,
        pending: bool = False,
    ) -> None:
        """Turn one step's sampled tokens into events, as array operations over
        the batch (this runs for every running sequence every step). ``before``
        holds the sequences' columns from before the step; ``constrained``:
        some request of the step has a grammar to follow; ``pending``: the
        step was dispatched overlapped, its tokens went in as placeholders."""
        info = self.slot_info
        out = outcome(
            work.counts,
            slots,
            before,
            output.tokens,
            output.logprobs,
            self.is_stop,
            info,
            bool(self.book.with_stop_ids),
        )
        requests = work.requests
        if output.prompt is not None:
            self._keep_prompt_scores(requests, output.prompt)
        if out.keep is not None:
            keep = out.keep.tolist()
            requests = [requests[i] for i in keep]
            seqs = [seqs[i] for i in keep]
        if not requests:
            return
        slots, finished, by_stop = out.slots, out.finished, out.by_stop
        token_list = out.tokens.tolist()
        # A last token too: it is part of the output.
        if pending:
            self.kv.resolve_pending(seqs, token_list, slots, out.length)
        else:
            self.kv.append_decoded(seqs, token_list, slots, out.length)
        reasons: list[str | None] = [None] * len(requests)
        broken = (
            self._follow_constraints(requests, token_list, finished, by_stop) if constrained else {}
        )
        if self.book.stopping:
            broken |= self._watch_stop_strings(requests, token_list, finished, by_stop)
        ends = np.flatnonzero(finished).tolist()
        for i in ends:
            reasons[i] = "stop" if by_stop[i] else "length"
        for i in broken:
            reasons[i] = "error"
        events += map(
            StepEvent,
            info.reply_id[slots].tolist(),
            token_list,
            out.logprobs.tolist(),
            finished.tolist(),
            reasons,
            repeat(None),
            repeat(None),
            info.choice[slots].tolist(),
        )
        if output.top_ids is not None:
            self._attach_top(events, requests, out.keep, output.top_ids, output.top_logprobs)
        if self.scoring:
            self._attach_prompt_scores(events, requests)
        first = len(events) - len(requests)
        for i, why in broken.items():  # an error, not a token: the request fails
            request = requests[i]
            self.book.log_fault(request, why)
            events[first + i] = StepEvent(
                request.reply_id, None, 0.0, True, "error", why, choice=request.choice
            )
        for i in ends:
            self.book.finish(requests[i], reasons[i])  # type: ignore[arg-type]
        served = np.bincount(info.tenant[slots])
        for index in np.flatnonzero(served).tolist():
            tenant, count = self.book.tenant_names[index], int(served[index])
            self.book.served(tenant, count)

    @staticmethod
    def _follow_constraints(
        requests: list[Request], tokens: list[int], finished: Array, by_stop: Array
    ) -> dict[int, str]:
        """Each structured-output request follows its sampled token; one whose
        grammar is complete ends with "stop". Returns why, by index, for those
        whose token the grammar refused (the mask should make that
        impossible: it fails the request rather than return output that
        breaks its format)."""
        broken: dict[int, str] = {}
        for i, request in enumerate(requests):
            constraint = request.constraint
            if constraint is None:
                continue
            if not constraint.accept(tokens[i]):
                broken[i] = (
                    f"the sampled token {tokens[i]} breaks the grammar: {constraint.error()}"
                )
                finished[i] = True
            elif constraint.finished():
                finished[i] = by_stop[i] = True
        return broken

    @staticmethod
    def _watch_stop_strings(
        requests: list[Request], tokens: list[int], finished: Array, by_stop: Array
    ) -> dict[int, str]:
        """Each request with stop strings follows its sampled token; one whose
        output now holds a stop string ends with "stop" (with this token, as
        a stop id would). Returns why, by index, for those whose watch
        failed (their text could not be decoded): they fail alone."""
        broken: dict[int, str] = {}
        for i, request in enumerate(requests):
            stop = request.stop
            if stop is None:
                continue
            try:
                ended = stop.accept(tokens[i])
            except Exception as exc:  # noqa: BLE001  # this request's own fault: it alone ends
                broken[i] = f"watching its stop strings failed: {type(exc).__name__}: {exc}"
                finished[i] = True
                continue
            if ended:
                finished[i] = by_stop[i] = True
        return broken

    def _keep_prompt_scores(
        self, requests: list[Request], scores: list[PromptScores | None]
    ) -> None:
        """What a step computed of prompts' own logprobs, kept by position
        until the first token (a prompt computed again after a preemption
        gives the same values again)."""
        for request, chunk in zip(requests, scores, strict=True):
            if chunk is None or not request.scores_prompt:
                continue
            if request.prompt_scores is None:
                request.prompt_scores = {}
                self.scoring.add(request)
            tops = chunk.top if chunk.top is not None else [None] * len(chunk.logprobs)
            for position, entry in enumerate(zip(chunk.logprobs, tops, strict=True), chunk.first):
                request.prompt_scores[position] = entry

    def _attach_prompt_scores(self, events: list[StepEvent], requests: list[Request]) -> None:
        """Each first token of a request whose prompt was scored carries the
        scores, in prompt order (the last events, one per request); requests
        that ended before a first token are forgotten."""
        first = len(events) - len(requests)
        at = {request: i for i, request in enumerate(requests) if request in self.scoring}
        for request in list(self.scoring):
            i = at.get(request)
            if i is None:
                if request.phase is RequestPhase.FINISHED:
                    self.scoring.discard(request)
                continue
            scores = request.prompt_scores
            assert scores is not None
            events[first + i] = msgspec.structs.replace(
                events[first + i],
                prompt=tuple(scores[p] for p in range(1, request.prompt_len)),
            )
            request.prompt_scores, request.prompt_scores_sent = None, True
            self.scoring.discard(request)

    @staticmethod
    def _attach_top(
        events: list[StepEvent],
        requests: list[Request],
        keep: Array | None,
        ids: Array,
        logprobs: Array | None,
    ) -> None:
        """The alternatives of the requests that asked (the last events, one per
        request), cut to as many as each asked for."""
        assert logprobs is not None
        if keep is not None:
            ids, logprobs = ids[keep], logprobs[keep]
        first = len(events) - len(requests)
        for i, request in enumerate(requests):
            k = request.params.top_logprobs
            if k:
                top = tuple(zip(ids[i, :k].tolist(), logprobs[i, :k].tolist(), strict=True))
                events[first + i] = msgspec.structs.replace(events[first + i], top=top)
