"""The seed's figures, and what kvd's allocator achieves, through the library."""

import math

from kvd.kv import preset
from kvd.kv.capacity import capacity_report
from kvd.kv.geometry import uniform_geometry

GIB, MIB, KIB = 1024**3, 1024**2, 1024
POOL = int(3.8 * GIB)


def test_seed_eager_figures_for_gemma4_12b() -> None:
    r = capacity_report(preset("gemma4-12b"), POOL)
    assert (r.bytes_per_token.global_, r.bytes_per_token.sliding) == (128 * KIB, 320 * KIB)
    assert r.eager is not None
    assert r.eager.sliding_floor_bytes == 320 * MIB
    assert r.eager.total_tokens == 8894
    assert abs(r.eager.longest_sequence_tokens - 28570) <= 1  # 28,569.6: 28,569 fit
    assert r.eager.max_sequences == 12


def test_kvd_allocator_beats_the_eager_floor() -> None:
    r = capacity_report(preset("gemma4-12b"), POOL)
    assert r.kvd is not None
    assert r.kvd.max_sequences_512 == 17  # lazy windows: 17 where the eager floor allows 12
    assert r.kvd.page_bytes == MIB and r.kvd.groups == 7 and r.kvd.num_pages == 3890
    # One global block granule short of the eager figure: the window is paid in
    # blocks, and the null page is not allocatable.
    assert 28_400 <= r.kvd.longest_sequence_tokens <= r.eager.longest_sequence_tokens
    assert r.kvd.sliding_bytes_first_token == 5 * MIB  # one block per sliding group, not 320 MiB


def test_context_pricing_and_the_second_seed() -> None:
    gqa = capacity_report(
        uniform_geometry("70b", layers=80, kv_heads=8, head_dim=128), context=131072
    )
    assert gqa.sequence_bytes_at_context == 42_949_672_960
    mha = capacity_report(
        uniform_geometry("mha", layers=80, kv_heads=64, head_dim=128), context=131072
    )
    assert mha.sequence_bytes_at_context == 343_597_383_680
    assert gqa.eager is None and gqa.kvd is None  # no pool given


def test_256k_context_on_gemma4_12b_exceeds_the_chip() -> None:
    r = capacity_report(preset("gemma4-12b"), POOL, context=256 * 1024)
    # The seed: about 32.3 GiB for a 256K context (global layers never stop growing).
    assert r.sequence_bytes_at_context is not None
    assert round(r.sequence_bytes_at_context / GIB, 1) == 32.3
    assert r.kvd is not None and r.kvd.max_sequences_at_context == 0


def test_sliding_only_models_have_no_length_bound() -> None:
    g = uniform_geometry(
        "swa", layers=4, kv_heads=1, head_dim=64, sliding_layers=4, sliding_window=64
    )
    r = capacity_report(g, 64 * MIB)
    assert r.eager is not None and r.eager.longest_sequence_tokens is None
    assert r.kvd is not None and r.kvd.longest_sequence_tokens is None


def test_int8_counts_its_scales_and_still_fits_34_sequences_of_512() -> None:
    """int8 K/V pays a 4-byte f32 scale per 256 values (Gemma 4's 512-wide global
    rows carry two), so it is not quite half of bf16; the layout keeps its 7
    equal groups and no padding, and 34 sequences of 512 tokens fit 3.8 GiB."""
    geometry = preset("gemma4-12b").with_dtype("int8")
    assert geometry.quant_group == 256
    r = capacity_report(geometry, POOL)
    assert r.bytes_per_token.global_ == 8 * 2 * 8 * (512 + 8)
    assert r.bytes_per_token.sliding == 40 * 2 * 8 * (256 + 4)
    assert r.kvd is not None
    assert r.kvd.groups == 7 and r.kvd.padded_layer_places == 0
    assert r.kvd.max_sequences_512 >= 34


def test_int8_holds_at_least_1_9x_the_tokens_of_bf16_in_the_same_bytes() -> None:
    for name in ("gemma3-270m", "gemma4-12b", "gemma3-27b"):
        bf16 = capacity_report(preset(name).with_dtype("bf16"), POOL).kvd
        int8 = capacity_report(preset(name).with_dtype("int8"), POOL).kvd
        assert bf16 is not None and int8 is not None
        assert int8.total_tokens >= 1.9 * bf16.total_tokens, name


def test_parameter_counts_are_the_engine_presets() -> None:
    from kvd.engine.config import PRESETS
    from kvd.engine.weights import expected_shapes
    from kvd.kv.capacity import PARAMETERS

    for name, config in PRESETS.items():
        layers = sum(
            math.prod(shape)
            for layer in range(config.num_layers)
            for shape in expected_shapes(config, layer).values()
        )
        assert (
            PARAMETERS[name] == config.vocab_size * config.hidden_size + config.hidden_size + layers
        )


def test_hidden_widths_are_the_engine_presets() -> None:
    from kvd.engine.config import PRESETS
    from kvd.kv.capacity import HIDDEN, VOCAB

    for name, config in PRESETS.items():
        assert HIDDEN[name] == config.hidden_size and config.vocab_size == VOCAB, name


def test_a_model_over_several_devices() -> None:
    """The embedding on every device, the rest divided; the pool split over
    the devices only where every layer kind's KV heads divide over them."""
    from kvd.kv.capacity import GIB, HIDDEN, PARAMETERS, VOCAB, pool_splits, weights_fits

    geometry = preset("gemma4-31b")
    assert not pool_splits(geometry, 8)  # 4 global KV heads of 512, 16 sliding of 256
    assert pool_splits(preset("gemma3-27b"), 8) and not pool_splits(preset("gemma3-27b"), 32)
    embed = VOCAB * HIDDEN["gemma4-31b"]
    memory, overhead = 16 * GIB, 2 * GIB
    one = weights_fits(geometry, PARAMETERS["gemma4-31b"], memory, overhead)
    eight = weights_fits(geometry, PARAMETERS["gemma4-31b"], memory, overhead, 16, 8, embed)
    bf16 = next(f for f in eight if f.weights == "bfloat16")
    assert bf16.weight_bytes_per_device == int(
        2 * embed + 2 * (PARAMETERS["gemma4-31b"] - embed) / 8
    )
    assert (
        bf16.pool_bytes
        == bf16.pool_bytes_per_device
        == memory - bf16.weight_bytes_per_device - overhead
    )
    assert bf16.max_sequences_512 > 0
    assert next(f for f in one if f.weights == "bfloat16").pool_bytes == 0  # 57 GiB on one chip
    split = weights_fits(
        preset("gemma3-27b"), PARAMETERS["gemma3-27b"], memory, overhead, 16, 8, embed
    )
    assert all(f.pool_bytes == 8 * f.pool_bytes_per_device for f in split)
