"""int8 weights (``model.quantization = "int8"``): a GGUF's blocks re-encoded
bit for bit, float checkpoints quantised with a bounded error, the products
in the model equal to the f32 ones on the dequantised weights (summation
order aside), and the engine generating what the f32 engine generates."""

from __future__ import annotations

from copy import deepcopy
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvd.engine import qdense, wquant
from kvd.engine.engine import Engine, EngineConfig
from kvd.engine.gguf import GGUFFile
from kvd.engine.loader import LoadedModel, embedded_gguf_path, load_model, random_model
from kvd.engine.weights import (
    WeightsError,
    gguf_quantization,
    load_hf_directory,
    quantised_params,
)
from kvd.engine.wquant import QuantWeight, dequantize
from kvd.oneshot.batch import BatchGenerator
from kvd.sched.sampling_params import SamplingParams
from tests.engine.conftest import TinyModel, torch

gguf = pytest.importorskip("gguf")

# ggml type id: (values per block, bytes per block, byte offsets of its f16 scales)
FORMATS = {
    wquant.Q8_0: (32, 34, (0,)),
    wquant.Q5_0: (32, 22, (0,)),
    wquant.Q4_K: (256, 144, (0, 2)),
    wquant.Q6_K: (256, 210, (208,)),
}
# f16 scales worth trying: zeros of both signs, subnormals, negatives, large.
SCALES = np.array([0.0, -0.0, 6e-8, -3.5e-5, 1e-7, 0.0123, -2.0, 1000.0], np.float16)


def bits(array: Any) -> np.ndarray[Any, Any]:
    return np.ascontiguousarray(array, np.float32).view(np.uint32)


def assert_product_close(actual: Any, x: Any, matrix: Any) -> None:
    """``actual`` is ``x @ matrix`` up to summation order: within a few f32
    roundings of the sum of the terms' magnitudes (the blocks' random f16
    scales make large terms that cancel, so a bound relative to the result
    itself would not hold for any order but one)."""
    x, matrix = np.asarray(x, np.float64), np.asarray(matrix, np.float64)
    bound = 1e-6 * (np.abs(x) @ np.abs(matrix)) + 1e-30
    error = np.abs(np.asarray(actual, np.float64) - x @ matrix)
    assert np.all(error <= bound), float(np.max(error / bound))


def random_blocks(type_id: int, rows: int, cols: int, seed: int) -> np.ndarray[Any, Any]:
    size, nbytes, scale_at = FORMATS[type_id]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows * cols // size, nbytes), dtype=np.uint8)
    for at in scale_at:
        chosen = rng.choice(SCALES, raw.shape[0]).astype(np.float16)
        raw[:, at : at + 2] = chosen.view(np.uint8).reshape(-1, 2)
    return raw.reshape(-1)


@pytest.mark.parametrize("type_id", sorted(FORMATS))
def test_gguf_blocks_re_encode_bit_for_bit(type_id: int) -> None:
    rows, cols = 6, 512
    raw = random_blocks(type_id, rows, cols, seed=type_id)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(type_id))
    weight = wquant.from_gguf(raw, type_id, (rows, cols))
    assert weight.values.dtype == np.int8 and weight.values.shape == (rows, cols)
    np.testing.assert_array_equal(bits(dequantize(weight)), bits(expected.reshape(rows, cols)))
    # Transposed (the x @ W layout) and in finer blocks with offsets (layers
    # stacked from two formats): still the same numbers.
    flipped = wquant.transposed(weight)
    assert wquant.block_axis(flipped) == -2
    np.testing.assert_array_equal(bits(dequantize(flipped)), bits(expected.reshape(rows, cols).T))
    finer = wquant.regrouped(flipped, 16, with_offset=True)
    np.testing.assert_array_equal(bits(dequantize(finer)), bits(dequantize(flipped)))


def test_regrouping_refuses_what_it_cannot_keep_exactly() -> None:
    weight = wquant.from_gguf(random_blocks(wquant.Q4_K, 2, 256, 0), wquant.Q4_K, (2, 256))
    with pytest.raises(ValueError, match="do not split into blocks of 24"):
        wquant.regrouped(weight, 24, with_offset=True)
    with pytest.raises(ValueError, match="cannot drop them"):
        wquant.regrouped(weight, 16, with_offset=False)
    with pytest.raises(ValueError, match="no int8 re-encoding"):
        wquant.from_gguf(np.zeros(4, np.uint8), 0, (1, 1))


def test_float_matrices_quantise_with_a_bounded_error() -> None:
    matrix = np.random.default_rng(0).standard_normal((48, 256)).astype(np.float32)
    matrix[3] = 0.0  # an all-zero block must not divide by zero
    weight = wquant.quantize_absmax(matrix)
    assert weight.scale.shape == (48, 256 // wquant.HF_BLOCK)
    assert 0 < wquant.relative_error(matrix, weight) < 0.01
    assert not dequantize(weight)[3].any()
    with pytest.raises(ValueError, match="blocks of 32"):
        wquant.quantize_absmax(matrix[:, :40])


def test_the_embedded_gguf_loads_as_int8_bit_for_bit_and_a_third_of_the_bytes() -> None:
    exact = load_model("gemma3-270m", "float32")
    kept = load_model("gemma3-270m", "float32", "auto")  # all blocks: "auto" is int8
    assert kept.quantization == "int8" and kept.quantization_error == 0.0
    assert kept.weight_bytes < 0.3 * exact.weight_bytes
    pairs = [(exact.params["embed"], kept.params["embed"], "embed")]
    for i, (ours, theirs) in enumerate(
        zip(exact.params["layers"], kept.params["layers"], strict=True)
    ):
        pairs += [(ours[name], theirs[name], f"layers.{i}.{name}") for name in ours]
    forms = {}
    for f32, int8, name in pairs:
        if isinstance(int8, QuantWeight):
            np.testing.assert_array_equal(bits(dequantize(int8)), bits(f32), err_msg=name)
            forms.setdefault(name.rsplit(".", 1)[-1], set()).add(
                (wquant.block_size(int8), int8.offset is not None)
            )
        else:  # norms stay floats
            np.testing.assert_array_equal(int8, f32, err_msg=name)
    # One form per field in every layer (they stack); down mixes Q6_K and Q4_K.
    assert all(len(found) == 1 for found in forms.values()), forms
    assert forms["down"] == {(16, True)}


def test_a_bfloat16_checkpoint_quantises_tensor_by_tensor(tiny3: TinyModel, tmp_path: Path) -> None:
    path = tmp_path / "bf16"
    copy = deepcopy(tiny3.hf).to(torch.bfloat16)
    copy.save_pretrained(path, safe_serialization=True)
    _, floats = load_hf_directory(path, np.float32)
    errors: dict[str, float] = {}
    _, params = load_hf_directory(path, np.float32, "int8", errors)
    assert isinstance(params["embed"], QuantWeight)
    assert set(errors) >= {"embed", "layers.0.q", "layers.6.down"}
    assert 0 < max(errors.values()) < 0.01
    for ours, theirs in zip(floats["layers"], params["layers"], strict=True):
        np.testing.assert_array_equal(ours["attn_norm"], theirs["attn_norm"])  # norms as they were
        error = np.abs(dequantize(theirs["gate"]) - ours["gate"]).max()
        assert error <= np.abs(ours["gate"]).max() / 127
    with pytest.raises(WeightsError, match="quantization 'int4'"):
        load_hf_directory(path, np.float32, "int4")


@pytest.mark.parametrize("rows", [1, 2, 4, 8, 33])
def test_products_equal_the_dequantised_f32_products(rows: int, monkeypatch: Any) -> None:
    """Both forms (fused at few rows, dequantised first at many; the head in
    vocabulary chunks with a remainder) against x @ W on the f32 numbers."""
    monkeypatch.setattr(qdense, "HEAD_CHUNK", 48)  # 200 = 4 chunks and 8 rows
    rng = np.random.default_rng(rows)
    layer = wquant.transposed(
        wquant.from_gguf(random_blocks(wquant.Q4_K, 64, 256, 1), wquant.Q4_K, (64, 256))
    )
    embed = wquant.quantize_absmax(rng.standard_normal((200, 64)).astype(np.float32))
    x = rng.standard_normal((rows, 256)).astype(np.float32)
    last = rng.standard_normal((rows, 64)).astype(np.float32)
    dense = jax.jit(qdense.dense)(jnp.asarray(x), jax.device_put(layer))
    assert_product_close(dense, x, dequantize(layer))
    logits = jax.jit(qdense.output_logits)(jax.device_put(embed), jnp.asarray(last))
    assert logits.shape == (rows, 200)
    np.testing.assert_allclose(logits, last @ dequantize(embed).T, rtol=2e-5, atol=2e-5)
    tokens = jnp.asarray(rng.integers(0, 200, rows), jnp.int32)
    rows_out = jax.jit(qdense.embedding_rows, static_argnums=2)(
        jax.device_put(embed), tokens, jnp.float32
    )
    np.testing.assert_array_equal(bits(rows_out), bits(dequantize(embed)[np.asarray(tokens)]))


@pytest.mark.parametrize("rows", [1, 3])
def test_a_one_token_product_reads_the_transposed_twin_and_larger_ones_the_matrix(
    rows: int,
) -> None:
    """A ``OneRowTwin`` of a Q4_K matrix (scales and mins) and one of a Q6_K
    matrix (scales alone): one token multiplies by ``rows``, more tokens by
    ``weight``, alone and in a group. Each twin here pairs a matrix with the
    transpose of a different one, so the product shows which was read."""
    rng = np.random.default_rng(rows)
    with_mins, scales_only = (
        wquant.transposed(wquant.from_gguf(random_blocks(kind, 64, 256, seed), kind, (64, 256)))
        for kind, seed in ((wquant.Q4_K, 1), (wquant.Q6_K, 2))
    )
    twins, expected = [], []
    for matrix, other in ((with_mins, scales_only), (scales_only, with_mins)):
        twin = qdense.OneRowTwin(matrix, wquant.transposed(other))
        twins.append(jax.device_put(twin))
        expected.append(dequantize(other if rows == 1 else matrix))
    x = rng.standard_normal((rows, 256)).astype(np.float32)
    assert_product_close(jax.jit(qdense.dense)(jnp.asarray(x), twins[0]), x, expected[0])
    grouped = jax.jit(qdense.dense_group)(jnp.asarray(x), twins)
    for product, matrix in zip(grouped, expected, strict=True):
        assert_product_close(product, x, matrix)


def test_on_the_cpu_each_int8_layer_matrix_gains_its_twin_and_the_bytes_are_counted() -> None:
    model = random_model(512, sliding_window=16, seed=3, quantization="int8")
    engine = _engine(model)
    layer = engine.params["layers"][0]
    for name in ("q", "k", "v", "o", "gate", "up", "down"):
        twin = layer[name]
        assert isinstance(twin, qdense.OneRowTwin)
        assert twin.rows.values.shape == twin.weight.values.shape[::-1]
    matrices = [m for layer in model.params["layers"] for m in layer.values()]
    quantised = [m for m in matrices if isinstance(m, QuantWeight)]
    twins = sum(a.nbytes for m in quantised for a in m if a is not None)
    assert engine.one_row_twin_bytes == twins > 0
    assert engine.bytes_here()["weight_bytes_per_host"] == model.weight_bytes + twins
    f32 = _engine(random_model(512, sliding_window=16, seed=3))  # float weights: no twins
    assert f32.one_row_twin_bytes == 0


@pytest.mark.parametrize("accelerator", [False, True])
def test_past_one_row_the_head_is_chunked_on_the_cpu_and_one_product_elsewhere(
    accelerator: bool, monkeypatch: Any
) -> None:
    """XLA:CPU needs the output projection in vocabulary chunks past one row;
    on an accelerator their sequential loop is the slow part, so the head is
    one product there: no loop in the program, the same logits."""
    monkeypatch.setattr(qdense, "HEAD_CHUNK", 48)
    monkeypatch.setattr(qdense, "_fuses_any_rows", lambda: accelerator)
    rng = np.random.default_rng(3)
    embed = jax.device_put(wquant.quantize_absmax(rng.standard_normal((200, 64), np.float32)))
    last = rng.standard_normal((5, 64)).astype(np.float32)

    def head(embed: Any, last: jax.Array) -> jax.Array:  # new per case: JAX caches traces
        return qdense.output_logits(embed, last)

    program = str(jax.make_jaxpr(head)(embed, jnp.asarray(last)))
    assert ("scan" in program) is not accelerator
    logits = jax.jit(head)(embed, jnp.asarray(last))
    np.testing.assert_allclose(logits, last @ dequantize(embed).T, rtol=2e-5, atol=2e-5)


def test_auto_is_int8_on_the_cpu_and_the_float_load_on_an_accelerator() -> None:
    with GGUFFile(embedded_gguf_path()) as file:
        assert gguf_quantization(file, "auto", "cpu") == "int8"
        for backend in ("gpu", "tpu"):
            assert gguf_quantization(file, "auto", backend) == "none"
            assert gguf_quantization(file, "int8", backend) == "int8"  # still a choice


def _engine(model: LoadedModel) -> Engine:
    return Engine(
        model,
        EngineConfig(
            max_model_len=128, max_num_seqs=4, max_num_batched_tokens=16, pool_tokens=1024
        ),
    )


def test_an_int8_engine_generates_what_the_f32_engine_generates() -> None:
    """The tiny model in int8 against the same weights dequantised to f32:
    alone (the fused products) and four at once (dequantised first), through
    the scanned layers, the chunked head and sampling; nothing compiles late."""
    int8 = random_model(512, sliding_window=16, seed=3, quantization="int8")
    f32 = random_model(512, sliding_window=16, seed=3)
    f32.params = jax.tree.map(
        lambda leaf: dequantize(leaf) if isinstance(leaf, QuantWeight) else leaf,
        int8.params,
        is_leaf=lambda leaf: isinstance(leaf, QuantWeight),
    )
    assert int8.weight_bytes < 0.35 * f32.weight_bytes
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 512, n).tolist() for n in (5, 23, 40, 9)]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    runs = {}
    for name, model in (("int8", int8), ("f32", f32)):
        engine = _engine(model)
        if name == "int8":  # the reference compiles what it runs, no more
            engine.warm_up()
        generator = BatchGenerator(engine)
        alone = generator.generate(prompts[:1], [greedy])
        together = generator.generate(prompts, [greedy] * len(prompts))
        runs[name] = [g.completion_ids for g in alone + together]
        if name == "int8":
            assert engine.late_compiles == 0
    assert runs["int8"] == runs["f32"]


def test_int8_tensor_parallel_needs_block_aligned_rows() -> None:
    from kvd.engine.sharding import ShardingError, check_weight_blocks

    model = random_model(512, sliding_window=16, quantization="int8")
    assert model.params["layers"][0]["o"].values.shape == (32, 32)  # one block of rows
    check_weight_blocks(model.params, 1)
    with pytest.raises(ShardingError, match=r"weight o \(32 rows in blocks of 32\) does not split"):
        check_weight_blocks(model.params, 2)


def test_quantised_params_leave_norms_and_quantise_every_matrix() -> None:
    model = random_model(512, sliding_window=16, quantization="auto")
    assert model.quantization == "none"  # float weights: int8 would not be exact
    params = quantised_params(model.params)
    assert isinstance(params["embed"], QuantWeight)
    layer = params["layers"][0]
    assert {name for name, v in layer.items() if isinstance(v, QuantWeight)} == {
        "q", "k", "v", "o", "gate", "up", "down"
    }  # fmt: skip
    assert not isinstance(layer["attn_norm"], QuantWeight)
