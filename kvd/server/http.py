"""The tenants' HTTP API (quart-trio): OpenAI-compatible completions and chat,
streaming or not, plus health, readiness and Prometheus metrics.

A handler authenticates the bearer key, validates the body, submits to the
step loop and relays tokens as text (kvd/server/responses.py). Each
request's relay belongs to its HTTP exchange: whatever ends the exchange
(the body sent, an error, a client hanging up before or while its body is
sent) closes the relay, which cancels the request, so no request outlives
its client. Nothing a handler says names another tenant.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

import msgspec
import structlog
import trio
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from kvd import faults
from kvd.sched.scheduler import Rejection
from kvd.server.api import ApiError, ChatRequest, CompletionRequest, Prepared, decode_body, prepare
from kvd.server.config import key_digest
from kvd.server.grammar import GrammarError, compiler_for
from kvd.server.metrics import CONTENT_TYPE, Metrics
from kvd.server.responses import Relay, engine_failed
from kvd.server.runtime import Runtime
from kvd.server.serving import ServerContext, TenantAccess
from kvd.server.status import Status
from kvd.server.stopstrings import StopStrings

log = structlog.get_logger("kvd")

_CLIENT_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_BIG_PROMPT_CHARS = 16_384  # tokenized in a worker thread, off the event loop
_encoder = msgspec.json.Encoder()


# The closers of the relays made during the current HTTP exchange (see KvdApp).
_exchange: ContextVar[list[Callable[[], None]]] = ContextVar("kvd_exchange")


class KvdApp(QuartTrio):
    """A QuartTrio app whose HTTP exchanges own what their handlers start.

    Quart drops a response whose client left before its body was iterated
    (the exchange is cancelled between the handler's return and the send),
    and an async generator never started runs no ``finally``: so what must
    end with the exchange is registered with it and ended here, whichever
    way the exchange ends."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return
        closers: list[Callable[[], None]] = []
        token = _exchange.set(closers)
        try:
            await super().__call__(scope, receive, send)
        finally:
            _exchange.reset(token)
            for close in closers:
                close()


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


def create_app(context: ServerContext, *, max_body: int) -> QuartTrio:
    app = KvdApp("kvd")
    app.config["MAX_CONTENT_LENGTH"] = max_body
    # A long non-streamed completion on a slow device outlives Quart's default
    # 60 s response timeout, which would cut it silently.
    app.config["RESPONSE_TIMEOUT"] = None
    metrics = context.metrics

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
        status = context.status
        if not status.serving:
            return _json({"status": str(status), "reason": status.detail}, 503)
        return _json({"status": str(status)})

    @app.get("/v1/models")
    async def models() -> Response:
        _authenticate(context)
        return _json({"object": "list", "data": [_model_card(context)]})

    @app.get("/v1/models/<path:name>")
    async def model(name: str) -> Response:
        _authenticate(context)
        if name != context.model_name:
            raise ApiError(404, f"the model {name!r} does not exist", code="model_not_found")
        return _json(_model_card(context))

    @app.post("/v1/completions")
    async def completions() -> Response:
        return await _infer(context, CompletionRequest)

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        return await _infer(context, ChatRequest)

    return app


def _check_serving(context: ServerContext) -> Runtime:
    """The runtime, if the daemon takes requests now; else the 503 saying why."""
    status = context.status
    if status.status is Status.FAILED:
        raise engine_failed(status.detail)
    if status.status is Status.DRAINING:
        raise ApiError(503, "the server is shutting down", code="draining", retry_after=5)
    if context.runtime is None or not status.serving:
        raise ApiError(503, "the model is still loading", code="loading", retry_after=5)
    return context.runtime


def _stop_strings(context: ServerContext, prepared: Prepared) -> StopStrings | None:
    """The watch on the request's stop strings the scheduler keeps, if any."""
    if not prepared.params.stop:
        return None
    assert context.tokenizer is not None  # serving: the model is loaded
    return StopStrings(context.tokenizer, prepared.params.stop)


def _model_card(context: ServerContext) -> dict[str, Any]:
    return {
        "id": context.model_name,
        "object": "model",
        "created": context.created,
        "owned_by": "kvd",
        "max_model_len": context.max_model_len,
    }


def _authenticate(context: ServerContext) -> TenantAccess:
    header = request.headers.get("Authorization", "")
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise ApiError(
            401,
            "missing API key: send it as 'Authorization: Bearer KEY'",
            code="missing_api_key",
        )
    access = context.keys.get(key_digest(key.strip()))
    if access is None:
        raise ApiError(401, "the API key is not valid", code="invalid_api_key")
    return access


def _resolve_tier(context: ServerContext, access: TenantAccess, priority: int | str | None) -> str:
    tiers = context.tiers
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


async def _infer(
    context: ServerContext, kind: type[CompletionRequest] | type[ChatRequest]
) -> Response:
    arrival = time.monotonic()
    client_id = request.headers.get("X-Request-Id", "")
    request_id = uuid.uuid4().hex
    reply_id = client_id if _CLIENT_ID.fullmatch(client_id) else request_id
    try:
        access = _authenticate(context)
        _check_serving(context)
        body = await request.get_data(cache=False)
        assert isinstance(body, bytes)
        decoded = decode_body(body, kind)
        if decoded.model != context.model_name:
            raise ApiError(
                404,
                f"the model {decoded.model!r} does not exist (this server has "
                f"{context.model_name!r})",
                param="model",
                code="model_not_found",
            )
        prepared = await _prepare(context, decoded, len(body), request_id, access.name)
        tier = _resolve_tier(context, access, decoded.priority)
        # Again: a drain may have begun while the body was read and tokenized
        # (from here to the request's being in flight nothing waits).
        runtime = _check_serving(context)
        try:
            ticket = await runtime.submit(
                access.name,
                prepared.prompt,
                prepared.params,
                tier=tier,
                cache_salt=prepared.cache_salt,
                deadline_s=context.queue_timeout,
                request_id=request_id,
                arrival=arrival,
                n=prepared.n,
                constraint=prepared.constraint,
                stop=_stop_strings(context, prepared),
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
        relay = Relay(context, access.name, ticket, prepared, arrival, kind is ChatRequest)
    except BaseException:
        runtime.cancel(ticket)  # no reader would ever end it
        raise
    _exchange.get().append(relay.close)
    start_fields: dict[str, Any] = {}
    if context.log_prompts:
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
    context: ServerContext, decoded: Any, size: int, request_id: str, tenant: str
) -> Prepared:
    tokenizer = context.tokenizer
    assert tokenizer is not None

    def run() -> Prepared:
        try:
            if faults.fire("tokenize") == "raise":
                raise faults.InjectedFault("injected: tokenizing failed")
            return prepare(
                decoded, tokenizer, context.vocab_size, context.max_model_len, context.max_n
            )
        except ApiError:
            raise
        except Exception as exc:  # noqa: BLE001  # this request's own fault: it alone fails
            cause = f"turning its prompt into tokens failed: {exc!r}"
            log.warning("request.failed", request_id=request_id, tenant=tenant, error=cause)
            raise ApiError(500, f"this request failed: {cause}", code="request_failed") from exc

    prepared = await trio.to_thread.run_sync(run) if size > _BIG_PROMPT_CHARS else run()
    if prepared.grammar is None:
        return prepared
    grammars = compiler_for(tokenizer, context.vocab_size)
    try:
        # Off the event loop: the vocabulary's first build takes seconds, a
        # complex grammar's compile up to about a second (a cached one, microseconds).
        constraint = await trio.to_thread.run_sync(grammars.constraint, prepared.grammar)
    except GrammarError as exc:
        raise ApiError(400, str(exc), param=exc.param, code="invalid_grammar") from None
    return msgspec.structs.replace(prepared, constraint=constraint)
