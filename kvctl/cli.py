"""kvctl: the operator's command line for kvd.

Live commands talk to a running daemon over its admin socket (``--socket``,
``$KVD_ADMIN_SOCKET`` or /run/kvd/admin.sock). ``kvctl capacity`` is offline
arithmetic (no daemon needed): what a KV pool of a given size holds for a
model, by the seed's eager formulas and by running kvd's own allocator.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

import click
import msgspec

from kvctl import admin
from kvd.clikit import FiniteFloat, SizeType, fail, run
from kvd.kv.capacity import (
    HIDDEN,
    PARAMETERS,
    SEED_OVERHEAD,
    VOCAB,
    WEIGHT_FORMATS,
    CapacityReport,
    WeightsFit,
    capacity_report,
    weights_fits,
)
from kvd.kv.geometry import GeometryError, KVGeometry, preset, uniform_geometry
from kvd.kv.layout import LayoutError
from kvd.units import format_iec, format_si


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--socket",
    envvar="KVD_ADMIN_SOCKET",
    default=admin.DEFAULT_SOCKET,
    show_default=True,
    help="The daemon's admin socket (or set KVD_ADMIN_SOCKET).",
)
def cli(socket: str) -> None:
    """Control and inspect a kvd daemon."""


_JSON = click.option("--json", "as_json", is_flag=True, help="Print JSON.")


@cli.command()
@_JSON
@click.pass_context
def status(ctx: click.Context, as_json: bool) -> None:
    """Pool, tenants, prefixes, queues, measured rates, draining state."""
    admin.emit(admin.client(ctx).request("GET", "/v1/status"), as_json, admin.render_status)


@cli.command()
@click.option("--interval", type=FiniteFloat(min=0.1), default=1.0, show_default=True)
@click.option("--iterations", type=click.IntRange(min=1), help="Stop after N refreshes.")
@click.pass_context
def top(ctx: click.Context, interval: float, iterations: int | None) -> None:
    """A live view of the pool and the tenants, refreshed until Ctrl-C."""
    c = admin.client(ctx)
    count = 0
    try:
        while iterations is None or count < iterations:
            view = admin.render_status(c.request("GET", "/v1/status"))
            clear = "\x1b[H\x1b[2J" if sys.stdout.isatty() else ""
            click.echo(f"{clear}{view}\n")
            count += 1
            if iterations is None or count < iterations:
                time.sleep(interval)
    except KeyboardInterrupt:
        pass


@cli.group()
def tenant() -> None:
    """List, add, change and remove tenants."""


def _tenant_options(f: Any) -> Any:
    options = [
        click.option("--key", help="The tenant's API key (sent as its SHA-256 only)."),
        click.option("--key-sha256", help="The SHA-256 hex digest of the API key."),
        click.option("--reservation", help="Guaranteed pages: a share ('25%') or a size."),
        click.option("--burst-cap", help="Most pages at once: a share, a size, or 'none'."),
        click.option("--tier", help="The most important tier the tenant may use."),
        click.option("--weight", type=FiniteFloat(min=0, min_open=True)),
        click.option("--rpm", help="Requests per minute, or 'unlimited'."),
        click.option("--tpm", help="Tokens per minute, or 'unlimited'."),
        click.option("--max-queue", type=click.IntRange(min=1)),
        click.option(
            "--swap", help="Host swap it may hold: a share of swap_space ('50%'), a size, or 'all'."
        ),
        click.option(
            "--host-quota",
            help="Host cache it may hold: a share of pool.host_size ('25%'), a size or 'all'.",
        ),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def _tenant_fields(
    key: str | None,
    key_sha256: str | None,
    reservation: str | None,
    burst_cap: str | None,
    tier: str | None,
    weight: float | None,
    rpm: str | None,
    tpm: str | None,
    max_queue: int | None,
    swap: str | None,
    host_quota: str | None,
) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "api_key_sha256": admin.key_digest(key, key_sha256),
        "reservation": reservation,
        "burst_cap": burst_cap,
        "tier": tier,
        "weight": weight,
        "max_queue": max_queue,
        "swap": swap,
        "host_quota": host_quota,
    }
    fields = {k: v for k, v in fields.items() if v is not None}
    if fields.get("burst_cap") == "none":
        fields["burst_cap"] = None
    for key in ("swap", "host_quota"):
        if fields.get(key) == "all":
            fields[key] = None
    for name, value, option in (
        ("requests_per_minute", rpm, "--rpm"),
        ("tokens_per_minute", tpm, "--tpm"),
    ):
        number = admin.optional_number(value, option)
        if number != "__unset__":
            fields[name] = number
    return fields


@tenant.command("list")
@_JSON
@click.pass_context
def tenant_list(ctx: click.Context, as_json: bool) -> None:
    admin.emit(admin.client(ctx).request("GET", "/v1/tenants"), as_json, admin.render_tenants)


@tenant.command("add")
@click.argument("name")
@_tenant_options
@_JSON
@click.pass_context
def tenant_add(ctx: click.Context, name: str, as_json: bool, **options: Any) -> None:
    """Add a tenant (it can send requests at once)."""
    fields = _tenant_fields(**options)
    if "api_key_sha256" not in fields:
        fail("a new tenant needs --key or --key-sha256")
    result = admin.client(ctx).request("POST", "/v1/tenants", {"name": name} | fields)
    admin.done(result, as_json, f"tenant {name} added")


@tenant.command("set")
@click.argument("name")
@_tenant_options
@_JSON
@click.pass_context
def tenant_set(ctx: click.Context, name: str, as_json: bool, **options: Any) -> None:
    """Change a tenant's key, budget, tier, weight or rate limits, live."""
    fields = _tenant_fields(**options)
    if not fields:
        fail("nothing to change: give at least one option")
    result = admin.client(ctx).request("PATCH", f"/v1/tenants/{quote(name, safe='')}", fields)
    admin.done(result, as_json, f"tenant {name} changed")


@tenant.command("remove")
@click.argument("name")
@_JSON
@click.pass_context
def tenant_remove(ctx: click.Context, name: str, as_json: bool) -> None:
    """Remove a tenant (refused while it has requests in flight)."""
    result = admin.client(ctx).request("DELETE", f"/v1/tenants/{quote(name, safe='')}")
    admin.done(result, as_json, f"tenant {name} removed")


@cli.group()
def sharing() -> None:
    """The prefix-cache sharing policy: isolated, public or shared."""


@sharing.command("get")
@_JSON
@click.pass_context
def sharing_get(ctx: click.Context, as_json: bool) -> None:
    result = admin.client(ctx).request("GET", "/v1/sharing")
    admin.emit(result, as_json, lambda r: r["policy"])


@sharing.command("set")
@click.argument("policy", type=click.Choice(["isolated", "public", "shared"]))
@_JSON
@click.pass_context
def sharing_set(ctx: click.Context, policy: str, as_json: bool) -> None:
    result = admin.client(ctx).request("PUT", "/v1/sharing", {"policy": policy})
    admin.done(result, as_json, f"sharing policy: {policy}")


@cli.group()
def budget() -> None:
    """The budget mode: reserve, static or free."""


@budget.command("get")
@_JSON
@click.pass_context
def budget_get(ctx: click.Context, as_json: bool) -> None:
    result = admin.client(ctx).request("GET", "/v1/budget")
    admin.emit(result, as_json, lambda r: r["mode"])


@budget.command("set")
@click.argument("mode", type=click.Choice(["reserve", "static", "free"]))
@_JSON
@click.pass_context
def budget_set(ctx: click.Context, mode: str, as_json: bool) -> None:
    result = admin.client(ctx).request("PUT", "/v1/budget", {"mode": mode})
    admin.done(result, as_json, f"budget mode: {mode}")


@cli.group()
def prefix() -> None:
    """Public prefixes: shared by every tenant under the public policy."""


@prefix.command("add")
@click.argument("name")
@click.option("--text", help="The prefix text (tokenized like a prompt).")
@click.option("--text-file", type=click.Path(dir_okay=False), help="Read the text from a file.")
@click.option(
    "--token-file", type=click.Path(dir_okay=False), help="Token ids: a JSON array or spaces."
)
@click.option("--chat-system", help="A chat system message (matches chat requests that send it).")
@click.option(
    "--chat-system-file",
    type=click.Path(dir_okay=False),
    help="Read the system message from a file (without its final newline).",
)
@_JSON
@click.pass_context
def prefix_add(
    ctx: click.Context,
    name: str,
    text: str | None,
    text_file: str | None,
    token_file: str | None,
    chat_system: str | None,
    chat_system_file: str | None,
    as_json: bool,
) -> None:
    """Register a public prefix: completion text, token ids, or the system
    message of chat requests (rendered as the chat template renders it)."""
    sources = (text, text_file, token_file, chat_system, chat_system_file)
    if sum(x is not None for x in sources) != 1:
        fail(
            "give exactly one of --text, --text-file, --token-file, --chat-system, "
            "--chat-system-file"
        )
    body: dict[str, Any] = {"name": name}
    if token_file is not None:
        body["tokens"] = admin.read_tokens(token_file)
    elif text_file is not None:
        body["text"] = _read_text(text_file)
    elif chat_system_file is not None:
        # A text file ends with a newline; the message clients send does not.
        body["chat_system"] = _read_text(chat_system_file).removesuffix("\n")
    elif chat_system is not None:
        body["chat_system"] = chat_system
    else:
        body["text"] = text
    result = admin.client(ctx).request("POST", "/v1/prefixes", body)
    admin.done(result, as_json, f"prefix {name} added")


def _read_text(path: str) -> str:
    try:
        return Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        fail(f"{path}: {getattr(exc, 'strerror', None) or exc}")


@prefix.command("list")
@_JSON
@click.pass_context
def prefix_list(ctx: click.Context, as_json: bool) -> None:
    result = admin.client(ctx).request("GET", "/v1/prefixes")
    admin.emit(result, as_json, admin.render_prefixes)


@prefix.command("remove")
@click.argument("name")
@_JSON
@click.pass_context
def prefix_remove(ctx: click.Context, name: str, as_json: bool) -> None:
    result = admin.client(ctx).request("DELETE", f"/v1/prefixes/{quote(name, safe='')}")
    admin.done(result, as_json, f"prefix {name} removed")


@cli.command()
@_JSON
@click.pass_context
def flush(ctx: click.Context, as_json: bool) -> None:
    """Free every cached page no request uses."""
    result = admin.client(ctx).request("POST", "/v1/flush")
    admin.done(result, as_json, f"freed {result.get('freed_pages', 0)} cached pages")


@cli.command()
@click.option("--wait", is_flag=True, help="Wait until no request is in flight.")
@click.option("--timeout", type=FiniteFloat(min=0), help="Give up waiting after S seconds.")
@_JSON
@click.pass_context
def drain(ctx: click.Context, wait: bool, timeout: float | None, as_json: bool) -> None:
    """Stop accepting requests (503); in-flight ones finish."""
    c = admin.client(ctx)
    result = c.request("POST", "/v1/drain")
    if wait:
        admin.wait_drained(c, timeout)
    admin.done(result, as_json, f"draining: {result['in_flight']} requests in flight")


@cli.command()
@_JSON
@click.pass_context
def undrain(ctx: click.Context, as_json: bool) -> None:
    """Accept requests again."""
    admin.done(admin.client(ctx).request("POST", "/v1/undrain"), as_json, "serving")


@cli.command()
@_JSON
@click.pass_context
def audit(ctx: click.Context, as_json: bool) -> None:
    """The log of admin changes, oldest first."""
    admin.emit(admin.client(ctx).request("GET", "/v1/audit"), as_json, admin.render_audit)


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
@click.option(
    "--weights",
    type=click.Choice(sorted(WEIGHT_FORMATS)),
    help="The weights' format: the pool is what the device has left beside them "
    "(with --device-memory, instead of --pool).",
)
@click.option(
    "--device-memory",
    type=SizeType(),
    help="Accelerator memory, e.g. 28.7GiB (the seed's chip).",
)
@click.option(
    "--overhead",
    type=SizeType(),
    help="Memory the runtime and activations keep (default: what the seed's figures imply, "
    f"{SEED_OVERHEAD / 2**30:.2f} GiB).",
)
@click.option("--parameters", type=_POSITIVE, help="Model parameters (default: the preset's).")
@click.option(
    "--devices",
    type=_POSITIVE,
    default=1,
    show_default=True,
    help="Devices the model is split over (tensor parallel; several hosts' chips "
    "count alike), each of --device-memory.",
)
@click.option(
    "--hidden-size",
    type=_POSITIVE,
    help="Hidden width: the embedding it sizes is kept whole on every device "
    "(default: the preset's).",
)
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
    weights: str | None,
    device_memory: int | None,
    overhead: int | None,
    parameters: int | None,
    devices: int,
    hidden_size: int | None,
    as_json: bool,
) -> None:
    """What a KV pool holds for a model (offline; no daemon needed); with
    --weights and --device-memory, what each weight format leaves to the pool."""
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
        fits = None
        if weights is not None or device_memory is not None:
            fits = _weights_fits(
                geometry,
                model,
                weights,
                device_memory,
                overhead,
                parameters,
                pool,
                block_size,
                devices,
                hidden_size,
            )
            pool = next(f.pool_bytes for f in fits if f.weights == weights)
        elif devices > 1:
            raise ValueError("--devices prices weights: give --weights and --device-memory")
        report = capacity_report(geometry, pool, block_size=block_size, context=context)
        if fits is not None:
            report = msgspec.structs.replace(report, weights=fits, weights_format=weights)
    except (GeometryError, LayoutError, ValueError) as exc:
        fail(str(exc))
    if as_json:
        click.echo(msgspec.json.encode(report).decode())
    else:
        click.echo(render_capacity(report))


def _weights_fits(
    geometry: KVGeometry,
    model: str | None,
    weights: str | None,
    device_memory: int | None,
    overhead: int | None,
    parameters: int | None,
    pool: int | None,
    block_size: int,
    devices: int = 1,
    hidden_size: int | None = None,
) -> list[WeightsFit]:
    if weights is None or device_memory is None:
        raise ValueError("--weights and --device-memory go together")
    if pool is not None:
        raise ValueError("give --pool or --weights with --device-memory, not both")
    if parameters is None:
        if model not in PARAMETERS:
            raise ValueError(f"no parameter count for {model or 'this model'}: give --parameters")
        parameters = PARAMETERS[model]
    replicated = 0
    if devices > 1:
        hidden = hidden_size or HIDDEN.get(model or "")
        if hidden is None:
            raise ValueError(
                f"no hidden width for {model or 'this model'}: give --hidden-size "
                "(its embedding is kept whole on every device)"
            )
        replicated = VOCAB * hidden
    fits = weights_fits(
        geometry,
        parameters,
        device_memory,
        SEED_OVERHEAD if overhead is None else overhead,
        block_size,
        devices,
        replicated,
    )
    chosen = next(f for f in fits if f.weights == weights)
    if chosen.pool_bytes <= 0:
        raise ValueError(
            f"{weights} weights ({format_iec(chosen.weight_bytes)}) and the overhead "
            f"({format_iec(chosen.overhead_bytes)}) leave no pool in {format_iec(device_memory)}"
        )
    return fits


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


def _devices_table(fits: list[WeightsFit], chosen: str | None) -> list[str]:
    first = fits[0]
    where = (
        "split over the devices by KV head"
        if first.pool_split
        else "a whole copy on every device (its KV heads do not split over them)"
    )
    rows = [
        (
            f.weights + (" (this report)" if f.weights == chosen else ""),
            f"weights {format_iec(f.weight_bytes_per_device)} per device, pool "
            f"{format_iec(f.pool_bytes_per_device)} per device ({format_iec(f.pool_bytes)} "
            f"in all), {f.max_sequences_512:,} concurrent 512-token sequences",
        )
        for f in fits
    ]
    title = (
        f"weights of {first.parameters / 1e9:.4g}B parameters over {first.devices} devices "
        f"of {format_iec(first.device_memory)}, {format_iec(first.overhead_bytes)} kept for "
        f"the runtime on each; the pool: {where}"
    )
    return _table(title, rows)


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
    formula = "2 x layers x kv_heads x head_dim x bytes per element"
    if r.dtype == "int8":  # the scales are pool bytes too
        formula += ", + a 4-byte scale per group of up to 256 values"
    lines += _table(f"KV bytes per token ({formula})", per_token)
    if r.context is not None and r.sequence_bytes_at_context is not None:
        per_seq = r.sequence_bytes_at_context
        rows = [("KV cache", f"{format_iec(per_seq)} ({format_si(per_seq)})")]
        if r.sliding_layers and r.eager_sequence_bytes_at_context is not None:
            eager = r.eager_sequence_bytes_at_context
            rows.append(("with the window eager", f"{format_iec(eager)} ({format_si(eager)})"))
        lines += _table(f"one sequence of {r.context:,} tokens", rows)
    if r.weights and r.weights[0].devices > 1:
        lines += _devices_table(r.weights, r.weights_format)
    elif r.weights:
        rows = [
            (
                f.weights + (" (this report)" if f.weights == r.weights_format else ""),
                f"weights {format_iec(f.weight_bytes)}, pool {format_iec(f.pool_bytes)}, "
                f"{f.max_sequences_512:,} concurrent 512-token sequences",
            )
            for f in r.weights
        ]
        first = r.weights[0]
        title = (
            f"weights of {first.parameters / 1e9:.4g}B parameters in "
            f"{format_iec(first.device_memory)}, {format_iec(first.overhead_bytes)} kept "
            "for the runtime"
        )
        lines += _table(title, rows)
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
    if k.padded_layer_places:
        rows.append(("padded layer places per page", str(k.padded_layer_places)))
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
