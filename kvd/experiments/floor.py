"""Question 2, the sliding-window floor: is it paid in full, or lazily?

Concurrent sequences a pool holds, as a function of sequence length. *Eager*
is the seed's model: every sequence reserves its whole window on every
sliding layer up front, and its global layers grow per token. *kvd* is not a
formula: the real KV core fills an empty pool with sequences of that length,
computed a block at a time (lazy windows, released blocks, page groups, block
granularity), until it refuses. Gemma 4 12B in the seed's 3.8 GiB pool needs
no weights (the KV core is pure Python); the 270M curve uses the pool the
daemon allocates here for a 256 MiB pool (its layout and page count, f32 K/V
as on CPU; `kvd experiment bytes` checks that layout against a real engine).
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from kvd.experiments.results import ExperimentResult, Say, new_result, pyplot, save_plot, timed
from kvd.experiments.seed import seed_geometry, seed_pool_bytes
from kvd.kv.capacity import bytes_per_token, capacity_report, eager_capacity, max_sequences
from kvd.kv.geometry import KVGeometry, preset
from kvd.kv.layout import build_layout
from kvd.units import parse_size

QUESTION = (
    "whether the 320 MiB-per-sequence sliding-layer floor is really paid in full, or "
    "allocated lazily until a sequence reaches its window"
)
HERE_POOL = "256MiB"  # kvd bench flood's pool for the 270M


class FloorPoint(msgspec.Struct, frozen=True):
    length: int
    eager: int
    kvd: int


class FloorCurve(msgspec.Struct, frozen=True):
    model: str
    pool_bytes: int
    block_size: int
    window: int | None
    eager_floor_bytes: int
    points: list[FloorPoint]


def eager_sequences(geometry: KVGeometry, pool: int, length: int) -> int:
    """The seed's eager model: the whole window reserved, global layers per token."""
    bpt = bytes_per_token(geometry)
    floor = eager_capacity(geometry, pool).sliding_floor_bytes
    return pool // (floor + bpt.global_ * length)


def curve(geometry: KVGeometry, pool: int, lengths: list[int], block_size: int = 16) -> FloorCurve:
    points = [
        FloorPoint(
            n, eager_sequences(geometry, pool, n), max_sequences(geometry, pool, block_size, n)
        )
        for n in lengths
    ]
    return FloorCurve(
        model=geometry.name,
        pool_bytes=pool,
        block_size=block_size,
        window=geometry.window,
        eager_floor_bytes=eager_capacity(geometry, pool).sliding_floor_bytes,
        points=points,
    )


def lengths_for(quick: bool, longest: int) -> list[int]:
    top = 2048 if quick else longest
    lengths, n = [], 64
    while n <= top:
        lengths.append(n)
        n *= 2
    return lengths


def run(out: Path, quick: bool, say: Say) -> ExperimentResult:
    result = new_result(
        "floor", QUESTION, quick, ["model", "pool", "length", "eager seqs", "kvd seqs", "kvd/eager"]
    )
    with timed(result):
        seed = seed_geometry()
        say("Gemma 4 12B in the seed's 3.8 GiB pool, through the KV core")
        curves = [curve(seed, seed_pool_bytes(), lengths_for(quick, 32768))]
        say("the embedded 270M's pool as the daemon sizes it here, through the KV core")
        here = preset("gemma3-270m").with_dtype("float32")  # the engine's KV dtype on CPU
        layout = build_layout(here, 16)
        pages = layout.pool_tokens(parse_size(HERE_POOL)) // 16 * layout.num_groups
        curves.append(curve(here, pages * layout.page_bytes, lengths_for(quick, 32768)))
        for c in curves:
            for p in c.points:
                result.rows.append(
                    [
                        c.model,
                        f"{c.pool_bytes / 2**30:.2f} GiB",
                        f"{p.length:,}",
                        f"{p.eager:,}",
                        f"{p.kvd:,}",
                        f"{p.kvd / p.eager:.1f}x" if p.eager else "-",
                    ]
                )
        capacity = capacity_report(seed, seed_pool_bytes())
        result.data = {
            "curves": msgspec.to_builtins(curves),
            "seed_pool": msgspec.to_builtins(capacity),  # what `kvctl capacity` prints
        }
        seed_curve = curves[0]
        short = seed_curve.points[0]
        at_window = next(
            (p for p in seed_curve.points if p.length >= (seed.window or 0)), seed_curve.points[-1]
        )
        result.answer = (
            f"lazily: kvd never pays the {seed_curve.eager_floor_bytes / 2**20:.0f} MiB floor "
            f"for a short sequence. Gemma 4 12B in 3.8 GiB holds {short.kvd:,} concurrent "
            f"{short.length}-token sequences against the eager {short.eager}; at "
            f"{at_window.length:,} tokens {at_window.kvd} against {at_window.eager}"
        )
        result.notes.append(
            "eager: the seed's model (window reserved up front, global layers per token); "
            "kvd: the KV core filling an empty pool a block at a time until it refuses"
        )
        _plot(result, curves, out)
    return result


def _plot(result: ExperimentResult, curves: list[FloorCurve], out: Path) -> None:
    plt = pyplot()
    figure, axes = plt.subplots(1, len(curves), figsize=(10, 3.8))
    for axis, c in zip(axes, curves, strict=True):
        eager = [(p.length, p.eager) for p in c.points if p.eager]  # log scale: no zeros
        lazy = [(p.length, p.kvd) for p in c.points if p.kvd]
        axis.plot(*zip(*eager, strict=True), "o--", label="eager windows")
        axis.plot(*zip(*lazy, strict=True), "o-", label="kvd (lazy, measured)")
        if c.window:
            axis.axvline(c.window, color="grey", lw=0.8, ls=":", label=f"window {c.window}")
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("sequence length (tokens)")
        axis.set_ylabel("concurrent sequences")
        axis.set_title(f"{c.model}, {c.pool_bytes / 2**30:.2f} GiB pool")
        axis.legend(fontsize=8)
    save_plot(figure, result, out)
