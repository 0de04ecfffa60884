"""A request's sampling parameters and the bounds the engine represents
exactly: plain data, importable without JAX (the API, the CLI, the scheduler).
"""

from __future__ import annotations

import msgspec

MAX_STOP_IDS = 8
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
