"""The daemon on the real Gemma 3 270M: what a client receives over HTTP is
token for token what the in-process engine generates for the same prompt."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.server.conftest import ALICE, BOB, DaemonProcess, digest

CONFIG = f"""
[server]
listen = "127.0.0.1:0"
metrics_listen = "127.0.0.1:0"
admin_socket = "{tempfile.mkdtemp(prefix="kvd-", dir="/tmp")}/admin.sock"
drain_timeout = 5.0

[model]
source = "gemma3-270m"
max_model_len = 512
max_num_seqs = 4
max_num_batched_tokens = 64

[pool]
size = "64MiB"

[[tenants]]
name = "alice"
api_key_sha256 = "{digest(ALICE)}"

[[tenants]]
name = "bob"
api_key_sha256 = "{digest(BOB)}"
"""

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "東京は日本の"]
TOKENS = 24


@pytest.fixture(scope="module")
def real_daemon(
    tmp_path_factory: pytest.TempPathFactory, daemon_env: dict[str, str]
) -> Iterator[DaemonProcess]:
    path = tmp_path_factory.mktemp("kvd-real") / "kvd.toml"
    path.write_text(CONFIG)
    daemon = DaemonProcess(path, daemon_env, ready_timeout=600)
    yield daemon
    assert daemon.terminate() == 0, daemon.tail()


@pytest.fixture(scope="module")
def engine(kvd_cache: Path) -> Iterator[Any]:
    """The same engine configuration in-process (its programs come from the
    daemon's compilation cache)."""
    from kvd.engine.engine import Engine, EngineConfig
    from kvd.engine.loader import load_model

    old = os.environ.get("KVD_CACHE_DIR")
    os.environ["KVD_CACHE_DIR"] = str(kvd_cache)
    try:
        model = load_model("gemma3-270m", "float32")
        config = EngineConfig(
            max_model_len=512, max_num_seqs=4, max_num_batched_tokens=64, pool_tokens=4096
        )
        yield Engine(model, config)
    finally:
        if old is None:
            os.environ.pop("KVD_CACHE_DIR", None)
        else:
            os.environ["KVD_CACHE_DIR"] = old


def test_http_matches_the_engine(real_daemon: DaemonProcess, engine: Any) -> None:
    from kvd.engine.sampling import SamplingParams
    from kvd.engine.tokenizer import ChatMessage

    tokenizer = engine.model.tokenizer
    greedy = SamplingParams(temperature=0.0, max_tokens=TOKENS)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    chat = tokenizer.chat_prompt([ChatMessage("user", "Write a haiku about the sea.")])
    from kvd.sched.batch import BatchGenerator

    expected = BatchGenerator(engine).generate([*prompts, chat], [greedy] * (len(prompts) + 1))
    oai = openai.OpenAI(base_url=f"{real_daemon.url}/v1", api_key=ALICE, max_retries=0)
    with oai:
        check_completions(oai, tokenizer, expected)


def check_completions(oai: openai.OpenAI, tokenizer: Any, expected: list[Any]) -> None:
    for text, want in zip(PROMPTS, expected, strict=False):
        got = oai.completions.create(
            model="gemma3-270m", prompt=text, max_tokens=TOKENS, temperature=0
        )
        assert got.choices[0].text == tokenizer.decode(want.completion_ids)
        assert got.usage is not None and got.usage.completion_tokens == len(want.completion_ids)
        streamed = oai.completions.create(
            model="gemma3-270m", prompt=text, max_tokens=TOKENS, temperature=0, stream=True
        )
        assert "".join(c.choices[0].text for c in streamed) == got.choices[0].text
    reply = oai.chat.completions.create(
        model="gemma3-270m",
        messages=[{"role": "user", "content": "Write a haiku about the sea."}],
        max_tokens=TOKENS,
        temperature=0,
    )
    assert reply.choices[0].message.content == tokenizer.decode(expected[-1].completion_ids)
    assert reply.choices[0].finish_reason == expected[-1].finish_reason


def test_repeated_prompt_hits_the_cache_for_its_tenant_only(real_daemon: DaemonProcess) -> None:
    prompt = "Once upon a time, " * 20

    def cached(key: str) -> int:
        with openai.OpenAI(base_url=f"{real_daemon.url}/v1", api_key=key, max_retries=0) as oai:
            result = oai.completions.create(model="gemma3-270m", prompt=prompt, max_tokens=2)
        assert result.usage is not None and result.usage.prompt_tokens_details is not None
        return result.usage.prompt_tokens_details.cached_tokens or 0

    assert cached(ALICE) == 0
    assert cached(ALICE) >= 64
    assert cached(BOB) == 0
    real_daemon.wait_pages_released()
