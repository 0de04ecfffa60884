"""End to end on the real Gemma 3 270M (the embedded default): one daemon
on the shipped configuration, checked over HTTP token for token against
transformers loaded from the same GGUF file, and with the README's examples
word for word.

The daemon is the shipped ``etc/kvd.toml`` as an operator installs it (the
embedded 270M, its weights as int8 blocks by ``model.quantization``'s
"auto", ``pool.size = "auto"``), with only its addresses and paths
swapped for temporary ones. It is started first and compiles in its own
process while this one loads the oracle; every test of the module shares
the two. The last test checks that nothing the others sent made the daemon
compile after its warm-up.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvd.engine.batching import sliding_ring  # noqa: E402
from kvd.engine.loader import embedded_gguf_path, embedded_tokenizer  # noqa: E402
from kvd.engine.tokenizer import ChatMessage, StreamDecoder, Tokenizer  # noqa: E402
from kvd.kv.geometry import preset  # noqa: E402
from kvd.kv.layout import build_layout  # noqa: E402
from kvd.server.config import load_config  # noqa: E402
from tests.conftest import short_dir  # noqa: E402
from tests.server.conftest import ALICE, BOB, DaemonProcess, digest  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
README_URL = "http://127.0.0.1:8000"
MODEL = "gemma3-270m"

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "Les mathématiques sont",
    "1, 1, 2, 3, 5, 8, 13,",
    "The three primary colors are",
    "東京は日本の",
    "In 1969, the first humans to walk on the Moon were",
]
NEW_TOKENS = 32
HTTP_PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "東京は日本の"]
HTTP_TOKENS = 24
HAIKU = "Write a haiku about the sea."


def shipped_config(directory: Path) -> Path:
    text = (REPO / "etc" / "kvd.toml").read_text()
    # The demo keys are the shipped digests: no key needs swapping.
    assert digest(ALICE) in text and digest(BOB) in text
    socket_dir = short_dir()  # short: a socket path
    swaps = {
        '"127.0.0.1:8000"': '"127.0.0.1:0"',
        '"127.0.0.1:9464"': '"127.0.0.1:0"',
        '"/run/kvd/admin.sock"': f'"{socket_dir}/admin.sock"',
        '"/var/lib/kvd/state.json"': f'"{directory}/state.json"',
    }
    for old, new in swaps.items():
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    assert 'size = "auto"' in text
    path = directory / "kvd.toml"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def shipped_process(
    tmp_path_factory: pytest.TempPathFactory, daemon_env: dict[str, str]
) -> Iterator[DaemonProcess]:
    """Started, listening, maybe still compiling (``shipped`` waits for ready)."""
    config = shipped_config(tmp_path_factory.mktemp("kvd-shipped"))
    daemon = DaemonProcess(config, daemon_env, ready_timeout=900, wait_ready=False)
    yield daemon
    assert daemon.terminate() == 0, daemon.tail()


@pytest.fixture(scope="module")
def shipped(shipped_process: DaemonProcess) -> DaemonProcess:
    shipped_process.wait_for("lifecycle.ready", 900)
    return shipped_process


@pytest.fixture(scope="module")
def tokenizer(shipped_process: DaemonProcess) -> Tokenizer:
    """The embedded model's tokenizer (the daemon compiles meanwhile)."""
    return embedded_tokenizer()


@pytest.fixture(scope="module")
def oracle(tokenizer: Tokenizer) -> Any:
    gguf = embedded_gguf_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    return hf.eval()


@pytest.fixture(scope="module")
def hf_tokenizer(tokenizer: Tokenizer) -> Any:
    gguf = embedded_gguf_path()
    return transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def client(daemon: DaemonProcess, key: str = ALICE) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{daemon.url}/v1", api_key=key, max_retries=0)


def complete_all(daemon: DaemonProcess, prompts: list[Any], **body: Any) -> list[Any]:
    """Completions sent at once (the daemon batches them, ragged)."""
    with client(daemon) as oai, ThreadPoolExecutor(len(prompts)) as pool:
        return list(
            pool.map(lambda p: oai.completions.create(model=MODEL, prompt=p, **body), prompts)
        )


def hf_greedy(oracle: Any, prompt: list[int], new: int) -> list[int]:
    with torch.no_grad():
        out = oracle.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False)
    return out[0, len(prompt) :].tolist()  # type: ignore[no-any-return]


# -- the daemon against transformers ------------------------------------------------------


def test_greedy_matches_transformers_token_for_token(
    shipped: DaemonProcess, tokenizer: Tokenizer, oracle: Any
) -> None:
    """Eight prompts at once (one ragged batch) and a chat: each greedy
    completion is transformers' greedy continuation; streamed, the same."""
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    replies = complete_all(shipped, prompts, max_tokens=NEW_TOKENS, temperature=0)
    for prompt, reply in zip(prompts, replies, strict=True):
        usage = reply.usage
        expected = hf_greedy(oracle, prompt, NEW_TOKENS)[: usage.completion_tokens]
        assert reply.choices[0].text == tokenizer.decode(expected), tokenizer.decode(prompt)
        assert usage.completion_tokens == NEW_TOKENS or reply.choices[0].finish_reason == "stop"
    with client(shipped) as oai:
        streamed = oai.completions.create(
            model=MODEL, prompt=prompts[1], max_tokens=NEW_TOKENS, temperature=0, stream=True
        )
        assert "".join(c.choices[0].text for c in streamed) == replies[1].choices[0].text
        chat = oai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": HAIKU}],
            max_tokens=HTTP_TOKENS,
            temperature=0,
        )
    ids = tokenizer.chat_prompt([ChatMessage("user", HAIKU)])
    expected = hf_greedy(oracle, ids, HTTP_TOKENS)
    assert chat.usage is not None
    got = expected[: chat.usage.completion_tokens]
    assert chat.choices[0].message.content == tokenizer.decode(got)
    shipped.wait_pages_released()


def test_batch_and_prefix_cache_invariance(shipped: DaemonProcess, tokenizer: Tokenizer) -> None:
    """A prompt's greedy text is the same alone, batched with others, and
    continued from its own cached blocks."""
    base = tokenizer.encode("The history of the printing press begins in")
    (alone,) = complete_all(shipped, [base], max_tokens=NEW_TOKENS, temperature=0)
    others = [tokenizer.encode(p) for p in PROMPTS[:5]]
    mixed = complete_all(
        shipped, [*others[:2], base, *others[2:]], max_tokens=NEW_TOKENS, temperature=0
    )
    assert mixed[2].choices[0].text == alone.choices[0].text
    continued = base + tokenizer.encode(alone.choices[0].text, add_bos=False)[:20]
    flushed = subprocess.run(
        [sys.executable, "-m", "kvctl.cli", "--socket", str(shipped.admin_socket), "flush"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert flushed.returncode == 0, flushed.stderr
    first, again = (
        complete_all(shipped, [continued], max_tokens=16, temperature=0)[0] for _ in range(2)
    )
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert again.choices[0].text == first.choices[0].text
    shipped.wait_pages_released()


def test_seeded_sampling_is_reproducible(shipped: DaemonProcess, tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode("My favourite animal is the")
    body = {"temperature": 1.0, "top_p": 0.95, "max_tokens": 12, "logprobs": 0}
    first, second, other = complete_all(shipped, [prompt] * 3, **body, seed=1234)[:2] + (
        complete_all(shipped, [prompt], **body, seed=4321)
    )
    assert first.choices[0].text == second.choices[0].text
    assert first.choices[0].text != other.choices[0].text
    (top1,) = complete_all(
        shipped, [prompt], max_tokens=12, temperature=1.0, seed=7, extra_body={"top_k": 1}
    )
    (greedy,) = complete_all(shipped, [prompt], max_tokens=12, temperature=0)
    assert top1.choices[0].text == greedy.choices[0].text
    logprobs = first.choices[0].logprobs.token_logprobs
    assert all(lp <= 0.0 for lp in logprobs) and any(lp < 0.0 for lp in logprobs)
    shipped.wait_pages_released()


CORPUS = [
    "The capital of France is",
    "  leading spaces and trailing   ",
    "tabs\tand\nnewlines\n\n\n",
    "emoji 😀🎉👩‍👩‍👧 ok",
    "ünïcödé çà et là, 日本語のテキスト, 中文, العربية, עברית",
    "code: def f(x):\n    return x**2  # comment\n",
    "numbers 1234567890 3.14159 1e-9",
    "<start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\n",
    "   \n  \t \u00a0 nbsp",
    "a" * 50,
    "mixed<bos>inside </iframe> html <div class='x'>",
    "",
]


def test_tokenizer_matches_transformers(tokenizer: Tokenizer, hf_tokenizer: Any) -> None:
    for text in CORPUS:
        assert tokenizer.encode(text) == hf_tokenizer.encode(text), repr(text)
        ids = tokenizer.encode(text, add_bos=False)
        assert tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)


def test_streaming_decode_equals_whole_decode(tokenizer: Tokenizer) -> None:
    tok = tokenizer
    for text in CORPUS:
        ids = tok.encode(text, add_bos=False)
        stream = StreamDecoder(tok)
        pieces = [stream.push([i]) for i in ids] + [stream.flush()]
        assert "".join(pieces) == tok.decode(ids)
        assert all("\ufffd" not in piece for piece in pieces)


def test_chat_format(tokenizer: Tokenizer) -> None:
    tok = tokenizer
    ids = tok.chat_prompt([ChatMessage("system", "Be brief."), ChatMessage("user", "Hi")])
    text = tok.decode(ids, skip_special=False)
    assert text == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    )


def test_long_prompt_matches_transformers(
    shipped: DaemonProcess, tokenizer: Tokenizer, oracle: Any
) -> None:
    """A prompt of over 2,000 tokens through the shipped daemon, prefilled in
    512-token chunks (its max_num_batched_tokens) through ring tables (the
    sliding layers' window is 512, its context 4,096) and then decoded:
    greedy tokens equal transformers' (which attends over the whole prompt
    at once)."""
    config = load_config(REPO / "etc" / "kvd.toml")
    step_tokens, context = config.model.max_num_batched_tokens, config.model.max_model_len
    assert (step_tokens, context) == (512, 4096)
    layout = build_layout(preset(MODEL), config.pool.block_size)
    ring = sliding_ring(layout, step_tokens)
    assert 0 < ring < context // config.pool.block_size  # the sliding tables are rings
    text = "".join(f"Item {i}: the square of {i} is {i * i}.\n" for i in range(1, 112))
    prompt = tokenizer.encode(text)
    assert len(prompt) > 2000
    with openai.OpenAI(base_url=f"{shipped.url}/v1", api_key=ALICE, max_retries=0) as oai:
        got = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
    assert got.usage is not None and got.usage.prompt_tokens == len(prompt)
    with torch.no_grad():
        out = oracle.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)
    expected = out[0, len(prompt) :].tolist()[: got.usage.completion_tokens]
    assert got.choices[0].text == tokenizer.decode(expected)
    assert got.usage.completion_tokens == 16 or got.choices[0].finish_reason == "stop"
    shipped.wait_pages_released()


# -- the shipped daemon as the README shows it ------------------


def test_the_shipped_config_boots_with_an_auto_pool(shipped: DaemonProcess) -> None:
    pool = shipped.wait_for("lifecycle.pool")
    assert pool["pages"] > 0
    # The embedded GGUF's matrices are all blocks: "auto" keeps them as int8
    # (exactly), under a third of the f32 bytes; everything this module
    # checks against transformers' f32 model runs on them.
    assert pool["quantization"] == "int8" and pool["quantization_error"] == 0
    assert pool["weight_bytes"] < 320 * 2**20
    # On a CPU "auto" stays within the host's share (at most 4 GiB).
    assert pool["pages"] * pool["page_bytes"] <= 4 << 30
    ready = shipped.wait_for("lifecycle.ready")
    assert set(ready["tenants"]) == {"alice", "batch-jobs"}
    assert not shipped.named("lifecycle.state_restored")  # a first start


def test_echo_logprobs_are_transformers_prompt_logprobs(
    shipped: DaemonProcess, tokenizer: Tokenizer, oracle: Any
) -> None:
    """echo with logprobs over HTTP: each prompt token's logprob and the best
    alternative's are transformers' log-softmax at that position (a prompt
    longer than one step's chunk, so it is scored over several steps)."""
    text = " ".join(PROMPTS * 8)
    ids = tokenizer.encode(text)
    assert len(ids) > 512  # the shipped max_num_batched_tokens: two chunks
    with openai.OpenAI(base_url=f"{shipped.url}/v1", api_key=ALICE, max_retries=0) as oai:
        reply = oai.completions.create(
            model=MODEL, prompt=text, max_tokens=2, temperature=0, echo=True, logprobs=3
        )
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None
    assert logprobs.top_logprobs is not None
    with torch.no_grad():
        logits = oracle(torch.tensor([ids])).logits[0].double()
    expected = torch.log_softmax(logits, dim=-1)
    want = expected[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()
    got = logprobs.token_logprobs[1 : len(ids)]
    assert logprobs.token_logprobs[0] is None
    assert max(abs(g - w) for g, w in zip(got, want, strict=True)) < 2e-3  # type: ignore[operator]
    best = expected[: len(ids) - 1].max(dim=-1).values.tolist()
    tops = logprobs.top_logprobs[1 : len(ids)]
    assert all(1 <= len(top) <= 3 for top in tops)  # type: ignore[arg-type]  # by text
    assert max(abs(max(top.values()) - b) for top, b in zip(tops, best, strict=True)) < 2e-3  # type: ignore[union-attr]
    shipped.wait_pages_released()


def test_repeated_prompt_hits_the_cache_for_its_tenant_only(shipped: DaemonProcess) -> None:
    prompt = "Once upon a time, " * 20

    def cached(key: str) -> int:
        with openai.OpenAI(base_url=f"{shipped.url}/v1", api_key=key, max_retries=0) as oai:
            result = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
        assert result.usage is not None and result.usage.prompt_tokens_details is not None
        return result.usage.prompt_tokens_details.cached_tokens or 0

    assert cached(ALICE) == 0
    assert cached(ALICE) >= 64
    assert cached(BOB) == 0  # bob's key is the batch-jobs tenant
    shipped.wait_pages_released()


def test_a_json_schema_reply_validates(shipped: DaemonProcess) -> None:
    """Structured output on the real model, with the OpenAI client's own
    ``response_format``: greedy and n = 2 sampled, each valid under the schema."""
    jsonschema = pytest.importorskip("jsonschema")
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 30},
            "country": {"type": "string", "maxLength": 30},
            "population_millions": {"type": "integer", "minimum": 0, "maximum": 100},
        },
        "required": ["city", "country", "population_millions"],
        "additionalProperties": False,
    }
    with openai.OpenAI(base_url=f"{shipped.url}/v1", api_key=ALICE, max_retries=0) as oai:
        for extra in ({"temperature": 0}, {"temperature": 1.0, "seed": 3, "n": 2}):
            reply = oai.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Describe Paris as JSON."}],
                max_tokens=80,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "city", "schema": schema},
                },
                **extra,  # type: ignore[arg-type]
            )
            for choice in reply.choices:
                assert choice.finish_reason == "stop", choice
                jsonschema.validate(json.loads(choice.message.content or ""), schema)
    shipped.wait_pages_released()


def _readme_block(language: str, marker: str) -> str:
    blocks = re.findall(rf"```{language}\n(.*?)```", README, re.S)
    matching = [b for b in blocks if marker in b]
    assert len(matching) == 1, f"one {language} block with {marker!r} in the README"
    return matching[0]


def test_the_readme_curl_examples_work(shipped: DaemonProcess) -> None:
    script = _readme_block("sh", "curl")
    assert README_URL in script
    out = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script.replace(README_URL, shipped.url)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    completion, _, stream = out.stdout.partition("}data: ")
    body = json.loads(completion + "}")
    assert body["choices"][0]["text"] and body["usage"]["completion_tokens"] == 16
    events = [e for e in ("data: " + stream).split("\n\n") if e.strip()]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text.strip()
    assert chunks[-1]["usage"]["completion_tokens"] > 0


def test_the_readme_python_example_works(shipped: DaemonProcess, tmp_path: Path) -> None:
    """Run as the README says, with the interpreter of the environment that
    the README's set-up (scripts/serve.sh) installs, openai included."""
    script = _readme_block("python", "from openai import OpenAI")
    assert README_URL in script
    command = re.search(r"`\.venv/bin/python (\S+\.py)`", README)
    assert command, "the README says how to run its Python example"
    installed = re.search(r"kvd_ensure_venv(.*)", (REPO / "scripts" / "serve.sh").read_text())
    assert installed is not None
    extras = installed.group(1).split() or [""]
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requires = list(project["dependencies"])
    for extra in filter(None, extras[0].split(",")):
        requires += project["optional-dependencies"][extra]
    assert any(dep.startswith("openai") for dep in requires), "serve.sh installs openai"
    path = tmp_path / command.group(1)
    path.write_text(script.replace(README_URL, shipped.url))
    out = subprocess.run(
        [sys.executable, str(path)],  # .venv/bin/python in this run
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    *words, cached = out.stdout.split()
    assert words and cached.isdigit()


def test_nothing_compiled_after_warm_up(shipped: DaemonProcess, tokenizer: Tokenizer) -> None:
    """After every test above (ragged batches, chunked long prompts, echo
    scoring, structured output, sampling of every kind) and a last mix of
    lengths and sampling parameters at once, the daemon never compiled a
    program its warm-up had not."""
    prompts = [tokenizer.encode(p * k) for k, p in enumerate(PROMPTS[:7], 1)]
    bodies = [
        {"temperature": 0, "max_tokens": 5},
        {"temperature": 0.8, "seed": 1, "max_tokens": 9},
        {"temperature": 1.0, "extra_body": {"top_k": 5}, "seed": 2, "max_tokens": 3},
        {"temperature": 0.7, "top_p": 0.9, "seed": 3, "max_tokens": 12, "logprobs": 2},
        {"temperature": 0, "max_tokens": 1, "frequency_penalty": 0.5},
        {
            "temperature": 1.2,
            "top_p": 0.95,
            "max_tokens": 7,
            "extra_body": {"top_k": 40, "min_p": 0.05},
        },
        {"temperature": 0, "max_tokens": 20, "logit_bias": {"1000": 5}},
    ]
    with client(shipped) as oai, ThreadPoolExecutor(len(prompts)) as pool:
        list(
            pool.map(
                lambda pb: oai.completions.create(model=MODEL, prompt=pb[0], **pb[1]),
                zip(prompts, bodies, strict=True),
            )
        )
    shipped.wait_pages_released()
    ready = shipped.wait_for("lifecycle.warm")
    assert ready["programs"] > 0
    assert not shipped.named("engine.late_compile"), shipped.named("engine.late_compile")
