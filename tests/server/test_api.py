"""The OpenAI-compatible API, in-process: the real HTTP app over the real
runtime and scheduler on the simulated executor (tests/server/harness.py),
through the official openai client (on an ASGI transport, no socket) and the
app's test client."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
import trio

from tests.server.conftest import ALICE, BOB, CAROL
from tests.server.harness import MODEL, Served, serving, tokenizer

LONG_PROMPT = " ".join(f"word{i}" for i in range(40))  # several 16-token blocks


@pytest.fixture
async def served(tmp_path: Any) -> AsyncIterator[Served]:
    async with serving(tmp_path) as daemon:
        yield daemon


def client(served: Served, key: str = ALICE) -> openai.AsyncOpenAI:
    transport = httpx.ASGITransport(app=served.daemon.http_app)  # type: ignore[arg-type]
    return openai.AsyncOpenAI(
        base_url="http://kvd/v1",
        api_key=key,
        max_retries=0,
        http_client=httpx.AsyncClient(transport=transport, base_url="http://kvd"),  # type: ignore[arg-type]
    )


async def sse_chunks(response: Any) -> list[Any]:
    """A streamed reply's JSON chunks (the ``[DONE]`` line left out)."""
    lines = (await response.get_data()).decode().splitlines()
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


async def post(served: Served, path: str, body: Any, key: str | None = ALICE, **kw: Any) -> Any:
    response = await served.post(path, body, key, **kw)
    return response.status_code, await response.get_json(), response.headers


async def test_health_ready_models(served: Served) -> None:
    health = await served.http.get("/health")
    assert await health.get_json() == {"status": "ok"}
    assert (await served.http.get("/ready")).status_code == 200
    oai = client(served)
    models = await oai.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert (await oai.models.retrieve(MODEL)).id == MODEL
    missing = await served.http.get(
        "/v1/models/gpt-4", headers={"Authorization": f"Bearer {ALICE}"}
    )
    assert missing.status_code == 404
    assert (await served.http.get("/nowhere")).status_code == 404
    assert (await served.http.get("/v1/completions")).status_code == 405


async def text_of_stream(stream: Any, chat: bool = False) -> tuple[str, list[Any]]:
    chunks = [chunk async for chunk in stream]
    if chat:
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        text = "".join(c.choices[0].text for c in chunks if c.choices)
    return text, chunks


# openai's AsyncStream leaves its inner async generators unexhausted after
# [DONE]; trio reports each one when it is collected. That is the client's
# wart, not the server's.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


async def test_completion_and_stream_agree(served: Served) -> None:
    oai = client(served)
    whole = await oai.completions.create(
        model=MODEL, prompt="Hello there", max_tokens=12, temperature=0
    )
    choice = whole.choices[0]
    assert choice.finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens == 12
    assert whole.usage.prompt_tokens == 3
    text, chunks = await text_of_stream(
        await oai.completions.create(
            model=MODEL,
            prompt="Hello there",
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert text == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    await served.assert_whole()


async def test_chat_and_stream_agree(served: Served) -> None:
    oai = client(served, BOB)
    messages: Any = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a colour."},
    ]
    whole = await oai.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0
    )
    assert whole.choices[0].message.role == "assistant"
    text, chunks = await text_of_stream(
        await oai.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True
        ),
        chat=True,
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


async def test_concurrent_streams_match_their_whole_answers(served: Served) -> None:
    oai = client(served)
    results = ["", "", ""]

    async def one(i: int) -> None:
        results[i], _ = await text_of_stream(
            await oai.completions.create(
                model=MODEL, prompt=f"Count {i}", max_tokens=8, temperature=0, stream=True
            )
        )

    async with trio.open_nursery() as nursery:
        for i in range(3):
            nursery.start_soon(one, i)
    for i, text in enumerate(results):
        whole = await oai.completions.create(
            model=MODEL, prompt=f"Count {i}", max_tokens=8, temperature=0
        )
        assert text == whole.choices[0].text
    await served.assert_whole()


async def test_cached_tokens_per_tenant(served: Served) -> None:
    async def cached(key: str) -> int:
        result = await client(served, key).completions.create(
            model=MODEL, prompt=LONG_PROMPT, max_tokens=2, temperature=0
        )
        assert result.usage is not None and result.usage.prompt_tokens_details is not None
        return result.usage.prompt_tokens_details.cached_tokens or 0

    first = await cached(ALICE)
    again = await cached(ALICE)
    other = await cached(BOB)  # public policy: only operator prefixes are shared
    assert first == 0
    assert again >= 16 and again % 16 == 0
    assert other == 0
    assert await cached(BOB) >= 16  # bob's own repeat does hit


async def test_stop_strings(served: Served) -> None:
    oai = client(served)
    base = await oai.completions.create(
        model=MODEL, prompt="Hello there", max_tokens=16, temperature=0
    )
    text = base.choices[0].text
    assert len(text) >= 8, text
    stop = text[4:7]
    cut = text[: text.find(stop)]
    stopped = await oai.completions.create(
        model=MODEL, prompt="Hello there", max_tokens=16, temperature=0, stop=[stop, "\x00\x01"]
    )
    assert stopped.choices[0].text == cut
    assert stopped.choices[0].finish_reason == "stop"
    streamed, chunks = await text_of_stream(
        await oai.completions.create(
            model=MODEL, prompt="Hello there", max_tokens=16, temperature=0, stop=stop, stream=True
        )
    )
    assert streamed == cut
    assert chunks[-1].choices[0].finish_reason == "stop"
    await served.assert_whole()  # the stop string cancelled the rest


async def test_echo_puts_the_prompt_before_each_choice(served: Served) -> None:
    """echo: the prompt as sent (a string verbatim, token ids decoded) before
    the completion, whole and streamed; usage counts the completion alone."""
    oai = client(served)
    common: dict[str, Any] = {"model": MODEL, "max_tokens": 5, "temperature": 0}
    plain = await oai.completions.create(**common, prompt=LONG_PROMPT)
    echoed = await oai.completions.create(**common, prompt=LONG_PROMPT, echo=True, n=2)
    assert [c.text for c in echoed.choices] == [LONG_PROMPT + plain.choices[0].text] * 2
    assert echoed.usage is not None and plain.usage is not None
    assert echoed.usage.prompt_tokens == plain.usage.prompt_tokens  # the echo is not counted
    assert echoed.usage.completion_tokens == 2 * plain.usage.completion_tokens
    ids = [2, 818, 5279, 529]  # "The capital of" after BOS
    by_ids = await oai.completions.create(**common, prompt=ids, echo=True)
    words = tokenizer().decode(ids, skip_special=False)
    assert by_ids.choices[0].text.startswith(words) and words.endswith("The capital of")
    stream = await oai.completions.create(**common, prompt=LONG_PROMPT, echo=True, stream=True)
    texts = [chunk.choices[0].text async for chunk in stream]
    assert texts[0] == LONG_PROMPT and "".join(texts) == echoed.choices[0].text
    await served.assert_whole()


async def test_streamed_text_with_unicode_line_breaks_stays_one_event_a_line(
    served: Served,
) -> None:
    """U+2028, U+2029 and U+0085 are legal raw in JSON, but a client that
    splits the event stream the way ``str.splitlines`` does (httpx's own
    ``aiter_lines``) would cut an event holding one: they are sent escaped,
    and every line parses to the same text."""
    prompt = "one\u2028two\u2029three\x85four " + LONG_PROMPT
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0, "echo": True}
    transport = httpx.ASGITransport(app=served.daemon.http_app)  # type: ignore[arg-type]
    headers = {"Authorization": f"Bearer {ALICE}"}
    async with httpx.AsyncClient(transport=transport, base_url="http://kvd") as http:
        whole = (await http.post("/v1/completions", json=body, headers=headers)).json()
        async with http.stream(
            "POST", "/v1/completions", json=body | {"stream": True}, headers=headers
        ) as response:
            lines = [line async for line in response.aiter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert chunks[0]["choices"][0]["text"] == prompt
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    await served.assert_whole()


async def test_echo_with_logprobs_gives_the_prompts_own(served: Served) -> None:
    """echo with logprobs: the prompt's tokens come first in the logprobs, the
    first with none, each other with the executor's score of it and its
    alternatives; then the output's, offsets running on through the text;
    every choice the same; streamed as the echo chunk; a prompt already in
    the prefix cache is computed whole again (its logprobs need its logits);
    the pool whole after."""
    oai = client(served)
    common: dict[str, Any] = {"model": MODEL, "max_tokens": 3, "temperature": 0}
    prompt = tokenizer().encode(LONG_PROMPT)
    await oai.completions.create(**common, prompt=LONG_PROMPT)  # now in the prefix cache
    reply = await oai.completions.create(**common, prompt=LONG_PROMPT, echo=True, logprobs=2, n=2)
    assert reply.usage is not None and reply.usage.prompt_tokens == len(prompt)
    details = reply.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens == 0
    for choice in reply.choices:
        logprobs = choice.logprobs
        assert logprobs is not None and logprobs.token_logprobs is not None
        assert logprobs.tokens is not None and logprobs.top_logprobs is not None
        assert len(logprobs.tokens) == len(prompt) + 3
        pieces = [tokenizer().decode([t], skip_special=False) for t in prompt]
        assert logprobs.tokens[: len(prompt)] == pieces
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        assert logprobs.token_logprobs[1 : len(prompt)] == [-0.25] * (len(prompt) - 1)
        for piece, top in zip(pieces[1:], logprobs.top_logprobs[1 : len(prompt)], strict=True):
            assert top is not None and len(top) == 2 and top[piece] == -0.25
        offsets = logprobs.text_offset
        assert offsets is not None and offsets[0] == 0
        assert offsets[len(prompt)] == len(LONG_PROMPT)  # the output's, after the echo
        assert choice.text.startswith(LONG_PROMPT)
    assert reply.choices[0].logprobs == reply.choices[1].logprobs
    stream = await oai.completions.create(
        **common, prompt=LONG_PROMPT, echo=True, logprobs=0, stream=True
    )
    chunks = [chunk.choices[0] async for chunk in stream]
    first = chunks[0].logprobs
    assert chunks[0].text == LONG_PROMPT and first is not None
    assert first.token_logprobs == [None] + [-0.25] * (len(prompt) - 1)
    assert first.top_logprobs is None
    streamed = [lp for c in chunks if c.logprobs for lp in c.logprobs.token_logprobs or []]
    assert len(streamed) == len(prompt) + 3
    await served.assert_whole()


async def test_n_choices(served: Served) -> None:
    """n choices in OpenAI's shapes: greedy ones equal n = 1's, seeded ones
    reproducible and distinct, streamed with their index (each finishing
    once), the prompt counted once in usage; a stop string ends its own
    choice alone; chat too; the pool whole after."""
    oai = client(served)
    common: dict[str, Any] = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 6}
    common["extra_body"] = {"ignore_eos": True}
    one = await oai.completions.create(**common, temperature=0)
    many = await oai.completions.create(**common, temperature=0, n=3, best_of=3)
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert [c.text for c in many.choices] == [one.choices[0].text] * 3
    assert many.usage is not None and one.usage is not None
    assert many.usage.prompt_tokens == one.usage.prompt_tokens
    assert many.usage.completion_tokens == 3 * one.usage.completion_tokens
    seeded = [
        await oai.completions.create(**common, temperature=1.0, seed=11, n=3) for _ in range(2)
    ]
    texts = [[c.text for c in reply.choices] for reply in seeded]
    assert texts[0] == texts[1] and len(set(texts[0])) == 3
    stream = await oai.completions.create(
        **common,
        temperature=1.0,
        seed=11,
        n=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts: dict[int, str] = {0: "", 1: "", 2: ""}
    finishes: list[int] = []
    usage = None
    async for chunk in stream:
        for choice in chunk.choices:
            parts[choice.index] += choice.text
            if choice.finish_reason is not None:
                finishes.append(choice.index)
        usage = chunk.usage or usage
    assert [parts[i] for i in range(3)] == texts[0]
    assert sorted(finishes) == [0, 1, 2]
    assert usage is not None and usage.prompt_tokens == one.usage.prompt_tokens
    # A stop string found in one choice's text ends that choice only.
    stop = texts[0][1][2:5]
    assert stop not in texts[0][0] and stop not in texts[0][2]
    stopped = await oai.completions.create(**common, temperature=1.0, seed=11, n=3, stop=[stop])
    assert [c.finish_reason for c in stopped.choices] == ["length", "stop", "length"]
    assert stopped.choices[1].text == texts[0][1][: texts[0][1].find(stop)]
    assert [stopped.choices[i].text for i in (0, 2)] == [texts[0][0], texts[0][2]]
    chat = await oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=4,
        temperature=0,
        n=2,
    )
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content
    await served.assert_whole()


async def test_sampling_extensions_and_logprobs(served: Served) -> None:
    oai = client(served)

    async def sample(seed: int) -> str:
        result = await oai.completions.create(
            model=MODEL,
            prompt="Once",
            max_tokens=12,
            temperature=1.0,
            top_p=0.9,
            seed=seed,
            extra_body={"top_k": 50},
        )
        return result.choices[0].text

    assert await sample(7) == await sample(7)
    assert len({await sample(7), await sample(8), await sample(9)}) > 1
    result = await oai.completions.create(
        model=MODEL, prompt="Once", max_tokens=5, temperature=0, logprobs=0
    )
    logprobs = result.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None
    assert len(logprobs.token_logprobs) == 5
    assert all(value <= 0 for value in logprobs.token_logprobs)
    assert logprobs.text_offset is not None and logprobs.text_offset[0] == 0
    chat = await oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 4
    status, _, _ = await post(
        served,
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "max_tokens": 3, "logprobs": 0, "stream": True},
    )
    assert status == 200
    # Alternatives: OpenAI's shapes, as many as asked, the chosen token's
    # value among them (the simulated model's best is what greedy picks).
    result = await oai.completions.create(
        model=MODEL, prompt="Once", max_tokens=4, temperature=0, logprobs=3
    )
    logprobs = result.choices[0].logprobs
    assert logprobs is not None and logprobs.top_logprobs is not None
    assert len(logprobs.top_logprobs) == 4
    for token, value, top in zip(
        logprobs.tokens or [], logprobs.token_logprobs or [], logprobs.top_logprobs, strict=True
    ):
        assert 1 <= len(top) <= 3 and top[token] == value == max(top.values())
    chat = await oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 3
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
    response = await served.post(
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3,
            "logprobs": True,
            "top_logprobs": 4,
            "stream": True,
        },
    )
    chunks = await sse_chunks(response)
    streamed = [
        entry
        for chunk in chunks
        for choice in chunk["choices"]
        for entry in (choice["logprobs"] or {}).get("content") or []
    ]
    assert len(streamed) == 3 and all(len(e["top_logprobs"]) == 4 for e in streamed)


async def test_the_benchmark_tools_extensions(served: Served) -> None:
    """What guidellm, inference-perf, aiperf and `vllm bench serve` send:
    ignore_eos, and usage in every chunk (vLLM's continuous_usage_stats), with
    min_tokens, min_p, logit_bias and the penalties beside them."""
    body = {
        "model": MODEL,
        "prompt": LONG_PROMPT,
        "max_tokens": 9,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "ignore_eos": True,
        "min_tokens": 9,
        "min_p": 0.1,
        "temperature": 0.8,
        "logit_bias": {"17": 2.5, "9259": -100},
        "presence_penalty": 0.5,
        "frequency_penalty": -0.25,
        "repetition_penalty": 1.2,
    }
    response = await served.post("/v1/completions", body)
    assert response.status_code == 200
    chunks = await sse_chunks(response)
    usages = [chunk["usage"] for chunk in chunks]
    assert all(u is not None for u in usages), usages
    prompt_tokens = usages[0]["prompt_tokens"]
    completion = [u["completion_tokens"] for u in usages]
    assert completion == sorted(completion) and completion[-1] == 9
    assert all(u["prompt_tokens"] == prompt_tokens for u in usages)
    assert all(u["total_tokens"] == prompt_tokens + u["completion_tokens"] for u in usages)
    assert chunks[-1]["choices"] == [] and chunks[-2]["choices"][0]["finish_reason"] == "length"
    # Without continuous_usage_stats, usage comes once, at the end, as before.
    body["stream_options"] = {"include_usage": True}
    response = await served.post("/v1/completions", body)
    chunks = await sse_chunks(response)
    assert [c["usage"] is None for c in chunks] == [True] * (len(chunks) - 1) + [False]
    await served.assert_whole()


async def test_token_prompt_and_request_id(served: Served) -> None:
    status, body, headers = await post(
        served,
        "/v1/completions",
        {"model": MODEL, "prompt": [2, 9259, 1304], "max_tokens": 3, "temperature": 0},
        headers={"X-Request-Id": "trace-123"},
    )
    assert status == 200, body
    assert headers["X-Request-Id"] == "trace-123"
    assert body["usage"]["prompt_tokens"] == 3
    # An id a log line could not carry safely is replaced by the server's own.
    _, _, headers = await post(
        served, "/v1/completions", {"model": MODEL, "prompt": "x"}, headers={"X-Request-Id": "a b"}
    )
    assert headers["X-Request-Id"] != "a b" and len(headers["X-Request-Id"]) == 32


BAD_BODIES: list[tuple[str, bytes | dict[str, Any], int, str | None]] = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"", 400, None),
    ("/v1/completions", b'{"model": "random", "prompt": "\xff\xfe"}', 400, None),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 10**30}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "seed": 2**70}, 400, "seed"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokenz": 5}, 400, "max_tokenz"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 17}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 3, "best_of": 4}, 400, "best_of"),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "echo": True, "logprobs": 21},
        400,
        "logprobs",
    ),
    ("/v1/completions", {"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 2, 262144]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, -3]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 2.5]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "stop_token_ids": [10**9]},
        400,
        "stop_token_ids",
    ),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "priority": 9}, 400, "priority"),
    ("/v1/completions", {"prompt": "x"}, 400, None),
    ("/v1/completions", [1, 2], 400, None),  # type: ignore[list-item]
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]},
        400,
        "messages",
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user"}], "tools": [{}]},
        400,
        "tools",
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "messages[0].content",
    ),
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
    ("/v1/completions", {"model": MODEL, "prompt": "word " * 300}, 413, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 300}, 400, "max_tokens"),
    ("/v1/completions", b"x" * (65 * 1024), 413, None),
    # Depth and count limits: refused before the decoder recurses or allocates.
    (
        "/v1/completions",
        b'{"model": "random", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
        400,
        "prompt",
    ),
    (
        "/v1/chat/completions",
        b'{"model": "random", "messages": [{"role": "user", "content": "x"}], "tool_choice": '
        + b'{"a": ' * 5000
        + b"1"
        + b"}" * 5000
        + b"}",
        400,
        "tool_choice",
    ),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": ["a"] * 17}, 400, "stop"),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "logit_bias": {"9": 101}},
        400,
        "logit_bias",
    ),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "logit_bias": {"262144": 1}},
        400,
        "logit_bias",
    ),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"a": 1}}, 400, "logit_bias"),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "max_tokens": 4, "min_tokens": 5},
        400,
        "min_tokens",
    ),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "min_tokens": -1}, 400, "min_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "min_p": 1.5}, 400, "min_p"),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "presence_penalty": 2.5},
        400,
        "presence_penalty",
    ),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "frequency_penalty": -3},
        400,
        "frequency_penalty",
    ),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "repetition_penalty": 0},
        400,
        "repetition_penalty",
    ),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 21}, 400, "logprobs"),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        400,
        "top_logprobs",
    ),
    (
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "x"}],
            "logprobs": True,
            "top_logprobs": 21,
        },
        400,
        "top_logprobs",
    ),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "ignore_eos": "yes"}, 400, "ignore_eos"),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "stream": True, "stream_options": {"usage": True}},
        400,
        "stream_options.usage",
    ),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "logit_bias": {str(i): 1 for i in range(301)}},
        400,
        "logit_bias",
    ),
    (
        "/v1/chat/completions",
        b'{"model":"random","messages":['
        + b",".join([b'{"role":"user","content":""}'] * 2049)
        + b"]}",
        400,
        "messages",
    ),
    # Sampling parameters the engine cannot represent exactly in float32.
    (
        "/v1/completions",
        b'{"model": "random", "prompt": "x", "temperature": 1e39}',
        400,
        "temperature",
    ),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": 1e308}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": 1e-9}, 400, "temperature"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_BODIES)
async def test_bad_input_is_a_clear_4xx(
    served: Served,
    path: str,
    body: bytes | dict[str, Any],
    status: int,
    param: str | None,
) -> None:
    code, reply, _ = await post(served, path, body)
    assert code == status, reply
    error = reply["error"]
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param, error
    await served.assert_whole()


async def test_authentication(served: Served) -> None:
    body = {"model": MODEL, "prompt": "x"}
    status, missing, _ = await post(served, "/v1/completions", body, key=None)
    assert status == 401 and "missing" in missing["error"]["message"]
    status, wrong, _ = await post(served, "/v1/completions", body, key="kvd-dev-mallory")
    assert status == 401 and wrong["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        await client(served, "nope").models.list()


async def test_tier_and_rate_limit(served: Served) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1, "priority": "interactive"}
    status, above, _ = await post(served, "/v1/completions", body, key=CAROL)
    assert status == 403, above  # carol's tier is batch
    assert above["error"]["code"] == "tier_not_allowed"
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    replies = [await post(served, "/v1/completions", body, key=CAROL) for _ in range(3)]
    assert [status for status, _, _ in replies] == [200, 200, 429]
    _, limited, headers = replies[-1]
    assert int(headers["Retry-After"]) >= 1
    assert limited["error"]["code"] == "rate_limited"
    assert "alice" not in json.dumps(limited) and "bob" not in json.dumps(limited)
    assert (await post(served, "/v1/completions", body, key=ALICE))[0] == 200
    assert served.named("tenant.rate_limited")[-1]["tenant"] == "carol"


async def test_metrics_and_logs(served: Served) -> None:
    await client(served).completions.create(model=MODEL, prompt="Hello there", max_tokens=3)
    await served.assert_whole()
    metrics = await served.metrics()
    assert metrics['kvd_tenant_completion_tokens_total{tenant="alice"}'] > 0
    assert metrics["kvd_pool_capacity_pages"] > 0
    assert metrics['kvd_time_to_first_token_seconds_count{tenant="alice"}'] >= 1
    assert metrics["kvd_measured_prefill_tokens_per_second"] > 0
    assert metrics['kvd_requests_total{outcome="length",tenant="alice"}'] == 1
    assert metrics['kvd_http_requests_total{route="/v1/completions",status="200"}'] == 1
    # The model-server protocol gateways read: vLLM's names, types and labels.
    vllm = f'{{engine="0",model_name="{MODEL}"}}'
    assert metrics[f"vllm:num_requests_running{vllm}"] == 0
    assert metrics[f"vllm:num_requests_waiting{vllm}"] == 0
    assert metrics[f"vllm:kv_cache_usage_perc{vllm}"] == 0.0  # nothing held after
    assert metrics[f"vllm:gpu_cache_usage_perc{vllm}"] == 0.0
    assert metrics[f"vllm:prefix_cache_queries_total{vllm}"] >= 2  # "Hello there" and BOS
    assert metrics[f"vllm:prefix_cache_hits_total{vllm}"] >= 0
    assert metrics[f"vllm:time_to_first_token_seconds_count{vllm}"] == 1
    assert metrics[f"vllm:inter_token_latency_seconds_count{vllm}"] == 2
    info = [k for k in metrics if k.startswith("vllm:cache_config_info{")]
    assert len(info) == 1 and metrics[info[0]] == 1
    capacity = metrics["kvd_pool_capacity_pages"]
    assert 'block_size="16"' in info[0] and 'enable_prefix_caching="True"' in info[0]
    blocks = int(info[0].split('num_gpu_blocks="')[1].split('"')[0])
    assert 0 < blocks <= capacity
    finish = served.named("request.finish")[-1]
    assert {"request_id", "tenant", "outcome", "ttft_s", "cached_tokens"} <= set(finish)
    assert served.named("request.accepted") and served.named("request.start")
    # No prompt or completion text in the logs by default.
    assert not any("Hello there" in json.dumps(e, default=str) for e in served.logs)


async def test_prompts_are_logged_only_when_asked(tmp_path: Any) -> None:
    from tests.server.conftest import write_config

    path = write_config(tmp_path / "kvd.toml")
    path.write_text(path.read_text().replace("[server]", "[server]\nlog_prompts = true"))
    async with serving(tmp_path, config_path=path) as served:
        assert (await served.complete(prompt="Hello there")).status_code == 200
        accepted = served.named("request.accepted")[-1]
        assert accepted["prompt"] == "Hello there"
        assert "completion" in served.named("request.finish")[-1]


async def test_metrics_are_not_on_the_tenant_port(served: Served) -> None:
    from kvd.server.http import create_metrics_app

    assert (await served.http.get("/metrics")).status_code == 404
    metrics_app = create_metrics_app(served.daemon.context.metrics)
    scraped = await metrics_app.test_client().get("/metrics")
    assert scraped.status_code == 200 and b"kvd_pool_pages" in await scraped.get_data()


async def test_nulls_mean_defaults_and_top_k_is_bounded(served: Served) -> None:
    body = {
        "model": MODEL,
        "prompt": "nulls",
        "max_tokens": 2,
        "temperature": None,
        "top_p": None,
        "n": None,
        "stream": None,
        "logprobs": None,
        "presence_penalty": None,
    }
    assert (await post(served, "/v1/completions", body))[0] == 200
    status, huge, _ = await post(
        served, "/v1/completions", {"model": MODEL, "prompt": "x", "top_k": 2**40}
    )
    assert status == 400 and huge["error"]["param"] == "top_k"
    status, over, _ = await post(
        served, "/v1/completions", {"model": MODEL, "prompt": "x", "top_k": 10**6}
    )
    assert status == 400 and over["error"]["param"] == "top_k"
    wide = {"model": MODEL, "prompt": "x", "top_k": 5000, "top_p": 0.99, "max_tokens": 3}
    assert (await post(served, "/v1/completions", wide))[0] == 200


async def test_developer_role_is_a_system_message(served: Served) -> None:
    """OpenAI's current name for the system role: the same prompt as system."""

    async def prompt_tokens(role: str) -> int:
        reply = await client(served).chat.completions.create(
            model=MODEL,
            messages=[
                {"role": role, "content": "Answer in one word."},  # type: ignore[misc,list-item]
                {"role": "user", "content": "Colour of the sky?"},
            ],
            max_tokens=1,
        )
        assert reply.usage is not None
        return reply.usage.prompt_tokens

    assert await prompt_tokens("developer") == await prompt_tokens("system")
