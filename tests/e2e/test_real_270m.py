"""End to end on the real Gemma 3 270M (the embedded default): one
in-process engine, checked token for token against transformers loaded from
the same GGUF file, and one daemon on the shipped configuration, checked
against that engine over HTTP and with the README's examples word for word.

The daemon is the shipped ``etc/kvd.toml`` as an operator installs it (the
embedded 270M, ``pool.size = "auto"``), with only its addresses and paths
swapped for temporary ones. It is started first and compiles in its own
process while this one loads the engine and the oracle; every test of the
module shares the two (compiled shapes are reused across tests).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvd.engine.batching import sliding_ring  # noqa: E402
from kvd.engine.engine import Engine, EngineConfig  # noqa: E402
from kvd.engine.loader import LoadedModel, embedded_gguf_path, load_model  # noqa: E402
from kvd.engine.sampling import SamplingParams  # noqa: E402
from kvd.engine.tokenizer import ChatMessage, StreamDecoder  # noqa: E402
from kvd.sched.batch import BatchGenerator  # noqa: E402
from kvd.server.config import load_config  # noqa: E402
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
    socket_dir = tempfile.mkdtemp(prefix="kvd-", dir="/tmp")  # short: a socket path
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
def model(shipped_process: DaemonProcess) -> LoadedModel:
    """The model in this process (the daemon compiles meanwhile)."""
    return load_model(MODEL, "float32")


@pytest.fixture(scope="module")
def engine(model: LoadedModel) -> Engine:
    config = EngineConfig(
        max_model_len=512, max_num_batched_tokens=64, max_num_seqs=8, pool_tokens=4096
    )
    engine = Engine(model, config)
    engine.warm_up()
    return engine


@pytest.fixture(scope="module")
def generator(engine: Engine) -> BatchGenerator:
    """The engine's prompts run through the scheduler, one KV manager for the
    module (so prefix-cache tests see what earlier calls cached)."""
    return BatchGenerator(engine)


@pytest.fixture(scope="module")
def oracle(model: LoadedModel) -> Any:
    gguf = embedded_gguf_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    return hf.eval()


@pytest.fixture(scope="module")
def hf_tokenizer(model: LoadedModel) -> Any:
    gguf = embedded_gguf_path()
    return transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def greedy(n: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n)


# -- the engine against transformers -----------------------------------------------------


def test_greedy_matches_transformers_token_for_token(
    generator: BatchGenerator, model: LoadedModel, oracle: Any
) -> None:
    prompts = [model.tokenizer.encode(p) for p in PROMPTS]
    ours = generator.generate(prompts, [greedy()] * len(prompts))  # ragged, batched together
    for prompt, result in zip(prompts, ours, strict=True):
        with torch.no_grad():
            out = oracle.generate(
                torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False
            )
        expected = out[0, len(prompt) :].tolist()
        got = result.completion_ids
        assert got == expected[: len(got)], model.tokenizer.decode(prompt)
        assert len(got) == NEW_TOKENS or result.finish_reason == "stop"
    generator.kv.check_invariants()
    assert generator.kv.pool.num_referenced() == 0


def test_batch_and_prefix_cache_invariance(generator: BatchGenerator, model: LoadedModel) -> None:
    tok = model.tokenizer
    base = tok.encode("The history of the printing press begins in")
    alone = generator.generate([base], [greedy()])[0].completion_ids
    others = [tok.encode(p) for p in PROMPTS[:5]]
    mixed = generator.generate([*others[:2], base, *others[2:]], [greedy()] * 6)
    assert mixed[2].completion_ids == alone
    generator.kv.flush_cache()
    long_prompt = base + alone[:20]  # 30 tokens: its first blocks are cached after this run
    computed = generator.generate([long_prompt], [greedy(16)])[0]
    assert computed.cached_tokens == 0
    cached = generator.generate([long_prompt], [greedy(16)])[0]
    assert cached.cached_tokens > 0
    assert cached.completion_ids == computed.completion_ids
    assert alone[20:36] == computed.completion_ids[: len(alone[20:36])]


def test_no_compilation_after_warm_up(
    engine: Engine, generator: BatchGenerator, model: LoadedModel
) -> None:
    compiled = engine.compiled_shapes()
    tok = model.tokenizer
    prompts = [tok.encode(p * k) for k, p in enumerate(PROMPTS[:7], 1)]
    params = [
        greedy(5),
        SamplingParams(temperature=0.8, seed=1, max_tokens=9),
        SamplingParams(temperature=1.0, top_k=5, seed=2, max_tokens=3),
        SamplingParams(temperature=0.7, top_p=0.9, seed=3, max_tokens=12),
        greedy(1),
        SamplingParams(temperature=1.2, top_k=40, top_p=0.95, max_tokens=7),
        greedy(20),
    ]
    for count in (1, 3, 7):
        generator.generate(prompts[:count], params[:count])
    assert engine.compiled_shapes() == compiled
    assert engine.late_compiles == 0


def test_seeded_sampling_is_reproducible(generator: BatchGenerator, model: LoadedModel) -> None:
    prompt = model.tokenizer.encode("My favourite animal is the")
    a = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=12, logprobs=True)
    b = SamplingParams(temperature=1.0, top_p=0.95, seed=4321, max_tokens=12)
    first, second, other = generator.generate([prompt] * 3, [a, a, b])
    assert first.completion_ids == second.completion_ids
    assert first.completion_ids != other.completion_ids
    top1 = SamplingParams(temperature=1.0, top_k=1, seed=7, max_tokens=12)
    assert generator.generate([prompt], [top1])[0].completion_ids == (
        generator.generate([prompt], [greedy(12)])[0].completion_ids
    )
    assert all(lp <= 0.0 for lp in first.logprobs) and any(lp < 0.0 for lp in first.logprobs)


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


def test_tokenizer_matches_transformers(model: LoadedModel, hf_tokenizer: Any) -> None:
    for text in CORPUS:
        assert model.tokenizer.encode(text) == hf_tokenizer.encode(text), repr(text)
        ids = model.tokenizer.encode(text, add_bos=False)
        assert model.tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)


def test_streaming_decode_equals_whole_decode(model: LoadedModel) -> None:
    tok = model.tokenizer
    for text in CORPUS:
        ids = tok.encode(text, add_bos=False)
        stream = StreamDecoder(tok)
        pieces = [stream.push([i]) for i in ids] + [stream.flush()]
        assert "".join(pieces) == tok.decode(ids)
        assert all("\ufffd" not in piece for piece in pieces)


def test_chat_format(model: LoadedModel) -> None:
    tok = model.tokenizer
    ids = tok.chat_prompt([ChatMessage("system", "Be brief."), ChatMessage("user", "Hi")])
    text = tok.decode(ids, skip_special=False)
    assert text == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    )


def test_long_prompt_matches_transformers(
    shipped: DaemonProcess, engine: Engine, model: LoadedModel, oracle: Any
) -> None:
    """A prompt of over 2,000 tokens through the shipped daemon, prefilled in
    512-token chunks (its max_num_batched_tokens) through ring tables (the
    sliding layers' window is 512, its context 4,096) and then decoded:
    greedy tokens equal transformers' (which attends over the whole prompt
    at once)."""
    config = load_config(REPO / "etc" / "kvd.toml")
    step_tokens, context = config.model.max_num_batched_tokens, config.model.max_model_len
    assert (step_tokens, context) == (512, 4096)
    ring = sliding_ring(engine.layout, step_tokens)  # the same model and block size
    assert 0 < ring < context // config.pool.block_size  # the sliding tables are rings
    text = "".join(f"Item {i}: the square of {i} is {i * i}.\n" for i in range(1, 112))
    prompt = model.tokenizer.encode(text)
    assert len(prompt) > 2000
    with openai.OpenAI(base_url=f"{shipped.url}/v1", api_key=ALICE, max_retries=0) as oai:
        got = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
    assert got.usage is not None and got.usage.prompt_tokens == len(prompt)
    with torch.no_grad():
        out = oracle.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)
    expected = out[0, len(prompt) :].tolist()[: got.usage.completion_tokens]
    assert got.choices[0].text == model.tokenizer.decode(expected)
    assert got.usage.completion_tokens == 16 or got.choices[0].finish_reason == "stop"
    shipped.wait_pages_released()


# -- the shipped daemon, against the engine and as the README shows it ------------------


def test_the_shipped_config_boots_with_an_auto_pool(shipped: DaemonProcess) -> None:
    pool = shipped.wait_for("lifecycle.pool")
    assert pool["pages"] > 0
    # On a CPU "auto" stays within the host's share (at most 4 GiB).
    assert pool["pages"] * pool["page_bytes"] <= 4 << 30
    ready = shipped.wait_for("lifecycle.ready")
    assert set(ready["tenants"]) == {"alice", "batch-jobs"}
    assert not shipped.named("lifecycle.state_restored")  # a first start


def test_http_matches_the_engine(shipped: DaemonProcess, engine: Engine) -> None:
    """What a client receives over HTTP is token for token what the
    in-process engine generates for the same prompt."""
    tokenizer = engine.model.tokenizer
    prompts = [tokenizer.encode(p) for p in HTTP_PROMPTS]
    chat = tokenizer.chat_prompt([ChatMessage("user", HAIKU)])
    expected = BatchGenerator(engine).generate(
        [*prompts, chat], [greedy(HTTP_TOKENS)] * (len(prompts) + 1)
    )
    with openai.OpenAI(base_url=f"{shipped.url}/v1", api_key=ALICE, max_retries=0) as oai:
        for text, want in zip(HTTP_PROMPTS, expected, strict=False):
            got = oai.completions.create(
                model=MODEL, prompt=text, max_tokens=HTTP_TOKENS, temperature=0
            )
            assert got.choices[0].text == tokenizer.decode(want.completion_ids)
            assert got.usage is not None
            assert got.usage.completion_tokens == len(want.completion_ids)
            streamed = oai.completions.create(
                model=MODEL, prompt=text, max_tokens=HTTP_TOKENS, temperature=0, stream=True
            )
            assert "".join(c.choices[0].text for c in streamed) == got.choices[0].text
        reply = oai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": HAIKU}],
            max_tokens=HTTP_TOKENS,
            temperature=0,
        )
    assert reply.choices[0].message.content == tokenizer.decode(expected[-1].completion_ids)
    assert reply.choices[0].finish_reason == expected[-1].finish_reason


def test_echo_logprobs_are_transformers_prompt_logprobs(
    shipped: DaemonProcess, model: LoadedModel, oracle: Any
) -> None:
    """echo with logprobs over HTTP: each prompt token's logprob and the best
    alternative's are transformers' log-softmax at that position (a prompt
    longer than one step's chunk, so it is scored over several steps)."""
    text = " ".join(PROMPTS * 8)
    ids = model.tokenizer.encode(text)
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
