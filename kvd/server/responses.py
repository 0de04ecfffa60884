"""OpenAI's response shapes for one request: its tokens turned into text as
they come (stop strings, held-back partial characters), as one body or as
server-sent event chunks, with usage and logprobs. No web framework here: the
HTTP app hands the relay's body or its event stream to the client.

A relay ends when its ticket's channel closes (the runtime ended the
request: finished, aborted, failed) or when its owner closes it (the client
went away); either way ``close`` cancels what is left of the request and
logs ``request.finish`` once.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

import msgspec
import structlog

from kvd import faults
from kvd.sched.scheduler import StepEvent
from kvd.server.api import ApiError, Prepared
from kvd.server.runtime import ENGINE_FAILED, Ticket, failed_message, waiting_batches
from kvd.server.serving import ServerContext
from kvd.server.textstream import TextStream

log = structlog.get_logger("kvd")
_encoder = msgspec.json.Encoder()
# Characters JSON leaves unescaped but Unicode counts as line breaks (as
# UTF-8): a client that splits the event stream into lines the way
# ``str.splitlines`` does (httpx's ``iter_lines``) would cut an event in
# two. Escaped, any JSON parser reads the same text. In UTF-8 no other
# character holds these bytes.
_LINE_BREAKS = (
    (b"\xe2\x80\xa8", b"\\u2028"),
    (b"\xe2\x80\xa9", b"\\u2029"),
    (b"\xc2\x85", b"\\u0085"),
)


def _joined(first: dict[str, Any], then: dict[str, Any] | None) -> dict[str, Any]:
    """Two completions logprobs objects as one, ``then`` after ``first``."""
    if then is None:
        return first
    tops = None
    if first["top_logprobs"] is not None:
        tops = first["top_logprobs"] + then["top_logprobs"]
    return {
        "tokens": first["tokens"] + then["tokens"],
        "token_logprobs": first["token_logprobs"] + then["token_logprobs"],
        "top_logprobs": tops,
        "text_offset": first["text_offset"] + then["text_offset"],
    }


def engine_failed(cause: str | None) -> ApiError:
    return ApiError(503, failed_message(cause), code=ENGINE_FAILED, retry_after=5)


_UNFINISHED = ("abort", "deadline", "error", ENGINE_FAILED)  # an error body, no [DONE]


class Choice:
    """One of a request's ``n`` completions on its way to text."""

    __slots__ = (
        "index",
        "text",
        "tokens",
        "logprobs",
        "tops",
        "finish_reason",
        "sent_text",
        "echoed",
    )

    def __init__(self, index: int, text: TextStream) -> None:
        self.index = index
        self.text = text
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.tops: list[tuple[tuple[int, float], ...]] = []  # alternatives, when asked
        self.finish_reason: str | None = None
        self.sent_text = 0  # characters streamed so far (logprobs' text offsets)
        self.echoed = False  # its echo chunk was streamed


class Relay:
    """One request's tokens on their way to its client."""

    def __init__(
        self,
        context: ServerContext,
        tenant: str,
        ticket: Ticket,
        prepared: Prepared,
        arrival: float,
        chat: bool,
    ) -> None:
        assert context.runtime is not None and context.tokenizer is not None
        self.context = context
        self.tenant = tenant
        self.ticket = ticket
        self.prepared = prepared
        self.arrival = arrival
        self.chat = chat
        self.runtime = context.runtime
        self.tokenizer = context.tokenizer
        self.choices = [
            Choice(i, TextStream(context.tokenizer, prepared.params.stop))
            for i in range(prepared.n)
        ]
        self.finish_reason: str | None = None  # the request's, once every choice has one
        # echo with logprobs: the prompt's own (its tokens after the first),
        # from the first token's event.
        self.prompt_scores: tuple[tuple[float, tuple[tuple[int, float], ...] | None], ...] = ()
        self.failure: str | None = None  # why it ended with an error
        self.created = int(time.time())
        self.id = ("chatcmpl-" if chat else "cmpl-") + ticket.request_id
        self._closed = False

    @property
    def completion_tokens(self) -> int:
        return sum(len(choice.tokens) for choice in self.choices)

    # -- tokens --------------------------------------------------------------------

    async def deltas(self) -> AsyncGenerator[tuple[Choice, str, int, str | None]]:
        """(choice, its new text, how many new tokens, its finish reason or
        None), as they come: every token waiting when the reader wakes is
        taken at once, so a client that reads slower than the engine steps
        gets fewer, larger chunks, not a backlog of one-token ones. Ends when
        every choice has finished, or with a reason in ``_UNFINISHED``."""
        async with aclosing(waiting_batches(self.ticket.events)) as batches:
            async for events in batches:
                for choice, run in self._by_choice(events):
                    try:
                        delta, count, finish = self._take(choice, run)
                    except Exception as exc:  # noqa: BLE001  # this request's own fault: it alone ends
                        self.finish_reason = "error"
                        self.failure = f"turning its tokens into text failed: {exc!r}"
                        log.warning(
                            "request.failed",
                            request_id=self.ticket.request_id,
                            tenant=self.tenant,
                            error=self.failure,
                        )
                        yield choice, "", 0, "error"
                        return
                    yield choice, delta, count, finish
                if self.finish_reason is not None:
                    return
            # Closed with a choice unfinished: aborted, dropped at its deadline,
            # failed, or the engine failed.
            self.finish_reason = self.ticket.finish_reason or "abort"
            self.failure = self.ticket.detail
            choice = next(c for c in self.choices if c.finish_reason is None)
            yield choice, "", 0, self.finish_reason

    def _by_choice(self, events: list[StepEvent]) -> list[tuple[Choice, list[StepEvent]]]:
        """A batch's events per unfinished choice, each in order."""
        if len(self.choices) == 1:
            return [] if self.choices[0].finish_reason else [(self.choices[0], events)]
        runs: dict[int, list[StepEvent]] = {}
        for event in events:
            runs.setdefault(event.choice, []).append(event)
        return [
            (self.choices[i], run)
            for i, run in sorted(runs.items())
            if self.choices[i].finish_reason is None
        ]

    def _take(self, choice: Choice, events: list[StepEvent]) -> tuple[str, int, str | None]:
        """Text for a run of one choice's token events, and the finish reason
        if they end it."""
        if faults.fire("detokenize") == "raise":
            raise faults.InjectedFault("injected: detokenizing failed")
        if events[0].prompt is not None:
            self.prompt_scores = events[0].prompt
        last = events[-1]
        finish = last.finish_reason if last.finished else None
        text = choice.text
        # Cut where a stop string starts; the scheduler ended the choice with
        # the token that completed it (``kvd/server/stopstrings.py``).
        delta = text.push_many([e.token for e in events])  # type: ignore[misc]
        choice.tokens.extend(e.token for e in events)  # type: ignore[misc]
        choice.logprobs.extend(e.logprob for e in events)
        if self.prepared.params.top_logprobs:
            choice.tops.extend(e.top or () for e in events)
        if finish is not None:
            choice.finish_reason = finish
            delta += text.flush()  # nothing after a stop string
            if all(c.finish_reason is not None for c in self.choices):
                self.finish_reason = self.choices[0].finish_reason
        return delta, len(events), finish

    # -- bodies ----------------------------------------------------------------------

    def usage(self) -> dict[str, Any]:
        request = self.ticket.request
        cached = request.cached_tokens if request is not None else 0
        prompt = len(self.prepared.prompt)  # once, however many choices share it
        completion = self.completion_tokens
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def _logprobs(self, choice: Choice, start: int, text_offset: int) -> dict[str, Any] | None:
        if not self.prepared.params.logprobs:
            return None
        ids, values = choice.tokens[start:], choice.logprobs[start:]
        pieces = [self._piece(t) for t in ids]
        tops = choice.tops[start:] if self.prepared.params.top_logprobs else [()] * len(ids)
        if self.chat:
            return {
                "content": [
                    {
                        "token": piece,
                        "logprob": value,
                        "bytes": list(piece.encode()),
                        "top_logprobs": [
                            {"token": p, "logprob": v, "bytes": list(p.encode())}
                            for p, v in ((self._piece(t), v) for t, v in top)
                        ],
                    }
                    for piece, value, top in zip(pieces, values, tops, strict=True)
                ]
            }
        return self._completion_logprobs(pieces, list(values), list(tops), text_offset)

    def _completion_logprobs(
        self,
        pieces: list[str],
        values: list[float | None],
        tops: list[tuple[tuple[int, float], ...] | None],
        text_offset: int,
    ) -> dict[str, Any]:
        offsets, at = [], text_offset
        for piece in pieces:
            offsets.append(at)
            at += len(piece)
        return {
            "tokens": pieces,
            "token_logprobs": values,
            # Keyed by text, as OpenAI's are (two ids with one text: the likelier).
            "top_logprobs": [
                None if top is None else {self._piece(t): v for t, v in reversed(top)}
                for top in tops
            ]
            if self.prepared.params.top_logprobs
            else None,
            "text_offset": offsets,
        }

    def _prompt_logprobs(self) -> dict[str, Any]:
        """echo's logprobs: the prompt's tokens, the first with none (nothing
        comes before it), as vLLM gives them."""
        prompt = self.prepared.prompt
        values: list[float | None] = [None, *(value for value, _ in self.prompt_scores)]
        tops: list[tuple[tuple[int, float], ...] | None] = [
            None,
            *(top or () for _, top in self.prompt_scores),
        ]
        return self._completion_logprobs(
            [self._piece(t) for t in prompt], values[: len(prompt)], tops[: len(prompt)], 0
        )

    def _echoes_logprobs(self) -> bool:
        return self.prepared.echo is not None and self.prepared.params.prompt_logprobs is not None

    def _piece(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special=False)

    async def collect(self) -> dict[str, Any]:
        parts: list[list[str]] = [[] for _ in self.choices]
        try:
            async with aclosing(self.deltas()) as deltas:
                async for choice, delta, _, _ in deltas:
                    parts[choice.index].append(delta)
        finally:
            self.close()
        self._raise_if_unfinished()
        choices = []
        for choice in self.choices:
            text = (self.prepared.echo or "") + "".join(parts[choice.index])
            body: dict[str, Any] = {"index": choice.index}
            if self.chat:
                body["message"] = {"role": "assistant", "content": text}
            else:
                body["text"] = text
            if self._echoes_logprobs():
                assert self.prepared.echo is not None
                body["logprobs"] = _joined(
                    self._prompt_logprobs(), self._logprobs(choice, 0, len(self.prepared.echo))
                )
            else:
                body["logprobs"] = self._logprobs(choice, 0, 0)
            body["finish_reason"] = choice.finish_reason
            choices.append(body)
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.context.model_name,
            "choices": choices,
            "usage": self.usage(),
        }

    def _raise_if_unfinished(self) -> None:
        if self.finish_reason == ENGINE_FAILED:
            raise engine_failed(self.failure)
        if self.finish_reason == "error":
            raise ApiError(500, f"this request failed: {self.failure}", code="request_failed")
        if self.finish_reason == "abort":
            raise ApiError(
                503,
                "the server shut down before the request finished",
                code="aborted",
                retry_after=5,
            )
        if self.finish_reason == "deadline":
            raise ApiError(
                503,
                "the request waited too long in the queue and was dropped",
                code="queue_timeout",
                retry_after=1,
            )

    async def sse(self) -> AsyncGenerator[bytes]:
        try:
            if self.chat:
                for choice in self.choices:
                    role = {"role": "assistant", "content": ""}
                    yield self._event(self._chunk(choice, role, None, None))
            elif self.prepared.echo and not self._echoes_logprobs():
                # The prompt first, as its own chunk per choice.
                for choice in self.choices:
                    yield self._event(self._chunk(choice, self.prepared.echo, None, None))
            async with aclosing(self.deltas()) as deltas:
                async for choice, delta, count, finish in deltas:
                    if self._echoes_logprobs() and not choice.echoed and finish not in _UNFINISHED:
                        # Its prompt's logprobs came with its first token.
                        assert self.prepared.echo is not None
                        echo = self._chunk(
                            choice, self.prepared.echo, None, self._prompt_logprobs()
                        )
                        yield self._event(echo)
                        choice.echoed, choice.sent_text = True, len(self.prepared.echo)
                    if finish in _UNFINISHED:
                        try:
                            self._raise_if_unfinished()
                        except ApiError as exc:
                            yield self._event(exc.body())
                        return
                    start = len(choice.tokens) - count
                    logprobs = self._logprobs(choice, start, choice.sent_text) if count else None
                    if not delta and finish is None and logprobs is None:
                        continue  # nothing a client could use (held-back or empty text)
                    payload = {"content": delta} if self.chat else delta
                    yield self._event(self._chunk(choice, payload, finish, logprobs))
                    choice.sent_text += len(delta)
            if self.prepared.include_usage:
                yield self._event(self._usage_chunk())
            yield b"data: [DONE]\n\n"
        finally:
            self.close()

    def _chunk(
        self, choice: Choice, payload: Any, finish: str | None, logprobs: Any
    ) -> dict[str, Any]:
        body = {"index": choice.index, "delta" if self.chat else "text": payload}
        body |= {"logprobs": logprobs, "finish_reason": finish}
        chunk: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.context.model_name,
            "choices": [body],
        }
        if self.prepared.include_usage:
            # vLLM's continuous_usage_stats: the counts so far in every chunk.
            chunk["usage"] = self.usage() if self.prepared.continuous_usage else None
        return chunk

    def _usage_chunk(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.context.model_name,
            "choices": [],
            "usage": self.usage(),
        }

    @staticmethod
    def _event(body: Any) -> bytes:
        data = _encoder.encode(body)
        if b"\xe2\x80" in data or b"\xc2\x85" in data:
            for raw, escaped in _LINE_BREAKS:
                data = data.replace(raw, escaped)
        return b"data: " + data + b"\n\n"

    def close(self) -> None:
        """However the relay ends (idempotent): cancels the request if it is
        still live, counts and logs its outcome."""
        if self._closed:
            return
        self._closed = True
        self.runtime.cancel(self.ticket)
        outcome = self.finish_reason or "disconnected"
        self.context.metrics.outcomes.labels(self.tenant, outcome).inc()
        now = time.monotonic()
        fields: dict[str, Any] = {}
        if self.context.log_prompts:
            texts = [self.tokenizer.decode(choice.tokens) for choice in self.choices]
            fields["completion"] = texts[0] if len(texts) == 1 else texts
        log.info(
            "request.finish",
            request_id=self.ticket.request_id,
            tenant=self.tenant,
            outcome=outcome,
            prompt_tokens=len(self.prepared.prompt),
            completion_tokens=self.completion_tokens,
            cached_tokens=self.usage()["prompt_tokens_details"]["cached_tokens"],
            ttft_s=None
            if self.ticket.first_token_at is None
            else round(self.ticket.first_token_at - self.arrival, 4),
            duration_s=round(now - self.arrival, 4),
            **fields,
        )
