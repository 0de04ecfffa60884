"""What a request must be to be queued: the one place prompts are checked.

The API checks a body with these before it queues anything (so a client gets
its 400 or 413 without waiting), and the scheduler checks again at submit
(so a caller that is not the API cannot slip past them).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvd.sched.requests import Rejection


def prompt_problem(prompt: Sequence[int], vocab_size: int, max_model_len: int) -> Rejection | None:
    """Why ``prompt`` cannot run on a model of this vocabulary and context, or None."""
    if not prompt:
        return Rejection(400, "empty_prompt", "the prompt is empty")
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        bad = next(t for t in prompt if not 0 <= t < vocab_size)
        return Rejection(
            400, "bad_token", f"token id {bad} is outside the vocabulary (0 to {vocab_size - 1})"
        )
    if len(prompt) >= max_model_len:
        return Rejection(
            413,
            "prompt_too_long",
            f"the prompt has {len(prompt)} tokens; this model's context is {max_model_len} "
            "tokens, and at least one must be left for the completion",
        )
    return None


def total_tokens(prompt_len: int, max_tokens: int, max_model_len: int) -> int:
    """The length at which a request's sequence ends: its prompt and max_tokens,
    or the whole context if that is shorter."""
    return prompt_len + min(max_tokens, max_model_len - prompt_len)
