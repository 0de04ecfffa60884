"""The tenants' HTTP API (quart-trio): OpenAI-compatible completions and chat,
streaming or not, plus health, readiness and Prometheus metrics.

A handler authenticates the bearer key, validates the body, submits to the
engine task and relays tokens as text. Whatever ends a handler (success,
error, a client hanging up) cancels its request in ``finally``, so no
request outlives its client. Nothing a handler says names another tenant.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import structlog
import trio
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from kvd import faults
from kvd.engine.tokenizer import Tokenizer
from kvd.sched.scheduler import Rejection, StepEvent
from kvd.server.api import ApiError, ChatRequest, CompletionRequest, Prepared, decode_body, prepare
from kvd.server.config import key_digest
from kvd.server.metrics import CONTENT_TYPE, Metrics
from kvd.server.runtime import (
    ENGINE_FAILED,
    Runtime,
    Ticket,
    failed_message,
    waiting_batches,
)
from kvd.server.textstream import TextStream

log = structlog.get_logger("kvd")

_CLIENT_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_BIG_PROMPT_CHARS = 16_384  # tokenized in a worker thread, off the event loop
_encoder = msgspec.json.Encoder()


@dataclass
class TenantAccess:
    name: str
    tier: str  # the most important tier it may use


@dataclass
class ServerState:
    runtime: Runtime | None  # None until the model is loaded (ready)
    tokenizer: Tokenizer | None
    model_name: str
    vocab_size: int
    max_model_len: int
    tiers: tuple[str, ...]
    metrics: Metrics
    keys: dict[str, TenantAccess]  # SHA-256 hex of the bearer key -> tenant
    log_prompts: bool = False
    ready: bool = False
    status: str = "starting"  # loading, ready, draining, failed
    detail: str | None = None  # what loading is doing, or why it failed
    queue_timeout: float | None = None
    created: int = field(default_factory=lambda: int(time.time()))


def engine_failed(cause: str | None) -> ApiError:
    return ApiError(503, failed_message(cause), code=ENGINE_FAILED, retry_after=5)


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(_encoder.encode(body), status, headers, content_type="application/json")


def _error(exc: ApiError, request_id: str | None = None) -> Response:
    headers = {}
    if exc.retry_after is not None:
        headers["Retry-After"] = str(max(1, int(-(-exc.retry_after // 1))))
    if request_id:
        headers["X-Request-Id"] = request_id
    return _json(exc.body(), exc.status, headers)


def create_metrics_app(metrics: Metrics) -> QuartTrio:
    """Prometheus metrics on their own listener (``server.metrics_listen``):
    they carry every tenant's figures, so never on the tenants' port."""
    app = QuartTrio("kvd-metrics")

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), 200, content_type=CONTENT_TYPE)

    return app


def create_app(state: ServerState, *, max_body: int) -> QuartTrio:
    app = QuartTrio("kvd")
    app.config["MAX_CONTENT_LENGTH"] = max_body
    # A long non-streamed completion on a slow device outlives Quart's default
    # 60 s response timeout, which would cut it silently.
    app.config["RESPONSE_TIMEOUT"] = None
    metrics = state.metrics

    @app.after_request
    async def count(response: Response) -> Response:
        rule = request.url_rule.rule if request.url_rule is not None else "other"
        metrics.http.labels(rule, str(response.status_code)).inc()
        return response

    @app.errorhandler(HTTPException)
    async def http_error(exc: HTTPException) -> Response:
        code = exc.code or 500
        message = {
            404: f"no route {request.method} {request.path}",
            405: f"method {request.method} is not allowed on {request.path}",
            413: f"the request body exceeds the limit of {max_body} bytes",
        }.get(code, exc.description or exc.name)
        return _error(ApiError(code, message, code=exc.name.lower().replace(" ", "_")))

    @app.errorhandler(ApiError)
    async def api_error(exc: ApiError) -> Response:
        return _error(exc)

    @app.errorhandler(Exception)
    async def unexpected(exc: Exception) -> Response:
        # A bug in one handler: that request gets an answer in the API's
        # format; the engine and everyone else are untouched.
        log.error("request.error", path=request.path, error=repr(exc))
        return _error(ApiError(500, f"internal error: {exc!r}", code="internal_error"))

    @app.get("/health")
    async def health() -> Response:
        return _json({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        if not state.ready or state.status != "ready":
            return _json({"status": state.status, "reason": state.detail}, 503)
        return _json({"status": "ready"})

    @app.get("/v1/models")
    async def models() -> Response:
        _authenticate(state)
        return _json({"object": "list", "data": [_model_card(state)]})

    @app.get("/v1/models/<path:name>")
    async def model(name: str) -> Response:
        _authenticate(state)
        if name != state.model_name:
            raise ApiError(404, f"the model {name!r} does not exist", code="model_not_found")
        return _json(_model_card(state))

    @app.post("/v1/completions")
    async def completions() -> Response:
        return await _infer(state, CompletionRequest)

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        return await _infer(state, ChatRequest)

    return app


def _model_card(state: ServerState) -> dict[str, Any]:
    return {
        "id": state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "kvd",
        "max_model_len": state.max_model_len,
    }


def _authenticate(state: ServerState) -> TenantAccess:
    header = request.headers.get("Authorization", "")
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise ApiError(
            401,
            "missing API key: send it as 'Authorization: Bearer KEY'",
            code="missing_api_key",
        )
    access = state.keys.get(key_digest(key.strip()))
    if access is None:
        raise ApiError(401, "the API key is not valid", code="invalid_api_key")
    return access


def _resolve_tier(state: ServerState, access: TenantAccess, priority: int | str | None) -> str:
    tiers = state.tiers
    if priority is None:
        return access.tier
    if isinstance(priority, int):
        if not 0 <= priority < len(tiers):
            raise ApiError(
                400, f"priority must be 0 to {len(tiers) - 1} (or a tier name)", param="priority"
            )
        tier = tiers[priority]
    else:
        if priority not in tiers:
            raise ApiError(
                400, f"unknown priority tier {priority!r} ({', '.join(tiers)})", param="priority"
            )
        tier = priority
    if tiers.index(tier) < tiers.index(access.tier):
        raise ApiError(
            403,
            f"this key may use tier {access.tier!r} or lower, not {tier!r}",
            param="priority",
            code="tier_not_allowed",
        )
    return tier


async def _infer(state: ServerState, kind: type[CompletionRequest] | type[ChatRequest]) -> Response:
    arrival = time.monotonic()
    client_id = request.headers.get("X-Request-Id", "")
    request_id = uuid.uuid4().hex
    reply_id = client_id if _CLIENT_ID.fullmatch(client_id) else request_id
    try:
        access = _authenticate(state)
        runtime = state.runtime
        if state.status == "failed":
            raise engine_failed(state.detail)
        if state.status == "draining":
            raise ApiError(503, "the server is shutting down", code="draining", retry_after=5)
        if runtime is None or not state.ready:
            raise ApiError(503, "the model is still loading", code="loading", retry_after=5)
        body = await request.get_data(cache=False)
        assert isinstance(body, bytes)
        decoded = decode_body(body, kind)
        if decoded.model != state.model_name:
            raise ApiError(
                404,
                f"the model {decoded.model!r} does not exist (this server has "
                f"{state.model_name!r})",
                param="model",
                code="model_not_found",
            )
        prepared = await _prepare(state, decoded, len(body), request_id, access.name)
        tier = _resolve_tier(state, access, decoded.priority)
        try:
            ticket = await runtime.submit(
                access.name,
                prepared.prompt,
                prepared.params,
                tier=tier,
                cache_salt=prepared.cache_salt,
                deadline_s=state.queue_timeout,
                request_id=request_id,
                arrival=arrival,
            )
        except Rejection as exc:
            if exc.code == "rate_limited":
                log.info(
                    "tenant.rate_limited",
                    tenant=access.name,
                    request_id=request_id,
                    retry_after_s=exc.retry_after,
                )
            raise ApiError(
                exc.status, str(exc), code=exc.code, retry_after=exc.retry_after
            ) from None
    except ApiError as exc:
        if exc.status >= 500 or exc.status == 413:
            log.info("request.refused", request_id=request_id, status=exc.status, code=exc.code)
        return _error(exc, reply_id)
    try:
        relay = Relay(state, access.name, ticket, prepared, arrival, kind is ChatRequest)
    except BaseException:
        runtime.cancel(ticket)  # no reader would ever end it
        raise
    start_fields: dict[str, Any] = {}
    if state.log_prompts:
        start_fields["prompt"] = relay.tokenizer.decode(prepared.prompt)
    log.info(
        "request.accepted",
        request_id=request_id,
        client_request_id=client_id or None,
        tenant=access.name,
        endpoint="chat" if relay.chat else "completions",
        prompt_tokens=len(prepared.prompt),
        max_tokens=prepared.params.max_tokens,
        stream=prepared.stream,
        tier=tier,
        **start_fields,
    )
    headers = {"X-Request-Id": reply_id}
    if prepared.stream:
        headers |= {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        response = Response(relay.sse(), 200, headers, content_type="text/event-stream")
        response.timeout = None
        return response
    try:
        body_out = await relay.collect()
    except ApiError as exc:
        return _error(exc, reply_id)
    return _json(body_out, 200, headers)


async def _prepare(
    state: ServerState, decoded: Any, size: int, request_id: str, tenant: str
) -> Prepared:
    tokenizer = state.tokenizer
    assert tokenizer is not None

    def run() -> Prepared:
        try:
            if faults.fire("tokenize") == "raise":
                raise faults.InjectedFault("injected: tokenizing failed")
            return prepare(decoded, tokenizer, state.vocab_size, state.max_model_len)
        except ApiError:
            raise
        except Exception as exc:  # noqa: BLE001  # this request's own fault: it alone fails
            cause = f"turning its prompt into tokens failed: {exc!r}"
            log.warning("request.failed", request_id=request_id, tenant=tenant, error=cause)
            raise ApiError(500, f"this request failed: {cause}", code="request_failed") from exc

    if size > _BIG_PROMPT_CHARS:
        return await trio.to_thread.run_sync(run)
    return run()


_UNFINISHED = ("abort", "deadline", "error", ENGINE_FAILED)  # an error body, no [DONE]


class Relay:
    """One request's tokens on their way to its client."""

    _closed = True  # until built: a relay whose __init__ failed has nothing to end

    def __init__(
        self,
        state: ServerState,
        tenant: str,
        ticket: Ticket,
        prepared: Prepared,
        arrival: float,
        chat: bool,
    ) -> None:
        self.state = state
        self.tenant = tenant
        self.ticket = ticket
        self.prepared = prepared
        self.arrival = arrival
        self.chat = chat
        assert state.runtime is not None and state.tokenizer is not None
        self.runtime = state.runtime
        self.tokenizer = state.tokenizer
        self.text = TextStream(state.tokenizer, prepared.params.stop)
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.finish_reason: str | None = None
        self.failure: str | None = None  # why it ended with an error
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.created = int(time.time())
        self.id = ("chatcmpl-" if chat else "cmpl-") + ticket.request_id
        self._closed = False

    # -- tokens --------------------------------------------------------------------

    async def deltas(self) -> AsyncIterator[tuple[str, int, str | None]]:
        """(new text, how many new tokens, finish reason or None), as they
        come: every token waiting when the reader wakes is taken at once, so
        a client that reads slower than the engine steps gets fewer, larger
        chunks, not a backlog of one-token ones."""
        async for batch in waiting_batches(self.ticket.events):
            ended = batch[-1] if batch[-1].token is None else None
            tokens = batch[:-1] if ended is not None else batch
            if tokens:
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
            if ended is not None:  # ended without a token: abort, deadline, failure, cancel
                self.finish_reason = ended.finish_reason
                self.failure = ended.detail
                yield ("" if ended.detail else self.text.flush()), 0, self.finish_reason
                return

    def _take(self, events: list[StepEvent]) -> tuple[str, int, str | None]:
        """Text for a run of token events, and the finish reason if they end it."""
        if faults.fire("detokenize") == "raise":
            raise faults.InjectedFault("injected: detokenizing failed")
        now = time.monotonic()
        if self.first_token_at is None:
            self.first_token_at = now
        self.last_token_at = now
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
        tokenizer = self.tokenizer
        ids, values = self.tokens[start:], self.logprobs[start:]
        pieces = [tokenizer.decode([t], skip_special=False) for t in ids]
        if self.chat:
            return {
                "content": [
                    {
                        "token": piece,
                        "logprob": value,
                        "bytes": list(piece.encode()),
                        "top_logprobs": [],
                    }
                    for piece, value in zip(pieces, values, strict=True)
                ]
            }
        offsets, at = [], text_offset
        for piece in pieces:
            offsets.append(at)
            at += len(piece)
        return {
            "tokens": pieces,
            "token_logprobs": values,
            "top_logprobs": None,
            "text_offset": offsets,
        }

    async def collect(self) -> dict[str, Any]:
        parts: list[str] = []
        try:
            async for delta, _, _ in self.deltas():
                parts.append(delta)
        finally:
            self._close()
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

    async def sse(self) -> AsyncIterator[bytes]:
        sent_text = 0
        try:
            if self.chat:
                yield self._event(self._chunk({"role": "assistant", "content": ""}, None, None))
            async for delta, count, finish in self.deltas():
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
            self._close()

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
            chunk["usage"] = None
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

    def __del__(self) -> None:
        # A client that left before the body was first iterated: the stream's
        # finally never ran, so the request is ended when the relay is
        # dropped. The collector may run on any thread (a step's worker, say):
        # the close is handed to the event loop's thread.
        if not self._closed:
            self.runtime.run_soon(self._close)

    def _close(self) -> None:
        """Runs however the relay ends: cancels the request if it is still live."""
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
