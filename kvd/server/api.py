"""OpenAI-compatible request bodies, and their translation into kvd's terms.

Bodies reject unknown fields: a misspelt parameter is a 400 naming it, not a
silently ignored setting. Parameters OpenAI defines that kvd does not
implement (``suffix``, tools) are accepted only at
their neutral value, and refused with a message otherwise.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from functools import partial
from typing import Annotated, Any, Literal, NamedTuple

import msgspec
import numpy as np
from msgspec import Meta

from kvd.engine.tokenizer import ChatMessage, Tokenizer, TokenizerError
from kvd.sched.admission import prompt_problem
from kvd.sched.sampling_params import (
    MAX_BIAS,
    MAX_LOGIT_BIAS,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_STOP_IDS,
    MAX_TEMPERATURE,
    MAX_TOP_LOGPROBS,
    MIN_TEMPERATURE,
    SamplingParams,
)
from kvd.server.config import DEFAULT_MAX_N
from kvd.server.grammar import Grammar

MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
# Limits a body is checked against before it is decoded any deeper, so no
# request can make the decoder recurse or allocate without bound.
MAX_JSON_DEPTH = 32  # nesting of arrays and objects
MAX_MESSAGES = 2048
MAX_PARTS = 256  # content parts of one message
MAX_TOOLS = 128
MAX_NAME = 256  # user, cache_salt, a message's name

Temperature = Annotated[float, Meta(ge=0, le=MAX_TEMPERATURE)]
TopP = Annotated[float, Meta(gt=0, le=1)]
Penalty = Annotated[float, Meta(ge=-MAX_PENALTY, le=MAX_PENALTY)]
Count = Annotated[int, Meta(ge=1)]
Int64 = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
Name = Annotated[str, Meta(max_length=MAX_NAME)]


class ApiError(Exception):
    """An error answered in OpenAI's error body format."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after

    @property
    def type(self) -> str:
        return {
            401: "authentication_error",
            403: "permission_error",
            404: "not_found_error",
            429: "rate_limit_error",
        }.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class JsonSchemaFormat(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | bool | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """vLLM's ``structured_outputs``: one of these."""

    json: dict[str, Any] | str | None = None  # a JSON schema
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark
    json_object: bool | None = None


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk (with include_usage)


class _Common(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    # OpenAI accepts null for every optional parameter: null means the default.
    model: str
    max_tokens: Count | None = None
    temperature: Temperature | None = None  # default 1.0
    top_p: TopP | None = None  # default 1.0
    n: Count | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: str | Annotated[list[str], Meta(max_length=MAX_STOP_STRINGS)] | None = None
    seed: Int64 | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: Annotated[dict[str, float], Meta(max_length=MAX_LOGIT_BIAS)] | None = None
    user: Name | None = None
    # Extensions, as vLLM spells them.
    top_k: Annotated[int, Meta(ge=-1, le=2**31 - 1)] | None = None  # 0 or -1: off
    stop_token_ids: Annotated[list[int], Meta(max_length=MAX_STOP_IDS)] | None = None
    cache_salt: Name | None = None
    priority: int | Name | None = None  # a tier: its name, or its index (0 = most important)
    ignore_eos: bool | None = None  # the model's end tokens do not end the generation
    min_tokens: Annotated[int, Meta(ge=0)] | None = None  # before an end token or stop id
    min_p: Annotated[float, Meta(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Meta(gt=0, le=MAX_REPETITION_PENALTY)] | None = None
    # Structured output: OpenAI's response_format, or vLLM's fields.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_Common, forbid_unknown_fields=True, frozen=True):
    prompt: str | list[Any] = ""
    logprobs: Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None


class TextPart(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    type: str
    text: str | None = None


class Message(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    role: str
    content: str | Annotated[list[TextPart], Meta(max_length=MAX_PARTS)] | None = None
    name: Name | None = None


class ChatRequest(_Common, forbid_unknown_fields=True, frozen=True):
    messages: Annotated[list[Message], Meta(max_length=MAX_MESSAGES)] = msgspec.field(
        default_factory=list
    )
    max_completion_tokens: Count | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: Annotated[list[Any], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None


class Prepared(msgspec.Struct, frozen=True):
    """A validated request in kvd's terms."""

    prompt: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    continuous_usage: bool  # usage in every chunk, not only the last
    tier: int | str | None
    cache_salt: str | None
    n: int = 1  # choices
    grammar: Grammar | None = None  # the output's format (structured output)
    constraint: Any = None  # its compiled form, a fresh one per request (kvd/server/grammar.py)
    echo: str | None = None  # completions' echo: the prompt's text, before each choice's


_DECODERS: dict[type, msgspec.json.Decoder[Any]] = {}
_PATH = re.compile(r" - at `\$\.?([^`]*)`$")


def decode_body(body: bytes, kind: type[_Common]) -> Any:
    """Decode a JSON body, or raise a 400 naming the offending field."""
    if not body.strip():
        raise ApiError(400, "the request body is empty; send a JSON object", code="bad_body")
    _check_depth(body)
    decoder = _DECODERS.get(kind)
    if decoder is None:
        decoder = _DECODERS[kind] = msgspec.json.Decoder(kind)
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        message = str(exc)
        match = _PATH.search(message)
        param = match.group(1) if match else None
        unknown = re.search(r"unknown field `([^`]*)`", message)
        if unknown:  # named in full: inside an object, its path and the field
            param = f"{param}.{unknown.group(1)}" if param else unknown.group(1)
        text = message[: match.start()] if match else message
        raise ApiError(400, text, param=param or None, code="invalid_value") from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}", code="bad_json") from None


def _check_depth(body: bytes) -> None:
    """Refuse a body nested deeper than ``MAX_JSON_DEPTH`` with a 400 naming
    the top-level field it is in, before the decoder recurses into it.

    One vectorised pass: quotes not escaped by an odd run of backslashes
    toggle "inside a string"; brackets outside strings move the depth.
    """
    raw = np.frombuffer(body, np.uint8)
    opens = (raw == ord("[")) | (raw == ord("{"))
    closes = (raw == ord("]")) | (raw == ord("}"))
    if int(opens.sum()) <= MAX_JSON_DEPTH:
        return  # cannot be too deep: the common case costs two compares
    backslash = raw == ord("\\")
    # Length of the run of backslashes ending just before each byte.
    index = np.arange(len(raw))
    last_plain = np.maximum.accumulate(np.where(backslash, -1, index))
    run_before = np.empty(len(raw), np.int64)
    run_before[0] = 0
    run_before[1:] = index[:-1] - last_plain[:-1]
    quote = (raw == ord('"')) & (run_before % 2 == 0)
    inside = (np.cumsum(quote) - quote) % 2 == 1  # a quote itself is outside
    step = np.where(inside, 0, opens.astype(np.int64) - closes.astype(np.int64))
    depth = np.cumsum(step)
    deep = np.flatnonzero(depth > MAX_JSON_DEPTH)
    if not len(deep):
        return
    at = int(deep[0])
    # The top-level key before that point: the last quoted string at depth 1
    # that a colon follows.
    field = None
    for match in _KEY.finditer(body, 0, at):
        if depth[match.start()] == 1 and not inside[match.start()]:
            field = match.group(1).decode(errors="replace")
    raise ApiError(
        400,
        f"the body is nested more than {MAX_JSON_DEPTH} levels deep"
        + (f" in {field!r}" if field else ""),
        param=field,
        code="too_deep",
    )


_KEY = re.compile(rb'"((?:[^"\\]|\\.)*)"\s*:')


def _unsupported(request: _Common) -> None:
    checks: list[tuple[bool, str, str]] = []
    if isinstance(request, CompletionRequest):
        checks += [
            (
                request.best_of not in (None, request.n or 1),
                "best_of",
                "best_of must equal n (choices are not ranked)",
            ),
            (bool(request.suffix), "suffix", "suffix is not supported"),
        ]
    if isinstance(request, ChatRequest):
        checks += [
            (
                bool(request.top_logprobs) and not request.logprobs,
                "top_logprobs",
                "top_logprobs needs logprobs=true",
            ),
            (bool(request.tools), "tools", "tool calls are not supported"),
        ]
    for failed, param, message in checks:
        if failed:
            raise ApiError(400, message, param=param, code="unsupported")


def _stops(request: _Common) -> tuple[tuple[str, ...], tuple[int, ...]]:
    stop = request.stop
    strings = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(strings) > MAX_STOP_STRINGS:
        raise ApiError(400, f"at most {MAX_STOP_STRINGS} stop strings", param="stop")
    if any(not s or len(s) > MAX_STOP_LENGTH for s in strings):
        raise ApiError(400, f"stop strings must be 1 to {MAX_STOP_LENGTH} characters", param="stop")
    ids = tuple(request.stop_token_ids or ())
    if len(ids) > MAX_STOP_IDS:
        raise ApiError(400, f"at most {MAX_STOP_IDS} stop token ids", param="stop_token_ids")
    return strings, ids


def _logit_bias(bias: dict[str, float] | None, vocab: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``{"token id": bias}`` as (id, bias) pairs, checked."""
    pairs = []
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise ApiError(
                400, f"logit_bias keys are token ids; {key!r} is not one", param="logit_bias"
            ) from None
        if not 0 <= token < vocab:
            raise ApiError(
                400, f"logit_bias: token id {token} is outside the vocabulary", param="logit_bias"
            )
        if not -MAX_BIAS <= value <= MAX_BIAS:
            raise ApiError(
                400,
                f"logit_bias: the bias of token {token} is {value:g}; each must be in "
                f"[-{MAX_BIAS:g}, {MAX_BIAS:g}]",
                param="logit_bias",
            )
        pairs.append((token, float(value)))
    return tuple(pairs)


def _grammar(request: _Common) -> Grammar | None:
    """The request's structured-output format, if it asks for one (one at most)."""
    found: list[Grammar] = []

    def schema(value: Any, param: str) -> None:
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise ApiError(400, f"{param} is not valid JSON", param=param) from None
        if not isinstance(value, dict | bool):
            raise ApiError(400, f"{param} must be a JSON schema (an object)", param=param)
        found.append(Grammar("json", json.dumps(value), param))

    def choice(options: list[str], param: str) -> None:
        if not options or not all(options):
            raise ApiError(400, f"{param} must be a list of non-empty strings", param=param)
        found.append(Grammar("choice", json.dumps(options), param))

    def text(kind: str, value: str, param: str) -> None:
        if not value:
            raise ApiError(400, f"{param} must not be empty", param=param)
        found.append(Grammar(kind, value, param))

    form = request.response_format
    if form is not None and form.type == "json_object":
        schema({"type": "object"}, "response_format")
    elif form is not None and form.type == "json_schema":
        if form.json_schema is None or form.json_schema.schema is None:
            raise ApiError(
                400,
                "response_format of type json_schema needs json_schema.schema",
                param="response_format.json_schema",
            )
        schema(form.json_schema.schema, "response_format.json_schema.schema")
    outputs = request.structured_outputs or StructuredOutputs()
    if outputs.json_object:
        schema({"type": "object"}, "structured_outputs.json_object")
    add: dict[str, Callable[[Any, str], None]] = {
        "json": schema,
        "choice": choice,
        "regex": partial(text, "regex"),
        "lark": partial(text, "lark"),
    }
    for kind, value, param in (
        ("json", outputs.json, "structured_outputs.json"),
        ("regex", outputs.regex, "structured_outputs.regex"),
        ("choice", outputs.choice, "structured_outputs.choice"),
        ("lark", outputs.grammar, "structured_outputs.grammar"),
        ("json", request.guided_json, "guided_json"),
        ("regex", request.guided_regex, "guided_regex"),
        ("choice", request.guided_choice, "guided_choice"),
        ("lark", request.guided_grammar, "guided_grammar"),
    ):
        if value is not None:
            add[kind](value, param)
    if len(found) > 1:
        raise ApiError(
            400,
            "one structured output format per request: "
            + " and ".join(g.param for g in found)
            + " were both given",
            param=found[1].param,
        )
    return found[0] if found else None


def _token_prompt(prompt: list[Any], vocab: int) -> list[int]:
    if prompt and all(isinstance(t, list | str) for t in prompt):
        raise ApiError(
            400,
            "send one prompt per request (batches of prompts are not supported)",
            param="prompt",
            code="unsupported",
        )
    if not all(type(t) is int for t in prompt):
        raise ApiError(400, "a prompt is a string or an array of token ids", param="prompt")
    return list(prompt)


def _chat_messages(messages: list[Message]) -> list[ChatMessage]:
    out: list[ChatMessage] = []
    for i, message in enumerate(messages):
        role = "system" if message.role == "developer" else message.role
        content = message.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise ApiError(
                        400,
                        f"content part type {part.type!r} is not supported (text only)",
                        param=f"messages[{i}].content",
                    )
                texts.append(part.text)
            content = "".join(texts)
        out.append(ChatMessage(role, content or ""))
    return out


class _PromptPart(NamedTuple):
    """What a body's own kind (chat or completion) decides."""

    prompt: list[int]
    max_tokens: int | None  # None: the rest of the context
    logprobs: bool
    top_logprobs: int
    echo: str | None = None  # completions echoing their prompt
    prompt_logprobs: int | None = None


def prepare(
    request: _Common,
    tokenizer: Tokenizer,
    vocab: int,
    max_model_len: int,
    max_n: int = DEFAULT_MAX_N,
) -> Prepared:
    """Validate a decoded body against the model; raise ApiError (400/413).
    Each rule is its own function; they run in the order a client reads its
    body (choices, stops, the prompt, its room, sampling)."""
    _unsupported(request)
    n = request.n or 1
    if n > max_n:
        raise ApiError(400, f"n is {n}; this server allows at most {max_n}", param="n")
    stop, stop_ids = _stops(request)
    _check_stop_ids(stop_ids, vocab)
    if isinstance(request, ChatRequest):
        part = _chat_part(request, tokenizer)
    else:
        assert isinstance(request, CompletionRequest)
        part = _completion_part(request, tokenizer, vocab)
    max_tokens = _max_tokens(request, part, vocab, max_model_len)
    temperature = _temperature(request)
    top_k = _top_k(request, vocab)
    grammar = _grammar(request)
    params = SamplingParams(
        temperature=temperature,
        top_k=top_k,
        top_p=1.0 if request.top_p is None else request.top_p,
        seed=None if request.seed is None else request.seed % 2**32,
        max_tokens=max_tokens,
        stop_token_ids=stop_ids,
        stop=stop,
        logprobs=part.logprobs,
        top_logprobs=part.top_logprobs,
        ignore_eos=bool(request.ignore_eos),
        min_tokens=_min_tokens(request, grammar, max_tokens),
        min_p=request.min_p or 0.0,
        logit_bias=_logit_bias(request.logit_bias, vocab),
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        repetition_penalty=1.0
        if request.repetition_penalty is None
        else request.repetition_penalty,
        prompt_logprobs=part.prompt_logprobs,
    )
    options = request.stream_options
    return Prepared(
        prompt=part.prompt,
        params=params,
        stream=bool(request.stream),
        include_usage=bool(options and options.include_usage),
        continuous_usage=bool(options and options.include_usage and options.continuous_usage_stats),
        n=n,
        grammar=grammar,
        echo=part.echo,
        tier=request.priority,
        cache_salt=request.cache_salt,
    )


def _check_stop_ids(stop_ids: tuple[int, ...], vocab: int) -> None:
    bad_stop = [t for t in stop_ids if not 0 <= t < vocab]
    if bad_stop:
        raise ApiError(
            400, f"stop token id {bad_stop[0]} is outside the vocabulary", param="stop_token_ids"
        )


def _chat_part(request: ChatRequest, tokenizer: Tokenizer) -> _PromptPart:
    if not request.messages:
        raise ApiError(400, "messages must not be empty", param="messages")
    try:
        prompt = tokenizer.chat_prompt(_chat_messages(request.messages))
    except TokenizerError as exc:
        raise ApiError(400, str(exc), param="messages") from None
    return _PromptPart(
        prompt,
        request.max_completion_tokens or request.max_tokens,
        bool(request.logprobs),
        request.top_logprobs or 0,
    )


def _completion_part(request: CompletionRequest, tokenizer: Tokenizer, vocab: int) -> _PromptPart:
    if isinstance(request.prompt, str):
        if not request.prompt:
            raise ApiError(400, "the prompt is empty", param="prompt")
        prompt = tokenizer.encode(request.prompt)
    else:
        prompt = _token_prompt(request.prompt, vocab)
    echo = None
    if request.echo:
        echo = (
            request.prompt
            if isinstance(request.prompt, str)
            else tokenizer.decode(prompt, skip_special=False)
        )
    want_logprobs = request.logprobs is not None
    top_logprobs = request.logprobs or 0
    return _PromptPart(
        prompt,
        16 if request.max_tokens is None else request.max_tokens,
        want_logprobs,
        top_logprobs,
        echo,
        # The prompt's own logprobs, before the output's.
        top_logprobs if request.echo and want_logprobs else None,
    )


def _max_tokens(request: _Common, part: _PromptPart, vocab: int, max_model_len: int) -> int:
    """The prompt fits the context, and so does what max_tokens asks for."""
    prompt = part.prompt
    problem = prompt_problem(prompt, vocab, max_model_len)
    if problem is not None:
        raise ApiError(
            problem.status,
            str(problem),
            param="messages" if isinstance(request, ChatRequest) else "prompt",
            code=problem.code,
        )
    room = max_model_len - len(prompt)
    if part.max_tokens is None:
        return room
    if part.max_tokens > room:
        raise ApiError(
            400,
            f"this model's context is {max_model_len} tokens; the prompt has {len(prompt)} "
            f"and max_tokens asks for {part.max_tokens} more",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return part.max_tokens


def _temperature(request: _Common) -> float:
    temperature = 1.0 if request.temperature is None else request.temperature
    if 0 < temperature < MIN_TEMPERATURE:
        raise ApiError(
            400,
            f"temperature must be 0 (greedy) or {MIN_TEMPERATURE:g} to {MAX_TEMPERATURE:g}",
            param="temperature",
        )
    return temperature


def _top_k(request: _Common, vocab: int) -> int:
    top_k = max(0, request.top_k or 0)
    if top_k > vocab:
        raise ApiError(400, f"top_k must be at most the vocabulary size {vocab}", param="top_k")
    return top_k


def _min_tokens(request: _Common, grammar: Grammar | None, max_tokens: int) -> int:
    min_tokens = request.min_tokens or 0
    if min_tokens and grammar is not None:
        raise ApiError(
            400,
            "min_tokens cannot be combined with a structured output format "
            "(the format decides where the output ends)",
            param="min_tokens",
        )
    if min_tokens > max_tokens:
        raise ApiError(
            400,
            f"min_tokens ({min_tokens}) must not exceed max_tokens ({max_tokens})",
            param="min_tokens",
        )
    return min_tokens
