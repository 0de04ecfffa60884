"""A request's sampling parameters and the bounds the engine represents
exactly: plain data, importable without JAX (the API, the CLI, the scheduler).
"""

from __future__ import annotations

import msgspec

MAX_STOP_IDS = 8
MAX_LOGIT_BIAS = 300  # OpenAI's own limit
MAX_TOP_LOGPROBS = 20  # OpenAI's limit on alternatives per token
MAX_BIAS = 100.0  # OpenAI's range for one bias: -100 bans a token, +100 forces it
# Temperatures the engine represents exactly in float32: logits over the
# smallest stay finite, and the largest still orders the vocabulary.
MIN_TEMPERATURE = 1e-6
MAX_TEMPERATURE = 100.0


class SamplingParams(msgspec.Struct, frozen=True):
    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings, matched on the host
    logprobs: bool = False
    top_logprobs: int = 0  # the most likely alternatives' logprobs, per token
    # vLLM's extensions: EOS (and the model's other end tokens) do not end the
    # generation; no end token or stop id is sampled before ``min_tokens``
    # (counted from the prompt); ``min_p`` drops tokens less likely than that
    # share of the most likely one.
    ignore_eos: bool = False
    min_tokens: int = 0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)

    def __post_init__(self) -> None:
        if not (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE):
            raise ValueError(
                f"temperature must be 0 (greedy) or {MIN_TEMPERATURE:g} to {MAX_TEMPERATURE:g}"
            )
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if len(self.stop_token_ids) > MAX_STOP_IDS:
            raise ValueError(f"at most {MAX_STOP_IDS} stop token ids")
        if self.seed is not None and not 0 <= self.seed < 2**32:
            raise ValueError("seed must be in [0, 2**32)")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError("min_tokens must be in [0, max_tokens]")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} logit_bias entries")
        if any(not -MAX_BIAS <= bias <= MAX_BIAS for _, bias in self.logit_bias):
            raise ValueError(f"a logit bias must be in [-{MAX_BIAS:g}, {MAX_BIAS:g}]")
