"""``kvd generate``: load a model, continue one prompt, report what happened."""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec

from kvd.engine import compile_cache
from kvd.engine.engine import Engine, EngineConfig, EngineError
from kvd.engine.loader import ModelLoadError, load_model
from kvd.engine.tokenizer import ChatMessage, TokenizerError
from kvd.oneshot.batch import BatchGenerator
from kvd.sched.admission import prompt_problem
from kvd.sched.sampling_params import SamplingParams


class GenerateError(Exception):
    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class GenerateResult(msgspec.Struct):
    model: str
    prompt_ids: list[int]
    completion_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[float]
    load_s: float
    first_token_s: float | None
    total_s: float


def generate_once(
    model: str,
    prompt: str,
    *,
    chat: bool = False,
    max_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    dtype: str = "float32",
    quantization: str = "auto",
    tensor_parallel: int = 1,
    progress: Callable[[str], None] | None = None,
) -> GenerateResult:
    say = progress or (lambda _text: None)
    say(f"loading {model} ({dtype}, weights: {quantization})")
    try:
        loaded = load_model(model, dtype, quantization)
    except ModelLoadError as exc:
        raise GenerateError(str(exc), exit_code=1) from None
    tokenizer = loaded.tokenizer
    try:
        ids = (
            tokenizer.chat_prompt([ChatMessage("user", prompt)])
            if chat
            else tokenizer.encode(prompt)
        )
    except TokenizerError as exc:
        raise GenerateError(str(exc), exit_code=2) from None
    context = loaded.config.max_position
    # Checked before the engine compiles anything (the scheduler checks again).
    problem = prompt_problem(ids, loaded.config.vocab_size, context)
    if problem is not None:
        raise GenerateError(f"{loaded.config.name}: {problem}", exit_code=2)
    config = EngineConfig(
        dtype=dtype,
        max_model_len=context,
        max_num_seqs=1,
        max_num_batched_tokens=512,
        pool_tokens=min(context, len(ids) + max_tokens) + 16,
        tensor_parallel=tensor_parallel,
    )
    say(f"loaded in {loaded.load_seconds:.1f}s; compiling and running")
    try:
        compile_cache.enable_default()
        engine = Engine(loaded, config)
        params = SamplingParams(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            max_tokens=max_tokens,
            logprobs=True,
        )
        start = time.perf_counter()
        (result,) = BatchGenerator(engine).generate([ids], [params])
    except (EngineError, ValueError) as exc:
        raise GenerateError(str(exc), exit_code=2) from None
    return GenerateResult(
        model=loaded.config.name,
        prompt_ids=ids,
        completion_ids=result.completion_ids,
        text=tokenizer.decode(result.completion_ids),
        finish_reason=result.finish_reason,
        logprobs=result.logprobs,
        load_s=loaded.load_seconds,
        first_token_s=result.first_token_s,
        total_s=time.perf_counter() - start,
    )
