import pytest

from kvd.kv import PRESETS, AttentionKind, build_layout, preset
from kvd.kv.geometry import GeometryError, LayerType, uniform_geometry
from kvd.kv.layout import LayoutError

KIB, MIB = 1024, 1024**2


def test_seed_gemma4_12b_bytes_per_token() -> None:
    g = preset("gemma4-12b")
    assert len(g.layers_of(AttentionKind.GLOBAL)) == 8
    assert len(g.layers_of(AttentionKind.SLIDING)) == 40
    assert g.bytes_per_token(AttentionKind.GLOBAL) == 128 * KIB
    assert g.bytes_per_token(AttentionKind.SLIDING) == 320 * KIB
    assert g.layer_kinds[-1] is AttentionKind.GLOBAL  # HF puts full attention last


def test_gemma3_pattern_is_five_sliding_then_one_global() -> None:
    g = preset("gemma3-270m")
    assert g.layers_of(AttentionKind.GLOBAL) == (5, 11, 17)
    assert g.window == 512
    assert g.bytes_per_token_total() == 2 * 18 * 1 * 256 * 2


def test_second_seed_70b_example() -> None:
    g = uniform_geometry("70b", layers=80, kv_heads=8, head_dim=128)
    assert g.bytes_per_token_total() * 131072 == 42_949_672_960  # ~42.9 GB per user
    g64 = uniform_geometry("70b-mha", layers=80, kv_heads=64, head_dim=128)
    assert g64.bytes_per_token_total() * 131072 == 343_597_383_680  # ~344 GB


def test_dtypes() -> None:
    g = preset("gemma3-1b")
    assert g.with_dtype("f32").bytes_per_token_total() == 2 * g.bytes_per_token_total()
    assert g.with_dtype("int8").element_size == 1
    assert g.with_dtype("fp8").element_size == 1
    with pytest.raises(GeometryError, match="unknown KV dtype"):
        g.with_dtype("float64")


def test_invalid_geometries() -> None:
    with pytest.raises(GeometryError):
        LayerType(AttentionKind.SLIDING, 1, 8)  # no window
    with pytest.raises(GeometryError):
        LayerType(AttentionKind.GLOBAL, 1, 8, 16)
    with pytest.raises(GeometryError):
        uniform_geometry("x", layers=4, kv_heads=1, head_dim=8, sliding_layers=2)
    with pytest.raises(GeometryError, match="unknown model preset"):
        preset("gemma9")


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_layout_pages_are_equal_and_cover_every_layer(name: str, block_size: int) -> None:
    g = PRESETS[name]
    layout = build_layout(g, block_size)
    seen: list[int] = []
    for group in layout.groups:
        per_layer = g.bytes_per_token_per_layer(group.kind)
        assert block_size * group.places * per_layer == layout.page_bytes
        assert 1 <= len(group.layers) <= group.places
        assert all(g.layer_kinds[i] is group.kind for i in group.layers)
        seen += group.layers
    assert sorted(seen) == list(range(g.num_layers))
    assert layout.num_groups <= 16


def test_layout_prefers_exact_fit() -> None:
    layout = build_layout(preset("gemma4-12b"), 16)
    assert layout.page_bytes == MIB
    assert [(grp.kind.value, len(grp.layers)) for grp in layout.groups] == [
        ("global", 4),
        ("global", 4),
    ] + [("sliding", 8)] * 5
    assert layout.padded_layer_places() == 0
    assert layout.group_of_layer(5) == (0, 0)


def test_layout_rejects_bad_block_size() -> None:
    with pytest.raises(LayoutError):
        build_layout(preset("gemma3-1b"), 0)


def test_quantisation_groups_divide_every_head_dim() -> None:
    from kvd.kv.geometry import AttentionKind, KVGeometry, LayerType

    mixed = KVGeometry(
        "mixed",
        (AttentionKind.SLIDING, AttentionKind.GLOBAL),
        (
            LayerType(AttentionKind.GLOBAL, 2, 96),
            LayerType(AttentionKind.SLIDING, 2, 64, 8),
        ),
        "int8",
    )
    assert mixed.quant_group == 32
    assert mixed.scale_bytes(AttentionKind.GLOBAL) == 3 * 4
    assert mixed.scale_bytes(AttentionKind.SLIDING) == 2 * 4
    assert mixed.with_dtype("bf16").scale_bytes(AttentionKind.GLOBAL) == 0
