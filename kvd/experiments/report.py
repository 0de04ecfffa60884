"""``kvd experiment report``: every experiment, then one Markdown report with
the plots, the answers and the machine they ran on."""

from __future__ import annotations

import datetime
import platform
from collections.abc import Callable
from pathlib import Path

from kvd.experiments import bytes as bytes_
from kvd.experiments import crossover, floor, fragmentation, isolation, prefix
from kvd.experiments.results import ExperimentResult, Say, load, render_table, write

EXPERIMENTS: dict[str, Callable[[Path, bool, Say], ExperimentResult]] = {
    "bytes": bytes_.run,
    "floor": floor.run,
    "prefix": prefix.run,
    "fragmentation": fragmentation.run,
    "crossover": crossover.run,
    "isolation": isolation.run,
}

TITLES = {
    "bytes": "1. The real bytes per token",
    "floor": "2. The sliding-window floor",
    "prefix": "3. Prefix-cache hit rate under a multi-tenant workload",
    "fragmentation": "4. Fragmentation under paging",
    "crossover": "5. Where recompute stops beating swap",
    "isolation": "6. Isolation under an abusive tenant",
}


def seed_comparison(results: list[ExperimentResult]) -> list[str]:
    """Where the seed's estimates held and where they did not, from the figures."""
    by = {r.name: r.data for r in results}
    lines: list[str] = []
    if "bytes" in by:
        seed = by["bytes"]["pools"][1]
        lines.append(
            "**Bytes per token: held.** The seed's formula gives Gemma 4 12B 128 KiB/token on "
            "global layers and 320 KiB on sliding ones at bf16; kvd's layout spends "
            f"{seed['allocated_bytes_per_token'] / 1024:,.1f} KiB per token of the pool "
            f"({100 * seed['overhead']:+.2f}% with block tables)."
        )
    if "floor" in by:
        points = by["floor"]["curves"][0]["points"]
        short, mid = points[0], next((p for p in points if p["length"] == 512), points[-1])
        verdict = (
            "an artefact of eager windows" if short["kvd"] > 12 else "held, even with lazy windows"
        )
        lines.append(
            f"**The ~12-sequence ceiling: {verdict}.** The seed's 320 MiB floor "
            "per sequence caps Gemma 4 12B at 12 sequences in 3.8 GiB before any global-layer "
            f"token; kvd allocates windows lazily and fits {short['kvd']:,} concurrent "
            f"{short['length']}-token sequences ({short['eager']} eager) and {mid['kvd']} of "
            f"{mid['length']} tokens ({mid['eager']} eager). From the window's length on, the "
            "two agree: a long sequence does pay the whole window."
        )
        pool = by["floor"].get("seed_pool")
        if pool:
            eager, kvd = pool["eager"], pool["kvd"]
            lines.append(
                f"**Tokens in the pool: held.** The seed's ~8,894 tokens in all and "
                f"~28,570-token longest sequence: by its formula {eager['total_tokens']:,} and "
                f"{eager['longest_sequence_tokens']:,}; kvd's allocator holds "
                f"{kvd['total_tokens']:,} tokens as {kvd['block_size']}-token sequences and a "
                f"{kvd['longest_sequence_tokens']:,}-token sequence (whole pages and blocks)."
            )
    if "prefix" in by:
        runs = {(r["where"], r["policy"], r["salts"]): r for r in by["prefix"]["runs"]}
        core = runs.get(("kv-core", "public", False))
        live = runs.get(("daemon", "public", False))
        if core and live:
            hit = live["hit_rate"]
            verdict = prefix.hit_verdict(hit)
            lines.append(
                f"**Prefix caching: {verdict}.** Under `public`, {100 * hit:.0f}% of prompt "
                "tokens hit on "
                f"the real daemon and {100 * core['hit_rate']:.0f}% at 12B in 3.8 GiB (ideal "
                f"{100 * core['ideal_hit_rate']:.0f}%, an unbounded cache that keeps every block; "
                "a 3.8 GiB pool holds a few 12B sequences and evicts the rest). Published "
                "production figures: 40-59% (Mooncake), 54-62% with an unbounded cache (Bailian)."
            )
    if "fragmentation" in by:
        b16 = next(b for b in by["fragmentation"]["blocks"] if b["block_size"] == 16)
        removes = b16["paged_utilisation"] > b16["contiguous_utilisation"]
        lines.append(
            "**Fragmentation: the seed's 20-40% describes contiguous reservation"
            + (", and paging removes it.** " if removes else ".** ")
            + "A contiguous allocator on the same trace keeps "
            f"{100 * b16['contiguous_utilisation']:.0f}% of its bytes live reserving prompt + "
            f"2,000 tokens and {100 * b16['context_utilisation']:.0f}% reserving the context; "
            f"kvd's pages keep {100 * b16['paged_utilisation']:.1f}% live. The waste is "
            f"{b16['waste_blocks_per_sequence_group']:.2f} blocks per sequence per page group: "
            "a partly filled last block, and on sliding groups a first block partly out of the "
            "window, so 'one partly filled block per sequence' is per page group, and sliding "
            "groups can hold a second."
        )
    if "crossover" in by:
        data = by["crossover"]
        cross = data["model_crossover_tokens"]
        measured = data["measured_crossover_tokens"]
        held = measured is None
        explanation = ""
        if not held and data["device"].lower().startswith("cpu"):
            explanation = (
                ": host memory is the device's memory on a CPU, so a copy is cheap next to a "
                "prefill"
            )
        lines.append(
            "**Recompute vs swap: the seed expected recompute to win; "
            + ("on this machine it did.** " if held else "on this machine it did not.** ")
            + f"On {data['device']} "
            + (
                f"swap was measured cheaper at every length from {measured:,} tokens"
                if measured is not None
                else "recompute was measured cheaper at every length"
            )
            + (
                f", and the cost model switches at {cross:,} token{'s' if cross != 1 else ''}"
                if cross is not None
                else ", and the cost model never swaps"
            )
            + explanation
            + "."
            + (
                " On a TPU, where a copy crosses PCIe and prefill runs on the MXU, the same "
                "experiment settles it there (`kvd experiment crossover --tag NAME` runs on any "
                "JAX device; copy its files here and the report includes them)."
                if not data["device"].lower().startswith("tpu")
                else ""
            )
        )
    if "isolation" in by:
        modes = {r["mode"]: r for r in by["isolation"]["runs"]}
        reserve, free = modes.get("reserve"), modes.get("free")
        if reserve and free:
            held = (
                reserve["queue_steps_max"] <= free["queue_steps_max"]
                and reserve["ttft_flood_max_s"] <= free["ttft_flood_max_s"]
                and not reserve["preempted"].get("inter")
            )
            lines.append(
                f"**Reservation + burst under an abusive tenant: isolation "
                f"{'held' if held else 'did not hold'}.** With the abuser at the victim's own "
                "tier, the reserved tenant's slowest first token under the flood came after "
                f"{reserve['ttft_flood_max_s']:.2f} s (p50 {reserve['ttft_flood_p50_s']:.2f} s, "
                f"idle {reserve['ttft_idle_p50_s']:.2f} s), at most {reserve['queue_steps_max']} "
                f"queued steps, against {free['ttft_flood_max_s']:.2f} s and "
                f"{free['queue_steps_max']} steps in `free` mode (first come, first served: "
                "behind the whole flood). It was preempted "
                f"{sum(reserve['preempted'].get('inter', {}).values())} times and its outputs "
                + ("equalled" if reserve["outputs_equal_idle"] else "did not equal")
                + " the idle run's."
            )
    return lines


def run_one(
    name: str, out: Path, quick: bool, say: Say, tag: str | None = None
) -> ExperimentResult:
    """Run one experiment into ``out``; a ``tag`` (e.g. the device it ran on)
    names its files NAME-TAG, so a run elsewhere can be copied beside this
    machine's and the report includes it."""
    result = EXPERIMENTS[name](out, quick, say)
    if tag:
        tagged = f"{name}-{tag}"
        renamed = []
        for plot in result.plots:
            target = plot.replace(name, tagged, 1)
            (out / plot).replace(out / target)
            renamed.append(target)
        result.name, result.plots = tagged, renamed
    write(result, out)
    return result


def tagged_results(out: Path) -> list[ExperimentResult]:
    """Results of runs elsewhere (NAME-TAG.json) copied into ``out``."""
    found = []
    for name in EXPERIMENTS:
        found += [load(path) for path in sorted(out.glob(f"{name}-*.json"))]
    return found


def _title(name: str) -> str:
    base, _, tag = name.partition("-")
    title = TITLES.get(base, base)
    return f"{title} (run tagged {tag})" if tag else title


def markdown(results: list[ExperimentResult], command: str) -> str:
    machine = results[0].machine if results else ""
    total = sum(r.seconds for r in results)
    lines = [
        "# Capacity: what this machine settled",
        "",
        f"Machine: {machine}, {platform.system()} {platform.release()}. "
        f"Generated {datetime.date.today().isoformat()} by `{command}` "
        f"in {total / 60:.1f} minutes{' (quick form)' if any(r.quick for r in results) else ''}.",
        "Every figure below comes from the experiments' JSON beside this file.",
        "",
    ]
    comparison = seed_comparison(results)
    if comparison:
        lines += ["## Where the seed held, and where it did not", ""]
        lines += [f"- {line}" for line in comparison] + [""]
    for r in results:
        lines += [
            f"## {_title(r.name)}",
            "",
            f"*The seed's question:* {r.question}.",
            "",
            f"**Answer:** {r.answer}.",
            "",
            render_table(r.header, r.rows, markdown=True),
            "",
        ]
        lines += [f"![{r.name}]({p})" for p in r.plots]
        lines += (
            [""] + [f"- {n}" for n in r.notes] + ["", f"({r.seconds:.0f} s; `{r.name}.json`)", ""]
        )
    return "\n".join(lines)


def render_report(out: Path, command: str) -> Path:
    """The report again from the JSON already in ``out`` (after a tagged run
    from another device was copied in, say); nothing is measured."""
    results = [
        load(out / f"{name}.json") for name in EXPERIMENTS if (out / f"{name}.json").is_file()
    ]
    if not results:
        raise FileNotFoundError(f"no experiment results (NAME.json) in {out}")
    path = out / "README.md"
    path.write_text(markdown(results + tagged_results(out), command))
    return path


def run_report(out: Path, quick: bool, say: Say, command: str) -> Path:
    results = []
    for name in EXPERIMENTS:
        say(f"== {name}")
        results.append(run_one(name, out, quick, say))
    results += tagged_results(out)
    path = out / "README.md"
    path.write_text(markdown(results, command))
    return path
