"""``kvd experiment report``: every experiment, then one Markdown report with
the plots, the answers and the machine they ran on."""

from __future__ import annotations

import datetime
import platform
from collections.abc import Callable
from pathlib import Path

from kvd.experiments import bytes as bytes_
from kvd.experiments import crossover, floor, fragmentation, isolation, prefix
from kvd.experiments.results import ExperimentResult, Say, render_table, write

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


def run_one(name: str, out: Path, quick: bool, say: Say) -> ExperimentResult:
    result = EXPERIMENTS[name](out, quick, say)
    write(result, out)
    return result


def markdown(results: list[ExperimentResult], command: str) -> str:
    machine = results[0].machine if results else ""
    total = sum(r.seconds for r in results)
    lines = [
        "# Capacity: what this machine settled",
        "",
        f"Machine: {machine}, {platform.system()} {platform.release()}. "
        f"Generated {datetime.date.today().isoformat()} by `{command}` "
        f"in {total / 60:.1f} minutes{' (quick form)' if any(r.quick for r in results) else ''}.",
        "Every figure below comes from that run; the JSON beside each plot holds them all.",
        "",
    ]
    for r in results:
        lines += [
            f"## {TITLES.get(r.name, r.name)}",
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


def run_report(out: Path, quick: bool, say: Say, command: str) -> Path:
    results = []
    for name in EXPERIMENTS:
        say(f"== {name}")
        results.append(run_one(name, out, quick, say))
    path = out / "README.md"
    path.write_text(markdown(results, command))
    return path
