"""The ``kvd`` command: the daemon, one-shot tools and benchmarks."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

import click
import msgspec

from kvd.clikit import FiniteFloat, fail, run
from kvd.sched.sampling_params import MAX_TEMPERATURE, MIN_TEMPERATURE

# The weights' dtypes and formats every command that loads a model offers
# (as kvd.engine.loader and kvd.engine.wquant.QUANTIZATIONS take them).
WEIGHT_DTYPES = click.Choice(["float32", "bfloat16"])
QUANTIZATIONS = click.Choice(["auto", "none", "int8"])
MATMULS = click.Choice(["auto", "xla", "onednn"])


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvd")
def cli() -> None:
    """kvd: a multi-tenant Gemma serving daemon with an accountable KV-cache pool."""


def _temperature(value: float) -> float:
    if 0 < value < MIN_TEMPERATURE:
        raise click.BadParameter(
            f"{value:g} is below {MIN_TEMPERATURE:g} (use 0 for greedy)", param_hint="--temperature"
        )
    return value


@cli.command()
@click.option(
    "--config",
    "config_path",
    required=True,
    type=click.Path(dir_okay=False),
    help="TOML configuration file (see etc/kvd.toml).",
)
@click.option(
    "--listen", metavar="HOST:PORT", help="Override server.listen (port 0: any free port)."
)
@click.option("--admin-socket", metavar="PATH", help="Override server.admin_socket.")
@click.option(
    "--process-id",
    type=click.IntRange(min=0),
    metavar="N",
    help="Override distributed.process_id (several hosts: this host's place in the set).",
)
def serve(
    config_path: str, listen: str | None, admin_socket: str | None, process_id: int | None
) -> None:
    """Run the daemon: load the model, warm up, serve the HTTP API until SIGTERM.
    With ``[distributed]``, every host runs this with the same configuration:
    process 0 serves, the others follow it."""
    import trio

    from kvd.server.config import ConfigError, load_config, parse_listen
    from kvd.server.daemon import startup_failure
    from kvd.server.logs import configure_logging

    try:
        config = load_config(config_path)
        if listen is not None:
            parse_listen(listen)
        if admin_socket is not None:
            config = msgspec.structs.replace(
                config,
                server=msgspec.structs.replace(
                    config.server, admin_socket=str(Path(admin_socket).resolve())
                ),
            )
        if process_id is not None and config.distributed is None:
            raise ConfigError("--process-id needs a [distributed] section in the configuration")
    except ConfigError as exc:
        fail(str(exc))
    configure_logging()
    if config.distributed is not None:
        _join_or_follow(config, process_id)
    from kvd.server.daemon import Daemon

    daemon = Daemon(config, listen=listen)
    try:
        code = trio.run(daemon.run)
    except BaseException as exc:  # noqa: BLE001  # a start-up failure is one line, exit 1
        reason = startup_failure(exc)
        if reason is None:
            raise
        fail(reason, code=1)
    if daemon.failure is not None:
        # A hung step's thread may still be inside the device runtime, which
        # the interpreter's exit would wait on: leave without it.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    raise SystemExit(code)


def _join_or_follow(config: Any, process_id: int | None) -> None:
    """Several processes: join the set; a follower's life ends here (it
    follows process 0 until told to stop), the leader's goes on to serve."""
    from kvd.server import distributed
    from kvd.server.config import ConfigError
    from kvd.server.daemon import startup_failure

    try:
        role = distributed.start(config, process_id)
    except ConfigError as exc:
        fail(str(exc))
    distributed.watch(role)
    if role.leader:
        return
    try:
        code = distributed.run_follower(config, role)
    except BaseException as exc:  # noqa: BLE001  # a start-up failure is one line, exit 1
        reason = startup_failure(exc)
        if reason is None:
            raise
        fail(reason, code=1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no shutdown barrier with a leader that may be gone


@cli.command("check-config")
@click.argument("path", type=click.Path(dir_okay=False))
def check_config(path: str) -> None:
    """Validate a configuration file without starting anything."""
    from kvd.server.config import ConfigError, load_config
    from kvd.server.daemon import check_paths

    try:
        config = load_config(path)
    except ConfigError as exc:
        fail(str(exc))
    missing = check_paths(config)
    if missing:
        fail(f"{path}: no such file: {', '.join(missing)}")
    tenants = ", ".join(t.name for t in config.tenants)
    click.echo(
        f"{path}: ok (model {config.served_model}, listen {config.server.listen}, "
        f"tenants: {tenants})"
    )


@cli.command()
@click.option(
    "--model",
    default="gemma3-270m",
    show_default=True,
    help="gemma3-270m (embedded), a .gguf file or a checkpoint directory.",
)
@click.option("--prompt", help="The prompt text.")
@click.option("--prompt-file", type=click.Path(dir_okay=False), help="Read the prompt from a file.")
@click.option("--chat", is_flag=True, help="Wrap the prompt in Gemma's chat turn format.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=64, show_default=True)
@click.option(
    "--temperature",
    type=FiniteFloat(min=0, max=MAX_TEMPERATURE),
    default=0.0,
    show_default=True,
    callback=lambda ctx, param, value: _temperature(value),
    help=f"0 is greedy; else {MIN_TEMPERATURE:g} to {MAX_TEMPERATURE:g}.",
)
@click.option("--top-k", type=click.IntRange(min=0), default=0, help="0 is off.")
@click.option("--top-p", type=FiniteFloat(min=0, max=1, min_open=True), default=1.0)
@click.option("--seed", type=click.IntRange(min=0, max=2**32 - 1), help="Reproducible sampling.")
@click.option(
    "--dtype",
    type=WEIGHT_DTYPES,
    default="float32",
    show_default=True,
    help="Weights and compute dtype.",
)
@click.option(
    "--quantization",
    type=QUANTIZATIONS,
    default="auto",
    show_default=True,
    help="int8: keep the matrices at their stored precision (a GGUF's blocks, exactly); "
    "auto: int8 on the CPU where that is exact, float weights on an accelerator.",
)
@click.option(
    "--tensor-parallel",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Split the model over this many devices.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def generate(
    model: str,
    prompt: str | None,
    prompt_file: str | None,
    chat: bool,
    max_tokens: int,
    temperature: float,
    top_k: int,
    top_p: float,
    seed: int | None,
    dtype: str,
    quantization: str,
    tensor_parallel: int,
    as_json: bool,
) -> None:
    """Continue one prompt and print the result (a one-shot check of the engine)."""
    from kvd.oneshot.generate import GenerateError, generate_once

    if (prompt is None) == (prompt_file is None):
        fail("give exactly one of --prompt and --prompt-file")
    if prompt_file is not None:
        try:
            with open(prompt_file, encoding="utf-8") as handle:
                prompt = handle.read()
        except (OSError, UnicodeDecodeError) as exc:
            fail(f"cannot read prompt file {prompt_file}: {exc}")
    assert prompt is not None
    try:
        result = generate_once(
            model,
            prompt,
            chat=chat,
            max_tokens=max_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            dtype=dtype,
            quantization=quantization,
            tensor_parallel=tensor_parallel,
            progress=lambda text: click.echo(text, err=True),
        )
    except GenerateError as exc:
        fail(str(exc), code=exc.exit_code)
    if as_json:
        click.echo(msgspec.json.encode(result).decode())
    else:
        click.echo(result.text)


def _positive_list(text: str, option: str) -> tuple[int, ...]:
    """Comma-separated positive integers, or a one-line usage error."""
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        fail(f"{option} must be comma-separated integers, got {text!r}")
    if any(n < 1 for n in sizes):
        fail(f"{option} sizes must be positive")
    return sizes


@cli.group()
def bench() -> None:
    """Benchmarks that print figures for this machine."""
    from kvd.engine import compile_cache

    compile_cache.enable_default()


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

    sizes = _positive_list(running, "--running")
    try:
        report = run_kv_bench(sizes, steps, model, block_size)
    except GeometryError as exc:
        fail(str(exc))
    click.echo(msgspec.json.encode(report).decode() if as_json else render(report))


@bench.command("decode")
@click.option("--batches", default="1,8,32", show_default=True, help="Comma-separated batch sizes.")
@click.option("--prompt-len", type=click.IntRange(min=2), default=128, show_default=True)
@click.option("--new-tokens", type=click.IntRange(min=2), default=64, show_default=True)
@click.option("--dtype", type=WEIGHT_DTYPES, help="[default: float32]")
@click.option("--quantization", type=QUANTIZATIONS, help="[default: auto]")
@click.option("--no-baseline", is_flag=True, help="Skip the transformers baseline.")
@click.option(
    "--rounds",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="Interleaved rounds of kvd with overlapped steps on and off, per batch size.",
)
@click.option(
    "--matmul",
    type=MATMULS,
    help="The matrix products: XLA's, or bf16 on oneDNN's AMX/AVX-512 kernels "
    "(model.matmul).  [default: xla]",
)
@click.option(
    "--config",
    "config_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Measure the engine kvd serve builds from this config file (its rows, context, "
    "pool, weights and products) instead of one sized for the workload.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def bench_decode(
    batches: str,
    prompt_len: int,
    new_tokens: int,
    dtype: str | None,
    quantization: str | None,
    no_baseline: bool,
    rounds: int,
    matmul: str | None,
    config_path: Path | None,
    as_json: bool,
) -> None:
    """Decode throughput and TTFT of the embedded model, with transformers as the baseline."""
    from kvd.bench.decode import ConfigUnfit, render, run_decode_bench
    from kvd.server.config import ConfigError

    sizes = _positive_list(batches, "--batches")
    if config_path is not None:
        given = [
            f"--{n}"
            for n, v in (("dtype", dtype), ("quantization", quantization), ("matmul", matmul))
            if v is not None
        ]
        if given:
            fail(f"{', '.join(given)}: the engine's settings come from --config {config_path}")
    try:
        report = run_decode_bench(
            sizes,
            prompt_len,
            new_tokens,
            dtype or "float32",
            not no_baseline,
            lambda t: click.echo(t, err=True),
            quantization or "auto",
            rounds,
            matmul or "xla",
            config_path,
        )
    except (ConfigError, ConfigUnfit) as exc:
        fail(str(exc))
    click.echo(msgspec.json.encode(report).decode() if as_json else render(report))


@bench.command("weights")
@click.option("--batches", default="1,8,32", show_default=True, help="Decode batch sizes.")
@click.option("--prefill", default="512", show_default=True, help="Prompt lengths to prefill.")
@click.option("--new-tokens", type=click.IntRange(min=2), default=32, show_default=True)
@click.option("--rounds", type=click.IntRange(min=1), default=2, show_default=True)
@click.option(
    "--dtype",
    type=WEIGHT_DTYPES,
    default="float32",
    show_default=True,
    help="The float weights' dtype, and both formats' compute dtype (bfloat16 on an accelerator).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def bench_weights(
    batches: str, prefill: str, new_tokens: int, rounds: int, dtype: str, as_json: bool
) -> None:
    """The embedded model with float (f32 or bf16) against int8 weights: speed, bytes,
    greedy agreement."""
    from kvd.bench.weights import render, run_weights_bench

    report = run_weights_bench(
        _positive_list(batches, "--batches"),
        _positive_list(prefill, "--prefill"),
        new_tokens,
        rounds,
        lambda t: click.echo(t, err=True),
        dtype,
    )
    click.echo(msgspec.json.encode(report).decode() if as_json else render(report))


@bench.command("sampling")
@click.option("--batch", type=click.IntRange(min=2), default=32, show_default=True)
@click.option("--vocabulary", type=click.IntRange(min=512), default=262144, show_default=True)
@click.option(
    "--model-logits",
    is_flag=True,
    help="Also time greedy and temperature on the embedded model's own next-token logits "
    "along a text (loads the model).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def bench_sampling(batch: int, vocabulary: int, model_logits: bool, as_json: bool) -> None:
    """Cost of one sampling call by path (greedy, temperature, top-k/top-p)."""
    from kvd.bench.sampling import render, run_sampling_bench

    try:
        report = run_sampling_bench(batch, vocabulary, model_logits=model_logits)
    except ValueError as exc:
        fail(str(exc))
    click.echo(msgspec.json.encode(report).decode() if as_json else render(report))


@bench.command("prefill")
@click.option(
    "--lengths", default="128,512,600,2048,4000", show_default=True, help="Prompt lengths."
)
@click.option("--decode-batches", default="1,8", show_default=True)
@click.option("--new-tokens", type=click.IntRange(min=2), default=32, show_default=True)
@click.option("--dtype", type=WEIGHT_DTYPES, default="float32")
@click.option("--no-baseline", is_flag=True, help="Skip the transformers baseline.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def bench_prefill(
    lengths: str,
    decode_batches: str,
    new_tokens: int,
    dtype: str,
    no_baseline: bool,
    as_json: bool,
) -> None:
    """Prefill tokens/s and peak RSS from 128 to 4,000 tokens, and decode at
    context 4,000 against 128, with transformers as the baseline."""
    from kvd.bench.prefill import render, run_prefill_bench

    sizes = _positive_list(lengths, "--lengths")
    if max(sizes) + new_tokens >= 4096:
        fail("--lengths: a prompt plus --new-tokens must stay under the 4096-token context")
    report = run_prefill_bench(
        sizes,
        _positive_list(decode_batches, "--decode-batches"),
        new_tokens=new_tokens,
        dtype=dtype,
        baseline=not no_baseline,
        say=lambda t: click.echo(t, err=True),
    )
    click.echo(msgspec.json.encode(report).decode() if as_json else render(report))


@bench.command("int8")
@click.option("--model", default="gemma3-270m", show_default=True)
@click.option("--tokens", type=click.IntRange(min=1), default=32, show_default=True)
@click.option(
    "--pool", default="256MiB", show_default=True, help="Pool size for the capacity part."
)
@click.option("--raw", is_flag=True, help="Raw text prompts, not the chat turn format.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def bench_int8(model: str, tokens: int, pool: str, raw: bool, as_json: bool) -> None:
    """int8 K/V against f32 on the real model: greedy agreement, logit error,
    scale granularity, and tokens per pool byte against bf16."""
    from kvd.bench.int8 import render, run_int8_bench

    report = run_int8_bench(model, tokens, pool, chat=not raw)
    click.echo(msgspec.json.encode(report).decode() if as_json else render(report))


@bench.command("host-cache")
@click.option("--model", default="gemma3-270m", show_default=True)
@click.option("--documents", type=click.IntRange(min=1), default=6, show_default=True)
@click.option("--doc-tokens", type=click.IntRange(min=32, max=900), default=384, show_default=True)
@click.option("--rounds", type=click.IntRange(min=2), default=3, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def bench_host_cache(
    model: str, documents: int, doc_tokens: int, rounds: int, as_json: bool
) -> None:
    """The host cache on and off over reused prefixes larger
    than the pool: prefill tokens saved, TTFT, outputs equal."""
    from kvd.bench.hostcache import render, run_host_cache_bench

    report = run_host_cache_bench(model, documents=documents, doc_tokens=doc_tokens, rounds=rounds)
    click.echo(msgspec.json.encode(report).decode() if as_json else render(report))


@bench.command("http")
@click.option("--model", default="gemma3-270m", show_default=True, help="Or 'random'.")
@click.option("--clients", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--duration", type=FiniteFloat(min=1), default=60.0, show_default=True)
@click.option("--max-tokens", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--no-inprocess", is_flag=True, help="Skip the in-process comparison run.")
@click.option(
    "--system-prompt-rules",
    type=click.IntRange(min=0, max=40),
    default=0,
    show_default=True,
    help="A shared system prompt of this many ~18-token rules before each (then unique) prompt.",
)
@click.option(
    "--max-model-len", type=click.IntRange(min=128), default=1024, show_default=True,
    help="The daemon's context (4096 is the dev config's).",
)  # fmt: skip
@click.option("--pool", default="512MiB", show_default=True, help="The daemon's pool size.")
@click.option(
    "--temperature", type=click.FloatRange(min=0.0, max=MAX_TEMPERATURE), default=0.0,
    show_default=True, help="Every request's (0: greedy).",
)  # fmt: skip
@click.option("--serial", is_flag=True, help="The daemon with scheduler.overlap = false.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def bench_http(
    model: str,
    clients: int,
    duration: float,
    max_tokens: int,
    no_inprocess: bool,
    system_prompt_rules: int,
    max_model_len: int,
    pool: str,
    temperature: float,
    serial: bool,
    as_json: bool,
) -> None:
    """Load a real daemon over loopback HTTP; compare with the in-process scheduler."""
    from kvd.bench.http import render, run_http_load

    report = run_http_load(
        model,
        clients,
        duration,
        max_tokens,
        not no_inprocess,
        lambda t: click.echo(t, err=True),
        system_prompt_rules,
        max_model_len,
        pool,
        temperature,
        not serial,
    )
    click.echo(msgspec.json.encode(report).decode() if as_json else render(report))


@bench.command("flood")
@click.option("--model", default="gemma3-270m", show_default=True)
@click.option("--flood-requests", type=click.IntRange(min=1), default=24, show_default=True)
@click.option(
    "--flood-words", type=click.IntRange(min=1), default=100, show_default=True,
    help="Sentences per flood prompt (~15 tokens each).",
)  # fmt: skip
@click.option("--interactive", type=click.IntRange(min=1), default=8, show_default=True)
@click.option(
    "--target-step-ms", type=FiniteFloat(min=1), default=2000.0, show_default=True,
    help="scheduler.target_step_ms for the daemon.",
)  # fmt: skip
@click.option("--no-target", is_flag=True, help="Run without a step-time target.")
@click.option("--pool", default="256MiB", show_default=True)
@click.option(
    "--mode", type=click.Choice(["reserve", "static", "free"]), default="reserve",
    show_default=True, help="The daemon's budget mode (static: the flooder holds 70%).",
)  # fmt: skip
@click.option(
    "--flood-tier", type=click.Choice(["batch", "interactive"]), default="batch",
    show_default=True, help="The flooder's tier (interactive: an abuser at the victim's tier).",
)  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def bench_flood(
    model: str,
    flood_requests: int,
    flood_words: int,
    interactive: int,
    target_step_ms: float,
    no_target: bool,
    pool: str,
    mode: str,
    flood_tier: str,
    as_json: bool,
) -> None:
    """Time isolation: a reserved interactive tenant under a batch tenant's flood."""
    from kvd.bench.daemon import DaemonShape
    from kvd.bench.flood import render, run_flood_modes

    (report,) = run_flood_modes(
        (mode,),
        model=model,
        flood_requests=flood_requests,
        flood_words=flood_words,
        interactive_requests=interactive,
        target_step_ms=None if no_target else target_step_ms,
        shape=DaemonShape(2048, pool=pool),
        flood_tier=flood_tier,
        log=lambda t: click.echo(t, err=True),
    )
    click.echo(msgspec.json.encode(report).decode() if as_json else render(report))


@bench.command("scheduler")
@click.option("--running", default="64,256,1024", show_default=True)
@click.option("--steps", type=click.IntRange(min=1), default=50, show_default=True)
@click.option("--no-crossover", is_flag=True, help="Skip measuring rates on the 270M model.")
@click.option(
    "--nano-vllm", "nano_vllm", type=click.Path(file_okay=False, path_type=Path),
    help="A nano-vllm checkout: time its scheduler at each size in the same run (needs xxhash).",
)  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def bench_scheduler(
    running: str, steps: int, no_crossover: bool, nano_vllm: Path | None, as_json: bool
) -> None:
    """Scheduler host overhead per step, and the measured recompute/swap crossover."""
    from kvd.bench.nanovllm import AnchorUnavailable
    from kvd.bench.scheduler import render, run_scheduler_bench

    sizes = _positive_list(running, "--running")
    try:
        report = run_scheduler_bench(
            sizes, steps, not no_crossover, lambda text: click.echo(text, err=True), nano_vllm
        )
    except AnchorUnavailable as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(msgspec.json.encode(report).decode() if as_json else render(report))


@bench.command("fleet")
@click.option("--replicas", type=click.IntRange(min=1), default=2, show_default=True)
@click.option(
    "--policy", "policies", default="one_replica,round_robin,cache_aware,kv_events",
    show_default=True,
    help="Comma-separated: smg's policies (round_robin, cache_aware, power_of_two, random), "
    "kv_events (each request to the replica Dynamo's KV indexer scores highest), "
    "one_replica (every request to the first replica).",
)  # fmt: skip
@click.option("--clients", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--quick", is_flag=True, help="The tiny random model: a smoke run.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def bench_fleet(replicas: int, policies: str, clients: int, quick: bool, as_json: bool) -> None:
    """Replicas behind a real gateway (smg): prefix-cache hits, TTFT, tokens/s per policy."""
    from kvd.bench.fleet import POLICIES, render, run_fleet_bench

    chosen = tuple(p.strip() for p in policies.split(",") if p.strip())
    if not chosen:
        raise click.BadParameter("name at least one policy", param_hint="--policy")
    for policy in chosen:
        if policy not in POLICIES:
            raise click.BadParameter(
                f"unknown policy {policy!r}: one of {', '.join(POLICIES)}", param_hint="--policy"
            )
    try:
        report = run_fleet_bench(
            replicas, chosen, clients, quick=quick, say=lambda text: click.echo(text, err=True)
        )
    except RuntimeError as exc:  # a gateway or the indexer that would not start
        raise click.ClickException(str(exc)) from exc
    click.echo(msgspec.json.encode(report).decode() if as_json else render(report))


@bench.command("kv-events")
@click.option("--requests", type=click.IntRange(min=1), default=96, show_default=True)
@click.option("--quick", is_flag=True, help="The tiny random model: a smoke run.")
@click.option(
    "--indexer", is_flag=True,
    help="Dynamo's KV indexer (ai-dynamo-runtime) follows the events too; its view is checked.",
)  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def bench_kv_events(requests: int, quick: bool, indexer: bool, as_json: bool) -> None:
    """Step time with KV events off and on (published over ZMQ to a subscriber)."""
    from kvd.bench.kvevents import render, run_kv_events_bench

    try:
        report = run_kv_events_bench(
            requests, quick=quick, say=lambda text: click.echo(text, err=True), indexer=indexer
        )
    except RuntimeError as exc:  # the indexer missing or not starting
        raise click.ClickException(str(exc)) from exc
    click.echo(msgspec.json.encode(report).decode() if as_json else render(report))


@bench.command("startup")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def bench_startup(as_json: bool) -> None:
    """Cold start (empty cache) and warm restart of the embedded model, to ready."""
    from kvd.bench.startup import render, run_startup_bench

    report = run_startup_bench()
    click.echo(msgspec.json.encode(report).decode() if as_json else render(report))


EXPERIMENT_NAMES = ("bytes", "floor", "prefix", "fragmentation", "crossover", "isolation")


@cli.command("experiment")
@click.argument("name", type=click.Choice([*EXPERIMENT_NAMES, "report"]))
@click.option(
    "--out", type=click.Path(file_okay=False), default="capacity-report", show_default=True,
    help="Directory for the JSON, the plots and (for report) README.md.",
)  # fmt: skip
@click.option("--quick", is_flag=True, help="Small sizes and the tiny random model: a smoke run.")
@click.option(
    "--tag", help="Name the files NAME-TAG (e.g. crossover-tpu_v5e): a run on another device, "
    "to copy beside this machine's; `report` includes every NAME-TAG.json in OUT.",
)  # fmt: skip
@click.option(
    "--from-json", is_flag=True,
    help="report: rebuild OUT/README.md from the JSON already in OUT, measuring nothing.",
)  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object.")
def experiment(
    name: str, out: str, quick: bool, tag: str | None, from_json: bool, as_json: bool
) -> None:
    """The seed's six capacity questions, answered on this machine.

    NAME is one experiment (bytes, floor, prefix, fragmentation, crossover,
    isolation) or `report`: all six, then OUT/README.md with every plot.
    Each writes OUT/NAME.json and OUT/NAME.png and prints its table.
    """
    from kvd.engine import compile_cache
    from kvd.experiments.report import render_report, run_one, run_report
    from kvd.experiments.results import render

    compile_cache.enable_default()

    def say(text: str) -> None:
        click.echo(text, err=True)

    target = Path(out)
    if from_json and name != "report":
        raise click.BadParameter("only the report is rebuilt from JSON", param_hint="--from-json")
    if tag is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.]*", tag):
        raise click.BadParameter("letters, digits, '_' and '.' only", param_hint="--tag")
    if name == "report":
        if tag is not None:
            raise click.BadParameter("tag one experiment, not the report", param_hint="--tag")
        if from_json:
            try:
                path = render_report(target, f"kvd experiment report --out {out}")
            except FileNotFoundError as exc:
                fail(str(exc))
            click.echo(f"report: {path}")
            return
        command = f"kvd experiment report --out {out}" + (" --quick" if quick else "")
        path = run_report(target, quick, say, command)
        click.echo(f"report: {path}")
        return
    result = run_one(name, target, quick, say, tag)
    click.echo(msgspec.json.encode(result).decode() if as_json else render(result))


def main() -> None:
    run(cli, "kvd")


if __name__ == "__main__":
    main()
