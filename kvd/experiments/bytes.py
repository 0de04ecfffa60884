"""Question 1, the real bytes per token: the seed's formula per layer group
next to what the pool really spends.

For the embedded 270M the allocated side is measured on a real engine: its
pool array's bytes over the tokens that pool holds in every layer (the null
page, padded layer places and block granularity included), plus the block
table entries a token costs. For the seed's Gemma 4 12B the same accounting
runs on the layout the engine would build (no weights needed), at bf16, fp8
and int8; for the 270M the test checks that this accounting equals the real
engine's arrays.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from kvd.experiments.results import ExperimentResult, Say, new_result, pyplot, save_plot, timed
from kvd.experiments.seed import seed_geometry, seed_pool_bytes
from kvd.kv.geometry import KVGeometry
from kvd.kv.layout import PageLayout, build_layout
from kvd.units import parse_size

QUESTION = "the attention configuration, and therefore the real bytes per token"
TABLE_ENTRY_BYTES = 4  # one int32 page index per block per group


class GroupBytes(msgspec.Struct, frozen=True):
    group: int
    kind: str
    layers: int
    places: int  # layer places per page (places - layers are padding)
    formula_bytes_per_token: int  # 2 x layers x kv_heads x head_dim x bytes per element
    page_bytes_per_token: int  # page bytes / block size


class PoolBytes(msgspec.Struct, frozen=True):
    model: str
    dtype: str
    block_size: int
    source: str  # "engine" (a real pool array) or "layout" (the same accounting, no weights)
    groups: list[GroupBytes]
    formula_bytes_per_token: int
    page_bytes_per_token: int  # all groups
    pool_bytes: int  # the pool array, null page included
    token_capacity: int  # tokens resident in every layer at once
    allocated_bytes_per_token: float  # pool bytes / token capacity
    table_bytes_per_token: float  # block-table entries per token
    overhead: float  # (allocated + tables) / formula - 1


def group_bytes(layout: PageLayout) -> list[GroupBytes]:
    geometry = layout.geometry
    rows = []
    for group in layout.groups:
        per_layer = geometry.bytes_per_token_per_layer(group.kind)
        rows.append(
            GroupBytes(
                group=group.index,
                kind=group.kind.value,
                layers=len(group.layers),
                places=group.places,
                formula_bytes_per_token=per_layer * len(group.layers),
                page_bytes_per_token=layout.page_bytes // layout.block_size,
            )
        )
    return rows


def pool_bytes(
    layout: PageLayout, num_pages: int, array_bytes: int, source: str, name: str
) -> PoolBytes:
    """``num_pages`` counts the null page, as the engine's pool does."""
    groups = group_bytes(layout)
    capacity = (num_pages - 1) // layout.num_groups * layout.block_size
    formula = layout.geometry.bytes_per_token_total()
    allocated = array_bytes / capacity
    tables = TABLE_ENTRY_BYTES * layout.num_groups / layout.block_size
    return PoolBytes(
        model=name,
        dtype=layout.geometry.dtype,
        block_size=layout.block_size,
        source=source,
        groups=groups,
        formula_bytes_per_token=formula,
        page_bytes_per_token=sum(g.page_bytes_per_token for g in groups),
        pool_bytes=array_bytes,
        token_capacity=capacity,
        allocated_bytes_per_token=allocated,
        table_bytes_per_token=tables,
        overhead=(allocated + tables) / formula - 1,
    )


def layout_pool(geometry: KVGeometry, pool: int, block_size: int = 16) -> PoolBytes:
    """The pool an engine would allocate for ``pool`` bytes: whole blocks of
    every group, plus the null page."""
    layout = build_layout(geometry, block_size)
    pages = layout.pool_tokens(pool) // block_size * layout.num_groups + 1
    return pool_bytes(layout, pages, pages * layout.page_bytes, "layout", geometry.name)


def engine_pool(quick: bool, pool: int) -> PoolBytes:
    """A real engine's pool array (no warm-up: allocation only)."""
    from kvd.engine.engine import Engine, EngineConfig
    from kvd.engine.loader import EMBEDDED_MODEL, load_model, random_model

    model = random_model(256, 32) if quick else load_model(EMBEDDED_MODEL)
    probe = build_layout(model.config.kv_geometry("float32"), 16)
    engine = Engine(model, EngineConfig(pool_tokens=probe.pool_tokens(pool), max_model_len=256))
    array_bytes = int(engine.pool.nbytes)
    return pool_bytes(engine.layout, engine.num_pages, array_bytes, "engine", model.config.name)


def run(out: Path, quick: bool, say: Say) -> ExperimentResult:
    result = new_result(
        "bytes",
        QUESTION,
        quick,
        ["model", "dtype", "group", "layers/places", "formula B/tok", "page B/tok", "source"],
    )
    with timed(result):
        say("the embedded model's pool, as a real engine allocates it")
        pools = [engine_pool(quick, parse_size("64MiB"))]
        seed = seed_geometry()
        for dtype in ("bfloat16", "fp8", "int8"):
            pools.append(layout_pool(seed.with_dtype(dtype), seed_pool_bytes()))
        for p in pools:
            for g in p.groups:
                result.rows.append(
                    [
                        p.model,
                        p.dtype,
                        f"{g.group} {g.kind}",
                        f"{g.layers}/{g.places}",
                        f"{g.formula_bytes_per_token:,}",
                        f"{g.page_bytes_per_token:,}",
                        p.source,
                    ]
                )
            result.rows.append(
                [
                    p.model,
                    p.dtype,
                    "total",
                    "",
                    f"{p.formula_bytes_per_token:,}",
                    f"{p.allocated_bytes_per_token:,.0f} (+{p.table_bytes_per_token:.1f} tables)",
                    f"{100 * p.overhead:+.2f}%",
                ]
            )
        result.data = {"pools": msgspec.to_builtins(pools)}
        seed_bf16 = pools[1]
        per_kind = {
            kind: sum(g.formula_bytes_per_token for g in seed_bf16.groups if g.kind == kind)
            for kind in ("global", "sliding")
        }
        result.answer = (
            f"Gemma 4 12B at bf16: {per_kind['global'] // 1024} KiB/token on global layers, "
            f"{per_kind['sliding'] // 1024} KiB/token on sliding layers "
            f"({seed_bf16.formula_bytes_per_token // 1024} KiB in all, as the seed says); "
            f"the pool spends {seed_bf16.allocated_bytes_per_token / 1024:,.1f} KiB per token "
            f"({100 * seed_bf16.overhead:+.2f}% with block tables); "
            "fp8 halves it, int8 with its scales (4 bytes per 256 values) nearly. "
            f"The {pools[0].model} here: "
            f"{pools[0].formula_bytes_per_token:,} B/token by the formula, "
            f"{pools[0].allocated_bytes_per_token:,.0f} B measured on its pool "
            f"({100 * pools[0].overhead:+.2f}%)"
        )
        result.notes.append(
            "allocated = pool array bytes / tokens resident in every layer (null page, "
            "padded layer places and whole blocks included); tables = int32 block-table "
            "entries per token"
        )
        _plot(result, pools, out)
    return result


def _plot(result: ExperimentResult, pools: list[PoolBytes], out: Path) -> None:
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(7.5, 3.8))
    x = list(range(len(pools)))
    bottom = [0.0] * len(pools)
    for kind in ("global", "sliding"):
        heights = [
            sum(g.formula_bytes_per_token for g in p.groups if g.kind == kind) / 1024 for p in pools
        ]
        axis.bar(x, heights, 0.5, bottom=bottom, label=f"{kind} layers (formula)")
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    for i, p in enumerate(pools):
        spent = (p.allocated_bytes_per_token + p.table_bytes_per_token) / 1024
        axis.plot([i - 0.3, i + 0.3], [spent, spent], "k-", lw=1.5)
        axis.annotate(
            f"pool {100 * p.overhead:+.2f}%",
            (i, spent),
            textcoords="offset points",
            xytext=(0, 4),
            ha="center",
            fontsize=8,
        )
    axis.plot([], [], "k-", label="allocated per token (pool + tables)")
    axis.set_xticks(x, [f"{p.model}\n{p.dtype}" for p in pools])
    axis.set_ylabel("KiB per token (all layers)")
    axis.set_title("Bytes per token: the seed's formula by layer kind, and what the pool spends")
    axis.legend(fontsize=8)
    save_plot(figure, result, out)
