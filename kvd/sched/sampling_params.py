"""A request's sampling parameters and the bounds the engine represents
exactly: plain data, importable without JAX (the API, the CLI, the scheduler).
"""

from __future__ import annotations

import msgspec

MAX_STOP_IDS = 8
MAX_LOGIT_BIAS = 300  # OpenAI's own limit
MAX_TOP_LOGPROBS = 20  # OpenAI's limit on alternatives per token
MAX_BIAS = 100.0  # OpenAI's range for one bias: -100 bans a token, +100 forces it
MAX_PENALTY = 2.0  # OpenAI's range for presence and frequency penalties: [-2, 2]
MAX_REPETITION_PENALTY = 10.0  # transformers' and vLLM's: > 0; 1 is off
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
    # Stop strings: submitted with the StopCondition that watches them (the
    # scheduler ends the generation when it reports one).
    stop: tuple[str, ...] = ()
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
    # OpenAI's penalties, over the tokens generated so far: ``presence`` once
    # for every token that appeared, ``frequency`` times its count. vLLM's
    # (transformers') ``repetition_penalty`` over the prompt and the output:
    # a positive logit divided by it, a negative one multiplied.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # The prompt's own logprobs (completions' ``echo`` with ``logprobs``): each
    # prompt token's after the first, and this many alternatives at each
    # position; None: not asked. The prompt is then computed whole, not
    # taken from the prefix cache.
    prompt_logprobs: int | None = None
    # Set by the scheduler, not by a client: tokens of this request's output
    # already in its sequence when it starts (a sequence recomputed after a
    # preemption), so the prompt ends that many tokens before the sequence does.
    resumed_output: int = 0

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
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]")
        if not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}]")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}]")
        if self.resumed_output < 0:
            raise ValueError("resumed_output must be >= 0")

    @property
    def penalized(self) -> bool:
        """Whether a penalty depends on the tokens so far (the step then needs them)."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )
