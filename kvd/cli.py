"""The ``kvd`` command: the daemon, one-shot tools and benchmarks."""

from __future__ import annotations

import click
import msgspec

from kvd.clikit import fail, run


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvd")
def cli() -> None:
    """kvd: a multi-tenant Gemma serving daemon with an accountable KV-cache pool."""


@cli.command()
@click.option("--config", type=click.Path(dir_okay=False), help="TOML configuration file.")
def serve(config: str | None) -> None:
    """Run the daemon (needs the engine, scheduler and HTTP API: not yet built)."""
    fail(
        "kvd serve is not available yet: the KV core has landed, the JAX engine, "
        "scheduler and HTTP API have not (see the project's open issues)",
        code=1,
    )


@cli.group()
def bench() -> None:
    """Benchmarks that print figures for this machine."""


@bench.command("kv")
@click.option("--steps", type=click.IntRange(min=1), default=200, show_default=True)
@click.option(
    "--running",
    default="64,256,1024",
    show_default=True,
    help="Comma-separated numbers of running sequences.",
)
@click.option("--model", default="gemma3-270m", show_default=True, help="Layout preset.")
@click.option("--block-size", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def bench_kv(steps: int, running: str, model: str, block_size: int, as_json: bool) -> None:
    """Host time per scheduling step of the KV core, and prefix-hash throughput."""
    from kvd.bench.kv import render, run_kv_bench
    from kvd.kv.geometry import GeometryError

    try:
        sizes = tuple(int(part) for part in running.split(","))
    except ValueError:
        fail(f"--running must be comma-separated integers, got {running!r}")
    if any(n < 1 for n in sizes):
        fail("--running sizes must be positive")
    try:
        report = run_kv_bench(sizes, steps, model, block_size)
    except GeometryError as exc:
        fail(str(exc))
    click.echo(msgspec.json.encode(report).decode() if as_json else render(report))


def main() -> None:
    run(cli, "kvd")


if __name__ == "__main__":
    main()
