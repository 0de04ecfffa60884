"""kvctl: the operator's command line for kvd.

``kvctl capacity`` is offline arithmetic (no daemon needed): what a KV pool of
a given size holds for a model, by the seed's eager formulas and by running
kvd's own allocator.
"""

from __future__ import annotations

import click
import msgspec

from kvd.clikit import SizeType, fail, run
from kvd.kv.capacity import CapacityReport, capacity_report
from kvd.kv.geometry import GeometryError, KVGeometry, preset, uniform_geometry
from kvd.kv.layout import LayoutError
from kvd.units import format_iec, format_si


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """Control and inspect a kvd daemon."""


_POSITIVE = click.IntRange(min=1)


@cli.command()
@click.option(
    "--model", help="A model preset, e.g. gemma4-12b (or describe one with the flags below)."
)
@click.option("--pool", type=SizeType(), help="KV pool size, e.g. 3.8GiB or 4GB.")
@click.option("--context", type=_POSITIVE, help="Tokens per sequence to price.")
@click.option(
    "--dtype", default=None, help="KV element type: bfloat16 (default), float32, int8, fp8."
)
@click.option(
    "--block-size", type=_POSITIVE, default=16, show_default=True, help="Tokens per block."
)
@click.option("--layers", type=_POSITIVE, help="Number of layers (all kinds).")
@click.option("--kv-heads", type=_POSITIVE, help="KV heads per layer.")
@click.option("--head-dim", type=_POSITIVE, help="Head dimension.")
@click.option(
    "--sliding-layers", type=click.IntRange(min=0), default=0, help="How many layers slide."
)
@click.option("--sliding-window", type=_POSITIVE, help="Sliding window in tokens.")
@click.option("--sliding-kv-heads", type=_POSITIVE, help="KV heads of sliding layers.")
@click.option("--sliding-head-dim", type=_POSITIVE, help="Head dimension of sliding layers.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def capacity(
    model: str | None,
    pool: int | None,
    context: int | None,
    dtype: str | None,
    block_size: int,
    layers: int | None,
    kv_heads: int | None,
    head_dim: int | None,
    sliding_layers: int,
    sliding_window: int | None,
    sliding_kv_heads: int | None,
    sliding_head_dim: int | None,
    as_json: bool,
) -> None:
    """What a KV pool holds for a model (offline; no daemon needed)."""
    try:
        geometry = _geometry(
            model,
            layers,
            kv_heads,
            head_dim,
            sliding_layers,
            sliding_window,
            sliding_kv_heads,
            sliding_head_dim,
        )
        if dtype is not None:
            geometry = geometry.with_dtype(dtype)
        report = capacity_report(geometry, pool, block_size=block_size, context=context)
    except (GeometryError, LayoutError, ValueError) as exc:
        fail(str(exc))
    if as_json:
        click.echo(msgspec.json.encode(report).decode())
    else:
        click.echo(render_capacity(report))


def _geometry(
    model: str | None,
    layers: int | None,
    kv_heads: int | None,
    head_dim: int | None,
    sliding_layers: int,
    sliding_window: int | None,
    sliding_kv_heads: int | None,
    sliding_head_dim: int | None,
) -> KVGeometry:
    flags = (layers, kv_heads, head_dim)
    if model is not None:
        if any(f is not None for f in flags) or sliding_layers or sliding_window:
            raise GeometryError("give either --model or the architecture flags, not both")
        return preset(model)
    if None in flags:
        raise GeometryError("give --model PRESET, or all of --layers, --kv-heads and --head-dim")
    assert layers is not None and kv_heads is not None and head_dim is not None
    return uniform_geometry(
        "custom",
        layers=layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
        sliding_layers=sliding_layers,
        sliding_window=sliding_window,
        sliding_kv_heads=sliding_kv_heads,
        sliding_head_dim=sliding_head_dim,
    )


def _n(value: int | None) -> str:
    return "unbounded" if value is None else f"{value:,}"


def _table(title: str, rows: list[tuple[str, str]]) -> list[str]:
    width = max(len(label) for label, _ in rows)
    return ["", title] + [f"  {label:<{width}}  {value}" for label, value in rows]


def render_capacity(r: CapacityReport) -> str:
    bpt = r.bytes_per_token
    kinds = f"{r.global_layers} global"
    if r.sliding_layers:
        kinds += f" + {r.sliding_layers} sliding (window {r.window:,})"
    lines = [f"model {r.model} ({r.dtype}): {r.layers} layers = {kinds}"]
    per_token = [("global layers", format_iec(bpt.global_))]
    if r.sliding_layers:
        per_token.append(("sliding layers", format_iec(bpt.sliding)))
    per_token.append(("all layers", format_iec(bpt.total)))
    lines += _table(
        "KV bytes per token (2 x layers x kv_heads x head_dim x bytes per element)", per_token
    )
    if r.context is not None and r.sequence_bytes_at_context is not None:
        per_seq = r.sequence_bytes_at_context
        rows = [("KV cache", f"{format_iec(per_seq)} ({format_si(per_seq)})")]
        if r.sliding_layers and r.eager_sequence_bytes_at_context is not None:
            eager = r.eager_sequence_bytes_at_context
            rows.append(("with the window eager", f"{format_iec(eager)} ({format_si(eager)})"))
        lines += _table(f"one sequence of {r.context:,} tokens", rows)
    if r.pool_bytes is None or r.eager is None or r.kvd is None:
        return "\n".join(lines)
    e, k = r.eager, r.kvd
    lines += ["", f"pool {format_iec(r.pool_bytes)} ({r.pool_bytes:,} bytes)"]
    rows = []
    if r.sliding_layers:
        rows.append(("sliding floor per sequence", format_iec(e.sliding_floor_bytes)))
    rows += [
        ("tokens in the whole pool", f"{e.total_tokens:,}"),
        ("longest single sequence", f"{_n(e.longest_sequence_tokens)} tokens"),
        (
            "max sequences (sliding floor alone)" if r.sliding_layers else "max sequences",
            f"{e.max_sequences:,}",
        ),
    ]
    lines += _table("eager windows (every sequence reserves its whole window at once)", rows)
    rows = []
    if r.sliding_layers:
        rows.append(("sliding KV of a 1-token sequence", format_iec(k.sliding_bytes_first_token)))
    rows += [
        ("tokens in the whole pool", f"{k.total_tokens:,}"),
        ("concurrent 512-token sequences", f"{k.max_sequences_512:,}"),
    ]
    if k.max_sequences_at_context is not None:
        rows.append(
            (f"concurrent {r.context:,}-token sequences", f"{k.max_sequences_at_context:,}")
        )
    rows += [
        ("longest single sequence", f"{_n(k.longest_sequence_tokens)} tokens"),
        (
            "waste bound per sequence",
            f"{format_iec(k.max_waste_bytes_per_sequence)} (one partly filled block per group)",
        ),
    ]
    if k.padded_layer_slots:
        rows.append(("padded layer slots per page", str(k.padded_layer_slots)))
    title = (
        f"kvd allocator (lazy windows, {k.block_size}-token blocks, {format_iec(k.page_bytes)} "
        f"pages in {k.groups} page groups, {k.num_pages:,} pages)"
    )
    lines += _table(title, rows)
    return "\n".join(lines)


def main() -> None:
    run(cli, "kvctl")


if __name__ == "__main__":
    main()
