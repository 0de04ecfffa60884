"""Choosing the next token on the device: greedy, temperature, top-k, top-p.

Per-sequence parameters ride along as arrays, so one compiled step serves a
batch that mixes greedy and sampled requests. Randomness is reproducible per
request: the key is the request's seed folded with the token's position, so a
sequence samples the same tokens whatever it is batched with and however
often it is preempted and resumed.

Top-k and top-p work on the ``CANDIDATES`` most likely tokens (a full sort of
a 262,144-token vocabulary per sequence per step costs more than the rest of
the step on a CPU): top-k is capped at that many, and the nucleus is cut
within them, which is exact unless the top ``CANDIDATES`` tokens hold less
than ``top_p`` of the mass. Pure temperature sampling uses the whole
vocabulary (Gumbel-max).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import msgspec

CANDIDATES = 256
MAX_STOP_IDS = 8


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
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
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


class SamplingBatch(NamedTuple):
    temperature: jax.Array  # [S] f32
    top_k: jax.Array  # [S] int32, 0 = off
    top_p: jax.Array  # [S] f32
    seeds: jax.Array  # [S] uint32
    positions: jax.Array  # [S] int32 position of the token being sampled
    stop_ids: jax.Array  # [S, MAX_STOP_IDS] int32, -1 padding
    want_logprobs: jax.Array  # [S] bool


def sample(logits: jax.Array, params: SamplingBatch) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(tokens [S], logprobs of the chosen tokens [S], stopped [S]) from logits
    ``[V, S]``: vocabulary-major, as the head computes them fastest.

    Branches that no sequence of the batch needs (random draws when all are
    greedy, the whole-vocabulary draw when all truncate) are skipped at run
    time with ``lax.cond``: one compiled program, no wasted work.
    """
    greedy = jnp.argmax(logits, axis=0).astype(jnp.int32)
    tokens = jax.lax.cond(
        jnp.all(params.temperature == 0.0),
        lambda: greedy,
        lambda: jnp.where(params.temperature == 0.0, greedy, _draw(logits, params)),
    )
    rows = jnp.arange(tokens.shape[0])
    # The normaliser is a pass over the whole vocabulary: only when asked for.
    logprobs = jax.lax.cond(
        jnp.any(params.want_logprobs),
        lambda: logits[tokens, rows] - jax.nn.logsumexp(logits, axis=0),
        lambda: jnp.zeros(tokens.shape, logits.dtype),
    )
    stopped = jnp.any(tokens[:, None] == params.stop_ids, axis=-1)
    return tokens, logprobs, stopped


def _draw(logits: jax.Array, params: SamplingBatch) -> jax.Array:
    """Sampled tokens [S] from vocabulary-major logits [V, S]."""
    keys = jax.vmap(lambda seed, pos: jax.random.fold_in(jax.random.key(seed), pos))(
        params.seeds, params.positions
    )
    vocab = logits.shape[0]
    scaled = logits / jnp.maximum(params.temperature, 1e-6)[None, :]  # [V, S]
    truncating = (params.top_k > 0) | (params.top_p < 1.0)

    def whole_vocabulary() -> jax.Array:  # Gumbel-max over all V tokens
        gumbel = jax.vmap(lambda key: jax.random.gumbel(key, (vocab,)))(keys)  # [S, V]
        return jnp.argmax(scaled + gumbel.T, axis=0).astype(jnp.int32)

    candidates = min(CANDIDATES, vocab)

    def among_candidates() -> jax.Array:
        top_values, top_index = jax.lax.top_k(scaled.T, candidates)  # [S, C] best first
        rank = jnp.arange(candidates)[None, :]
        k = jnp.where(params.top_k > 0, jnp.minimum(params.top_k, candidates), candidates)
        keep = rank < k[:, None]
        probs = jax.nn.softmax(jnp.where(keep, top_values, -jnp.inf), axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of the better candidates
        keep &= before < params.top_p[:, None]  # the best candidate always stays
        row_logits = jnp.where(keep, top_values, -jnp.inf)
        choice = jax.vmap(jax.random.categorical)(keys, row_logits)
        return jnp.take_along_axis(top_index, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)

    free = jax.lax.cond(jnp.all(truncating), lambda: jnp.zeros_like(params.top_k), whole_vocabulary)
    cut = jax.lax.cond(jnp.any(truncating), among_candidates, lambda: jnp.zeros_like(params.top_k))
    return jnp.where(truncating, cut, free)
