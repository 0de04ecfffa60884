"""End to end on the real Gemma 3 270M (the embedded default), against
transformers loaded from the same GGUF file. One engine and one oracle are
shared by the whole module: compiled shapes are reused across tests."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvd.engine.engine import Engine, EngineConfig  # noqa: E402
from kvd.engine.loader import LoadedModel, embedded_gguf_path, load_model  # noqa: E402
from kvd.engine.sampling import SamplingParams  # noqa: E402
from kvd.engine.tokenizer import ChatMessage, StreamDecoder  # noqa: E402
from kvd.sched.batch import BatchGenerator  # noqa: E402

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


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("kvd-cache")
    old = os.environ.get("KVD_CACHE_DIR")
    os.environ["KVD_CACHE_DIR"] = str(path)
    yield path
    if old is None:
        os.environ.pop("KVD_CACHE_DIR", None)
    else:
        os.environ["KVD_CACHE_DIR"] = old


@pytest.fixture(scope="module")
def model(cache: Path) -> LoadedModel:
    return load_model("gemma3-270m", "float32")


@pytest.fixture(scope="module")
def engine(model: LoadedModel) -> Engine:
    config = EngineConfig(
        max_model_len=256, max_num_batched_tokens=64, max_num_seqs=8, pool_tokens=4096
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


def test_long_prompt_matches_transformers(model: LoadedModel, oracle: Any) -> None:
    """A prompt of over 2,000 tokens, prefilled in 512-token chunks through ring
    tables (the sliding layers' window is 512) and then decoded: greedy tokens
    equal transformers' (which attends over the whole prompt at once)."""
    text = "".join(f"Item {i}: the square of {i} is {i * i}.\n" for i in range(1, 112))
    prompt = model.tokenizer.encode(text)
    assert len(prompt) > 2000
    config = EngineConfig(
        max_model_len=2560, max_num_batched_tokens=512, max_num_seqs=2, pool_tokens=2816
    )
    engine = Engine(model, config)
    assert 0 < engine.sliding_ring < 2560 // config.block_size
    generator = BatchGenerator(engine)
    result = generator.generate([prompt], [greedy(16)])[0]
    with torch.no_grad():
        out = oracle.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)
    assert result.completion_ids == out[0, len(prompt) :].tolist()[: len(result.completion_ids)]
    assert len(result.completion_ids) == 16 or result.finish_reason == "stop"
    generator.kv.check_invariants()
    assert generator.kv.pool.num_referenced() == 0
