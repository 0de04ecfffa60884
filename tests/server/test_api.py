"""The OpenAI-compatible API of a real daemon (tiny random model), through the
official openai client (sync and async) and raw HTTP."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import trio

from tests.server.conftest import ALICE, BOB, CAROL, DaemonProcess

MODEL = "random"
LONG_PROMPT = " ".join(f"word{i}" for i in range(40))  # several 16-token blocks


_CLIENTS: dict[tuple[str, str], openai.OpenAI] = {}


def client(daemon: DaemonProcess, key: str = ALICE) -> openai.OpenAI:
    """One client per key, closed with the module (their pools hold sockets)."""
    made = _CLIENTS.get((daemon.url, key))
    if made is None:
        made = openai.OpenAI(base_url=f"{daemon.url}/v1", api_key=key, max_retries=0)
        _CLIENTS[(daemon.url, key)] = made
    return made


@pytest.fixture(scope="module", autouse=True)
def _close_clients() -> Iterator[None]:
    yield
    for made in _CLIENTS.values():
        made.close()
    _CLIENTS.clear()


def post(daemon: DaemonProcess, path: str, body: Any, key: str | None = ALICE, **kw: Any):
    headers = kw.pop("headers", {})
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{daemon.url}{path}", content=content, headers=headers, timeout=60, **kw)


def test_health_ready_models(tiny_daemon: DaemonProcess) -> None:
    assert httpx.get(f"{tiny_daemon.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{tiny_daemon.url}/ready").status_code == 200
    models = client(tiny_daemon).models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client(tiny_daemon).models.retrieve(MODEL).id == MODEL


def test_completion_and_stream_agree(tiny_daemon: DaemonProcess) -> None:
    oai = client(tiny_daemon)
    whole = oai.completions.create(model=MODEL, prompt="Hello there", max_tokens=12, temperature=0)
    choice = whole.choices[0]
    assert choice.finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens == 12
    assert whole.usage.prompt_tokens == 3
    chunks = list(
        oai.completions.create(
            model=MODEL,
            prompt="Hello there",
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12


def test_chat_and_stream_agree(tiny_daemon: DaemonProcess) -> None:
    oai = client(tiny_daemon, BOB)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a colour."},
    ]
    whole = oai.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0
    )
    assert whole.choices[0].message.role == "assistant"
    stream = oai.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


# openai's AsyncStream leaves its inner async generators unexhausted after
# [DONE]; trio reports each one when it is collected. That is the client's
# wart, not the server's.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_async_client_under_trio(tiny_daemon: DaemonProcess) -> None:
    async def main() -> list[str]:
        oai = openai.AsyncOpenAI(base_url=f"{tiny_daemon.url}/v1", api_key=ALICE, max_retries=0)
        results: list[str] = ["", "", ""]

        async def one(i: int) -> None:
            stream = await oai.completions.create(
                model=MODEL, prompt=f"Count {i}", max_tokens=8, temperature=0, stream=True
            )
            async with stream:
                async for chunk in stream:
                    results[i] += chunk.choices[0].text

        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(one, i)
        await oai.close()
        return results

    streamed = trio.run(main)
    oai = client(tiny_daemon)
    for i, text in enumerate(streamed):
        whole = oai.completions.create(
            model=MODEL, prompt=f"Count {i}", max_tokens=8, temperature=0
        )
        assert text == whole.choices[0].text


def test_cached_tokens_per_tenant(tiny_daemon: DaemonProcess) -> None:
    def cached(key: str) -> int:
        result = client(tiny_daemon, key).completions.create(
            model=MODEL, prompt=LONG_PROMPT, max_tokens=2, temperature=0
        )
        assert result.usage is not None and result.usage.prompt_tokens_details is not None
        return result.usage.prompt_tokens_details.cached_tokens or 0

    first = cached(ALICE)
    again = cached(ALICE)
    other = cached(BOB)  # public policy: only operator prefixes are shared
    assert first == 0
    assert again >= 16 and again % 16 == 0
    assert other == 0
    assert cached(BOB) >= 16  # bob's own repeat does hit


def test_stop_strings(tiny_daemon: DaemonProcess) -> None:
    oai = client(tiny_daemon)
    base = oai.completions.create(model=MODEL, prompt="Hello there", max_tokens=16, temperature=0)
    text = base.choices[0].text
    assert len(text) >= 8, text
    stop = text[4:7]
    cut = text[: text.find(stop)]
    stopped = oai.completions.create(
        model=MODEL, prompt="Hello there", max_tokens=16, temperature=0, stop=[stop, "\x00\x01"]
    )
    assert stopped.choices[0].text == cut
    assert stopped.choices[0].finish_reason == "stop"
    streamed = oai.completions.create(
        model=MODEL, prompt="Hello there", max_tokens=16, temperature=0, stop=stop, stream=True
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_sampling_extensions_and_logprobs(tiny_daemon: DaemonProcess) -> None:
    oai = client(tiny_daemon)

    def sample(seed: int) -> str:
        result = oai.completions.create(
            model=MODEL,
            prompt="Once",
            max_tokens=12,
            temperature=1.0,
            top_p=0.9,
            seed=seed,
            extra_body={"top_k": 50},
        )
        return result.choices[0].text

    assert sample(7) == sample(7)
    assert len({sample(7), sample(8), sample(9)}) > 1
    result = oai.completions.create(
        model=MODEL, prompt="Once", max_tokens=5, temperature=0, logprobs=0
    )
    logprobs = result.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None
    assert len(logprobs.token_logprobs) == 5
    assert all(value <= 0 for value in logprobs.token_logprobs)
    chat = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 4


def test_token_prompt_and_request_id(tiny_daemon: DaemonProcess) -> None:
    response = post(
        tiny_daemon,
        "/v1/completions",
        {"model": MODEL, "prompt": [2, 9259, 1304], "max_tokens": 3, "temperature": 0},
        headers={"X-Request-Id": "trace-123"},
    )
    assert response.status_code == 200, response.text
    assert response.headers["X-Request-Id"] == "trace-123"
    assert response.json()["usage"]["prompt_tokens"] == 3


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
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 2}, 400, "n"),
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
    ("/v1/completions", [1, 2], 400, None),
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
def test_bad_input_is_a_clear_4xx(
    tiny_daemon: DaemonProcess,
    path: str,
    body: bytes | dict[str, Any],
    status: int,
    param: str | None,
) -> None:
    response = post(tiny_daemon, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param, error


def test_authentication(tiny_daemon: DaemonProcess) -> None:
    body = {"model": MODEL, "prompt": "x"}
    missing = post(tiny_daemon, "/v1/completions", body, key=None)
    assert missing.status_code == 401 and "missing" in missing.json()["error"]["message"]
    wrong = post(tiny_daemon, "/v1/completions", body, key="kvd-dev-mallory")
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        client(tiny_daemon, "nope").models.list()


def test_tier_and_rate_limit(tiny_daemon: DaemonProcess) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1, "priority": "interactive"}
    above = post(tiny_daemon, "/v1/completions", body, key=CAROL)
    assert above.status_code == 403, above.text  # carol's tier is batch
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    statuses = [post(tiny_daemon, "/v1/completions", body, key=CAROL) for _ in range(3)]
    assert [r.status_code for r in statuses] == [200, 200, 429]
    limited = statuses[-1]
    assert int(limited.headers["Retry-After"]) >= 1
    assert limited.json()["error"]["code"] == "rate_limited"
    assert "alice" not in limited.text and "bob" not in limited.text
    assert post(tiny_daemon, "/v1/completions", body, key=ALICE).status_code == 200
    assert tiny_daemon.wait_for("tenant.rate_limited")["tenant"] == "carol"


def test_metrics_and_logs(tiny_daemon: DaemonProcess) -> None:
    client(tiny_daemon).completions.create(model=MODEL, prompt="metrics", max_tokens=3)
    tiny_daemon.wait_pages_released()
    metrics = tiny_daemon.metrics()
    assert metrics['kvd_tenant_completion_tokens_total{tenant="alice"}'] > 0
    assert metrics["kvd_pool_capacity_pages"] > 0
    assert metrics['kvd_time_to_first_token_seconds_count{tenant="alice"}'] >= 1
    assert metrics["kvd_measured_prefill_tokens_per_second"] > 0
    finish = tiny_daemon.wait_for("request.finish")
    assert {"request_id", "tenant", "outcome", "ttft_s", "cached_tokens"} <= set(finish)
    # No prompt or completion text in the logs by default.
    assert not any("Hello there" in json.dumps(e) for e in tiny_daemon.events)


def test_metrics_are_not_on_the_tenant_port(tiny_daemon: DaemonProcess) -> None:
    assert httpx.get(f"{tiny_daemon.url}/metrics").status_code == 404
    assert httpx.get(f"{tiny_daemon.metrics_url}/metrics").status_code == 200


def test_nulls_mean_defaults_and_top_k_is_bounded(tiny_daemon: DaemonProcess) -> None:
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
    assert post(tiny_daemon, "/v1/completions", body).status_code == 200
    huge = post(tiny_daemon, "/v1/completions", {"model": MODEL, "prompt": "x", "top_k": 2**40})
    assert huge.status_code == 400 and huge.json()["error"]["param"] == "top_k"
    over = post(tiny_daemon, "/v1/completions", {"model": MODEL, "prompt": "x", "top_k": 10**6})
    assert over.status_code == 400 and over.json()["error"]["param"] == "top_k"
    # Beyond the 256 candidates top-k is still exact (a whole-vocabulary cut).
    wide = {"model": MODEL, "prompt": "x", "top_k": 5000, "top_p": 0.99, "max_tokens": 3}
    assert post(tiny_daemon, "/v1/completions", wide).status_code == 200


def test_developer_role_is_a_system_message(tiny_daemon: DaemonProcess) -> None:
    """OpenAI's current name for the system role: the same prompt as system."""

    def prompt_tokens(role: str) -> int:
        reply = client(tiny_daemon).chat.completions.create(
            model=MODEL,
            messages=[
                {"role": role, "content": "Answer in one word."},  # type: ignore[misc]
                {"role": "user", "content": "Colour of the sky?"},
            ],
            max_tokens=1,
        )
        assert reply.usage is not None
        return reply.usage.prompt_tokens

    assert prompt_tokens("developer") == prompt_tokens("system")


def test_a_tensor_parallel_daemon_answers_the_same(
    tiny_daemon: DaemonProcess, tmp_path: Any, daemon_env: dict[str, str]
) -> None:
    """`tensor_parallel = 2` on two simulated devices: the same greedy text."""
    from tests.server.conftest import write_config

    env = daemon_env | {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    sharded = DaemonProcess(write_config(tmp_path / "tp.toml", tensor_parallel=2), env)
    try:
        body = {"model": MODEL, "prompt": "Split me in two", "max_tokens": 12, "temperature": 0}
        expected = post(tiny_daemon, "/v1/completions", body).json()["choices"][0]["text"]
        got = post(sharded, "/v1/completions", body).json()["choices"][0]["text"]
        assert got == expected
        assert sharded.terminate() == 0
    finally:
        sharded.kill()


def test_no_pages_leak_after_all_of_the_above(tiny_daemon: DaemonProcess) -> None:
    tiny_daemon.wait_pages_released()
