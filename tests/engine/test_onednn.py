"""oneDNN's bf16 products (``model.matmul = "onednn"``): each product equals
the f32 product of its bf16-rounded operands, an engine on them scores what
the XLA engine scores within bf16's precision, compiles nothing late, and
refuses what it cannot run with a clear error."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from kvd.engine import onednn
from kvd.engine.engine import Engine, EngineConfig, EngineError
from kvd.engine.loader import LoadedModel, random_model
from kvd.oneshot.batch import BatchGenerator
from kvd.sched.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(
    onednn.unavailable_reason() is not None, reason=str(onednn.unavailable_reason())
)


def rounded(array: Any) -> np.ndarray[Any, Any]:
    return np.asarray(array, ml_dtypes.bfloat16).astype(np.float64)


def assert_bf16_product(actual: Any, x: Any, matrix: Any) -> None:
    """``actual`` is the product of the bf16-rounded operands, accumulated in
    f32: within a few f32 roundings of the sum of the terms' magnitudes."""
    x, matrix = rounded(x), rounded(matrix)
    bound = 1e-5 * (np.abs(x) @ np.abs(matrix)) + 1e-30
    assert np.all(np.abs(np.asarray(actual, np.float64) - x @ matrix) <= bound)


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_products_are_the_f32_products_of_bf16_operands(rows: int) -> None:
    rng = np.random.default_rng(rows)
    weight = rng.standard_normal((96, 80)).astype(np.float32)
    x = rng.standard_normal((rows, 96)).astype(ml_dtypes.bfloat16)
    packed = onednn.PackedMatrix(weight)
    assert_bf16_product(packed.product(x), x, weight)


@pytest.mark.parametrize("rows", [1, 7])
def test_programs_reach_the_products_and_hear_of_a_failure(rows: int) -> None:
    """Inside a jitted program (XLA's FFI call): two products sharing one
    input, the output projection (a row of logits per input row), and a slot that names no
    matrix fails the call with the reason instead of writing nothing."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, 96)).astype(np.float32)
    first, second = (rng.standard_normal((96, n)).astype(np.float32) for n in (80, 16))
    embed = rng.standard_normal((300, 96)).astype(np.float32)
    prepared, slots = onednn.prepare({"layers": [{"q": first, "k": second}], "embed": embed})
    layer = prepared["layers"][0]

    @jax.jit
    def run(x: Any, head: onednn.OnednnWeight) -> Any:
        q, k = onednn.dense_many(x, [layer["q"], layer["k"]])
        return q, k, onednn.output_logits(head, x)

    try:
        q, k, logits = run(jnp.asarray(x), prepared["embed"])
        assert_bf16_product(q, x, first)
        assert_bf16_product(k, x, second)
        assert logits.shape == (rows, 300)  # the sampler's layout
        assert_bf16_product(logits, x, embed.T)
        missing = onednn.OnednnWeight(prepared["embed"].weight, jnp.asarray(10**6, jnp.int32))
        with pytest.raises(Exception, match="oneDNN product failed: KeyError"):
            jax.block_until_ready(run(jnp.asarray(x), missing))
    finally:
        onednn.REGISTRY.release(slots)


def _engine(model: LoadedModel, matmul: str, **kwargs: Any) -> Engine:
    config = EngineConfig(
        max_model_len=160,
        max_num_seqs=4,
        max_num_batched_tokens=256,
        pool_tokens=2048,
        matmul=matmul,
        **kwargs,
    )
    return Engine(model, config)


def _matrices(engine: Engine) -> list[Any]:
    return [onednn.REGISTRY.get(slot) for slot in engine._onednn_slots]


def test_an_onednn_engine_scores_what_the_xla_engine_scores() -> None:
    """Four prompts prefilled in one step (142 tokens: the layers' products
    on oneDNN) and decoded together (four rows: the output projection on
    oneDNN): while the two engines' greedy tokens agree, every token's top
    alternatives carry the same logprobs within bf16's precision."""
    model = random_model(512, sliding_window=16, seed=5)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 512, n).tolist() for n in (70, 23, 40, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, top_logprobs=5)
    runs = {}
    for matmul in ("onednn", "xla"):
        engine = _engine(model, matmul)
        assert engine.matmul == matmul
        if matmul == "onednn":
            engine.warm_up()
        runs[matmul] = BatchGenerator(engine).generate(prompts, [params] * len(prompts))
        if matmul == "onednn":
            assert engine.late_compiles == 0
            calls = [matrix.calls for matrix in _matrices(engine)]
            assert calls[-1] > 0  # the output projection (the last slot)
            assert max(calls[:-1]) > 0  # the layers' products, in the prefill step
    compared = 0
    for ours, theirs in zip(runs["onednn"], runs["xla"], strict=True):
        for position, (a, b) in enumerate(zip(ours.alternatives, theirs.alternatives, strict=True)):
            assert a is not None and b is not None
            ours_by_token, theirs_by_token = dict(a), dict(b)
            for token in set(ours_by_token) & set(theirs_by_token):
                # bf16 keeps 8 bits: a logprob of -13 may move by 0.06
                expected = theirs_by_token[token]
                assert abs(ours_by_token[token] - expected) <= 0.02 + 0.01 * abs(expected)
            compared += 1
            if ours.completion_ids[position] != theirs.completion_ids[position]:
                break
    assert compared >= 4 * 4  # decode steps, not the first token alone


def test_the_matmul_choice_fails_clearly_where_it_cannot_run() -> None:
    model = random_model(512, sliding_window=16)
    with pytest.raises(EngineError, match="matmul 'fast' is not one of auto, xla, onednn"):
        _engine(model, "fast")
    with pytest.raises(EngineError, match="one CPU device, with unstacked layers"):
        _engine(model, "onednn", scan_layers=True)
    assert _engine(model, "auto", scan_layers=True).matmul == "xla"
    assert _engine(model, "auto").matmul == "onednn"


def test_an_engine_lets_its_prepared_matrices_go() -> None:
    engine = _engine(random_model(512, sliding_window=16), "onednn")
    slots = list(engine._onednn_slots)
    assert slots
    # Each matrix's going destroys its native copy and kernels (finalizers).
    matrices = [weakref.ref(onednn.REGISTRY.get(slot)) for slot in slots]
    del engine
    gc.collect()
    for slot in slots:
        with pytest.raises(KeyError):
            onednn.REGISTRY.get(slot)
    assert all(matrix() is None for matrix in matrices)


def test_a_library_that_does_not_load_leaves_xla(tmp_path: Any, monkeypatch: Any) -> None:
    """A libdnnl that is there but does not load (on a machine without the
    libgomp it needs, say): ``auto`` keeps XLA's products, ``onednn`` says why."""
    broken = tmp_path / "libdnnl.so.3"
    broken.write_text("not a library")
    monkeypatch.setattr(onednn, "_library_path", lambda: broken)
    monkeypatch.setattr(onednn, "_dnnl", None)
    reason = onednn.unavailable_reason()
    assert reason is not None and reason.startswith(f"cannot load {broken}")
    model = random_model(512, sliding_window=16)
    assert _engine(model, "auto").matmul == "xla"
    with pytest.raises(EngineError, match="matmul onednn: cannot load"):
        _engine(model, "onednn")


def test_an_ffi_of_another_version_leaves_xla(tmp_path: Any, monkeypatch: Any) -> None:
    """The handler reads XLA's call frames by offset (the FFI's C API 0.x): a
    jax whose FFI is another major version makes ``auto`` keep XLA's products."""
    import jax

    header = tmp_path / "xla" / "ffi" / "api" / "c_api.h"
    header.parent.mkdir(parents=True)
    header.write_text("#define XLA_FFI_API_MAJOR 1\n#define XLA_FFI_API_MINOR 0\n")
    monkeypatch.setattr(jax.ffi, "include_dir", lambda: str(tmp_path))
    reason = onednn.unavailable_reason()
    assert reason is not None and "not the C API 0.x" in reason
    model = random_model(512, sliding_window=16)
    assert _engine(model, "auto").matmul == "xla"
    with pytest.raises(EngineError, match="not the C API 0.x"):
        _engine(model, "onednn")
