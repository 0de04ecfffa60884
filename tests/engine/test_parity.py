"""kvd's paged forward against transformers' Gemma 3 and Gemma 4 (tiny random
models), logits within 1e-4 (f32)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvd.engine import model
from kvd.engine.batching import bucket, build_step_batch, powers_of_two, sliding_ring
from kvd.engine.kvquant import dequantise, quantise, storage_dtype
from kvd.engine.model import EngineSpec, forward
from kvd.kv import BudgetMode, KVManager, TenantBudget, build_layout
from tests.engine.conftest import TinyModel, hf_logits

BLOCK = 4
TOL = 1e-4


class Harness:
    """The real KV manager and forward pass, asking for every token's logits."""

    def __init__(
        self, model: TinyModel, pages: int = 256, kv_dtype: str = "float32", storage: Any = None
    ) -> None:
        self.layout = build_layout(model.config.kv_geometry(kv_dtype), BLOCK)
        self.kv = KVManager(self.layout, pages, mode=BudgetMode.FREE)
        self.kv.set_tenant("t", TenantBudget())
        # Sliding tables as the engine has them: rings over a window plus a step.
        self.ring = sliding_ring(self.layout, 64)
        spec = EngineSpec.build(model.config, self.layout, self.ring)
        self.params = jax.device_put(model.params)
        dtype = jnp.dtype(storage or kv_dtype)  # storage: kvquant.storage_dtype's choice
        self.pool = jnp.zeros((pages, self.layout.page_bytes // dtype.itemsize), dtype)
        self._forward = jax.jit(lambda p, pool, b: forward(spec, p, pool, b))

    def run_all_logits(self, work: list[tuple[Any, int]]) -> np.ndarray[Any, Any]:
        """Logits of every scheduled token (not only the last of each sequence)."""
        total = sum(n for _, n in work)
        tokens = bucket(total, powers_of_two(8, 256))
        blocks = max(self.ring, *(seq.num_blocks for seq, _ in work))
        width = bucket(blocks, powers_of_two(4, 64))
        batch = build_step_batch(work, self.layout, tokens, tokens, width, self.ring)
        batch = batch._replace(sample_index=jnp.arange(tokens, dtype=jnp.int32))
        logits, self.pool = self._forward(self.params, self.pool, batch)
        for seq, n in work:
            self.kv.commit(seq, n)
        return np.asarray(logits[:total])


MODELS = ["tiny3", "tiny4", "tiny4_separate_v"]


@pytest.fixture(params=MODELS)
def tiny(request: pytest.FixtureRequest) -> TinyModel:
    return request.getfixturevalue(request.param)  # type: ignore[no-any-return]


def _tokens(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 128, n)]


def test_whole_prefill_matches(tiny: TinyModel) -> None:
    tokens = _tokens(37, 1)  # several windows and blocks
    h = Harness(tiny)
    seq = h.kv.add_sequence(1, "t", tokens)
    h.kv.allocate(seq, len(tokens))
    ours = h.run_all_logits([(seq, len(tokens))])
    np.testing.assert_allclose(ours, hf_logits(tiny, tokens), atol=TOL, rtol=0)


@pytest.mark.parametrize("chunks", [(3, 5, 7, 11, 11), (1, 4, 4, 16, 12), (17, 1, 1, 1, 1, 15)])
def test_chunked_prefill_across_blocks_matches(tiny: TinyModel, chunks: tuple[int, ...]) -> None:
    tokens = _tokens(sum(chunks), 2)
    expected = hf_logits(tiny, tokens)
    h = Harness(tiny)
    seq = h.kv.add_sequence(1, "t", tokens)
    for n in chunks:
        start = seq.num_computed
        h.kv.allocate(seq, n)
        ours = h.run_all_logits([(seq, n)])
        np.testing.assert_allclose(ours, expected[start : start + n], atol=TOL, rtol=0)
    h.kv.check_invariants()


def test_paged_decode_past_the_window_in_a_ragged_batch(tiny: TinyModel) -> None:
    prompts = [_tokens(n, 10 + n) for n in (5, 13, 2)]
    full = [p + _tokens(30, 20 + i) for i, p in enumerate(prompts)]
    expected = [hf_logits(tiny, f) for f in full]
    h = Harness(tiny)
    seqs = [h.kv.add_sequence(i, "t", f) for i, f in enumerate(full)]
    work = []
    for seq, p in zip(seqs, prompts, strict=True):
        h.kv.allocate(seq, len(p))
        work.append((seq, len(p)))
    h.run_all_logits(work)
    for _ in range(30):  # decode steps, teacher-forced, all three sequences ragged
        work = []
        for seq in seqs:
            h.kv.allocate(seq, 1)
            work.append((seq, 1))
        positions = [seq.num_computed for seq in seqs]
        ours = h.run_all_logits(work)
        for i, pos in enumerate(positions):
            np.testing.assert_allclose(ours[i], expected[i][pos], atol=TOL, rtol=0)
    # The sliding groups really released pages behind the window.
    assert all(seq.sliding_start > 0 for seq in seqs)
    h.kv.check_invariants()


def test_prefix_cache_hit_gives_the_same_logits(tiny: TinyModel) -> None:
    tokens = _tokens(21, 3)
    expected = hf_logits(tiny, tokens + [5])
    h = Harness(tiny)
    first = h.kv.add_sequence(1, "t", tokens)
    h.kv.allocate(first, len(tokens))
    h.run_all_logits([(first, len(tokens))])
    h.kv.finish(first)
    again = h.kv.add_sequence(2, "t", tokens + [5])
    hit = h.kv.lookup(again)
    assert hit.num_tokens == 20
    h.kv.allocate(again, 2, hit)
    ours = h.run_all_logits([(again, 2)])
    np.testing.assert_allclose(ours, expected[20:22], atol=TOL, rtol=0)


# int8 K/V against a dequantised reference: the same forward pass, rotation
# included, over an f32 pool whose K/V writes are quantised and dequantised on
# the way in. Both attend over the same dequantised values, so they agree as
# closely as f32 runs do.
TOL_INT8 = 1e-4


def _int8_run(tiny: TinyModel, kv_dtype: str, storage: Any = None) -> list[np.ndarray]:
    """Logits of a prefill then ragged decodes past the window."""
    model._traced_block.clear_cache()  # its traces are keyed by spec, not by to_pool
    prompts = [_tokens(n, 30 + n) for n in (13, 2)]
    full = [p + _tokens(12, 40 + i) for i, p in enumerate(prompts)]
    h = Harness(tiny, kv_dtype=kv_dtype, storage=storage)
    seqs = [h.kv.add_sequence(i, "t", f) for i, f in enumerate(full)]
    for seq, p in zip(seqs, prompts, strict=True):
        h.kv.allocate(seq, len(p))
    logits = [h.run_all_logits([(seq, len(p)) for seq, p in zip(seqs, prompts, strict=True)])]
    for _ in range(12):
        for seq in seqs:
            h.kv.allocate(seq, 1)
        logits.append(h.run_all_logits([(seq, 1) for seq in seqs]))
    if kv_dtype == "int8":
        assert h.pool.dtype == jnp.int8
    h.kv.check_invariants()
    return logits


def test_a_bf16_pool_kept_as_its_bit_patterns_gives_a_bf16_pools_logits(tiny: TinyModel) -> None:
    """On XLA:CPU a bf16 pool is kept as uint16 patterns
    (``kvquant.storage_dtype``): written and read through them, the logits
    are those of a pool of bf16 values, and bf16 rounded the K/V."""
    assert storage_dtype("bfloat16", "cpu") == np.uint16
    assert storage_dtype("bfloat16", "tpu") == jnp.bfloat16
    as_patterns = _int8_run(tiny, "bfloat16", storage=np.uint16)
    as_values = _int8_run(tiny, "bfloat16", storage=jnp.bfloat16)
    exact = _int8_run(tiny, "float32")
    for got, want in zip(as_patterns, as_values, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
    assert max(float(np.abs(a - b).max()) for a, b in zip(as_patterns, exact, strict=True)) > 1e-6


def test_int8_kv_matches_a_dequantised_reference(
    tiny: TinyModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    ours = _int8_run(tiny, "int8")
    exact = _int8_run(tiny, "float32")
    group = tiny.config.kv_geometry("int8").quant_group

    def round_trip(x: jax.Array, dtype: object, width: int) -> jax.Array:
        return dequantise(quantise(x, group), x.shape[-1]).astype(dtype)  # type: ignore[arg-type]

    monkeypatch.setattr(model, "to_pool", round_trip)
    monkeypatch.setattr(model, "is_quantised", lambda dtype: True)  # rotate as int8 does
    reference = _int8_run(tiny, "float32")
    monkeypatch.undo()
    model._traced_block.clear_cache()
    for got, want in zip(ours, reference, strict=True):
        np.testing.assert_allclose(got, want, atol=TOL_INT8, rtol=0)
    # Quantisation really happened, and moved the logits by more than the tolerance.
    assert max(float(np.abs(a - b).max()) for a, b in zip(ours, exact, strict=True)) > TOL_INT8
