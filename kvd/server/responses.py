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
from kvd.server.serving import ServerState
from kvd.server.textstream import TextStream

log = structlog.get_logger("kvd")
_encoder = msgspec.json.Encoder()


def engine_failed(cause: str | None) -> ApiError:
    return ApiError(503, failed_message(cause), code=ENGINE_FAILED, retry_after=5)


_UNFINISHED = ("abort", "deadline", "error", ENGINE_FAILED)  # an error body, no [DONE]


class Relay:
    """One request's tokens on their way to its client."""

    def __init__(
        self,
        state: ServerState,
        tenant: str,
        ticket: Ticket,
        prepared: Prepared,
        arrival: float,
        chat: bool,
    ) -> None:
        assert state.runtime is not None and state.tokenizer is not None
        self.state = state
        self.tenant = tenant
        self.ticket = ticket
        self.prepared = prepared
        self.arrival = arrival
        self.chat = chat
        self.runtime = state.runtime
        self.tokenizer = state.tokenizer
        self.text = TextStream(state.tokenizer, prepared.params.stop)
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.tops: list[tuple[tuple[int, float], ...]] = []  # alternatives, when asked
        self.finish_reason: str | None = None
        self.failure: str | None = None  # why it ended with an error
        self.first_token_at: float | None = None
        self.created = int(time.time())
        self.id = ("chatcmpl-" if chat else "cmpl-") + ticket.request_id
        self._closed = False

    # -- tokens --------------------------------------------------------------------

    async def deltas(self) -> AsyncGenerator[tuple[str, int, str | None]]:
        """(new text, how many new tokens, finish reason or None), as they
        come: every token waiting when the reader wakes is taken at once, so
        a client that reads slower than the engine steps gets fewer, larger
        chunks, not a backlog of one-token ones."""
        async with aclosing(waiting_batches(self.ticket.events)) as batches:
            async for tokens in batches:
                try:
                    delta, count, finish = self._take(tokens)
                except Exception as exc:  # noqa: BLE001  # this request's own fault: it alone ends
                    self.finish_reason = "error"
                    self.failure = f"turning its tokens into text failed: {exc!r}"
                    log.warning(
                        "request.failed",
                        request_id=self.ticket.request_id,
                        tenant=self.tenant,
                        error=self.failure,
                    )
                    yield "", 0, "error"
                    return
                yield delta, count, finish
                if finish is not None:
                    return
            # Closed after its last token without one that finished it: aborted,
            # dropped at its deadline, failed, or the engine failed.
            self.finish_reason = self.ticket.finish_reason or "abort"
            self.failure = self.ticket.detail
            yield ("" if self.failure else self.text.flush()), 0, self.finish_reason

    def _take(self, events: list[StepEvent]) -> tuple[str, int, str | None]:
        """Text for a run of token events, and the finish reason if they end it."""
        if faults.fire("detokenize") == "raise":
            raise faults.InjectedFault("injected: detokenizing failed")
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
        last = events[-1]
        finish = last.finish_reason if last.finished else None
        if self.text.has_stops:
            # One at a time: the token that completes a stop string is the last.
            parts = []
            for taken, event in enumerate(events, 1):
                parts.append(self.text.push(event.token))  # type: ignore[arg-type]
                if self.text.stopped:  # a stop string: the rest is not wanted
                    self.runtime.cancel(self.ticket)
                    events, finish = events[:taken], "stop"
                    break
            delta = "".join(parts)
        else:
            delta = self.text.push_many([e.token for e in events])  # type: ignore[misc]
        self.tokens.extend(e.token for e in events)  # type: ignore[misc]
        self.logprobs.extend(e.logprob for e in events)
        if self.prepared.params.top_logprobs:
            self.tops.extend(e.top or () for e in events)
        if finish is not None:
            self.finish_reason = finish
            delta += self.text.flush()  # nothing after a stop string
        return delta, len(events), finish

    # -- bodies ----------------------------------------------------------------------

    def usage(self) -> dict[str, Any]:
        request = self.ticket.request
        cached = request.cached_tokens if request is not None else 0
        prompt = len(self.prepared.prompt)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": len(self.tokens),
            "total_tokens": prompt + len(self.tokens),
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def _logprobs(self, start: int, text_offset: int) -> dict[str, Any] | None:
        if not self.prepared.params.logprobs:
            return None
        ids, values = self.tokens[start:], self.logprobs[start:]
        pieces = [self._piece(t) for t in ids]
        tops = self.tops[start:] if self.prepared.params.top_logprobs else [()] * len(ids)
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
        offsets, at = [], text_offset
        for piece in pieces:
            offsets.append(at)
            at += len(piece)
        return {
            "tokens": pieces,
            "token_logprobs": values,
            # Keyed by text, as OpenAI's are (two ids with one text: the likelier).
            "top_logprobs": [{self._piece(t): v for t, v in reversed(top)} for top in tops]
            if self.prepared.params.top_logprobs
            else None,
            "text_offset": offsets,
        }

    def _piece(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special=False)

    async def collect(self) -> dict[str, Any]:
        parts: list[str] = []
        try:
            async with aclosing(self.deltas()) as deltas:
                async for delta, _, _ in deltas:
                    parts.append(delta)
        finally:
            self.close()
        self._raise_if_unfinished()
        text = "".join(parts)
        if self.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": self._logprobs(0, 0),
                "finish_reason": self.finish_reason,
            }
            kind = "chat.completion"
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": self._logprobs(0, 0),
                "finish_reason": self.finish_reason,
            }
            kind = "text_completion"
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.state.model_name,
            "choices": [choice],
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
        sent_text = 0
        try:
            if self.chat:
                yield self._event(self._chunk({"role": "assistant", "content": ""}, None, None))
            async with aclosing(self.deltas()) as deltas:
                async for delta, count, finish in deltas:
                    if finish in _UNFINISHED:
                        try:
                            self._raise_if_unfinished()
                        except ApiError as exc:
                            yield self._event(exc.body())
                        return
                    start = len(self.tokens) - count
                    logprobs = self._logprobs(start, sent_text) if count else None
                    if not delta and finish is None and logprobs is None:
                        continue  # nothing a client could use (held-back or empty text)
                    payload = {"content": delta} if self.chat else delta
                    yield self._event(self._chunk(payload, finish, logprobs))
                    sent_text += len(delta)
            if self.prepared.include_usage:
                yield self._event(self._usage_chunk())
            yield b"data: [DONE]\n\n"
        finally:
            self.close()

    def _chunk(self, payload: Any, finish: str | None, logprobs: Any) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "delta": payload, "logprobs": logprobs, "finish_reason": finish}
            kind = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": payload, "logprobs": logprobs, "finish_reason": finish}
            kind = "text_completion"
        chunk: dict[str, Any] = {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.state.model_name,
            "choices": [choice],
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
            "model": self.state.model_name,
            "choices": [],
            "usage": self.usage(),
        }

    @staticmethod
    def _event(body: Any) -> bytes:
        return b"data: " + _encoder.encode(body) + b"\n\n"

    def close(self) -> None:
        """However the relay ends (idempotent): cancels the request if it is
        still live, counts and logs its outcome."""
        if self._closed:
            return
        self._closed = True
        self.runtime.cancel(self.ticket)
        outcome = self.finish_reason or "disconnected"
        self.state.metrics.outcomes.labels(self.tenant, outcome).inc()
        now = time.monotonic()
        fields: dict[str, Any] = {}
        if self.state.log_prompts:
            fields["completion"] = self.tokenizer.decode(self.tokens)
        log.info(
            "request.finish",
            request_id=self.ticket.request_id,
            tenant=self.tenant,
            outcome=outcome,
            prompt_tokens=len(self.prepared.prompt),
            completion_tokens=len(self.tokens),
            cached_tokens=self.usage()["prompt_tokens_details"]["cached_tokens"],
            ttft_s=None
            if self.first_token_at is None
            else round(self.first_token_at - self.arrival, 4),
            duration_s=round(now - self.arrival, 4),
            **fields,
        )
