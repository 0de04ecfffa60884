"""What an experiment leaves behind: a table, its figures as JSON, a plot,
and a one-line answer to the seed's question."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec

from kvd.bench.kv import machine_description

Say = Callable[[str], None]


class ExperimentResult(msgspec.Struct):
    name: str
    question: str  # the seed's question, in its words
    answer: str  # this run's answer, with its number
    machine: str
    quick: bool
    header: list[str]
    rows: list[list[str]]
    data: dict[str, Any]
    seconds: float = 0.0
    plots: list[str] = msgspec.field(default_factory=list)  # file names beside the JSON
    notes: list[str] = msgspec.field(default_factory=list)  # how to read it, what it assumes


def new_result(name: str, question: str, quick: bool, header: list[str]) -> ExperimentResult:
    return ExperimentResult(
        name=name,
        question=question,
        answer="",
        machine=machine_description(),
        quick=quick,
        header=header,
        rows=[],
        data={},
    )


@contextmanager
def timed(result: ExperimentResult) -> Iterator[ExperimentResult]:
    start = time.monotonic()
    yield result
    result.seconds = round(time.monotonic() - start, 1)


def render_table(header: list[str], rows: list[list[str]], markdown: bool = False) -> str:
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)
    ]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(lines)


def render(result: ExperimentResult) -> str:
    lines = [
        f"kvd experiment {result.name}{' (quick)' if result.quick else ''}: {result.question}",
        f"machine: {result.machine}",
        "",
        render_table(result.header, result.rows),
        "",
        f"answer: {result.answer}",
    ]
    lines += [f"note: {n}" for n in result.notes]
    if result.plots:
        lines.append("plots: " + ", ".join(result.plots))
    return "\n".join(lines)


def write(result: ExperimentResult, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{result.name}.json"
    path.write_bytes(msgspec.json.format(msgspec.json.encode(result), indent=2) + b"\n")
    return path


def load(path: Path) -> ExperimentResult:
    return msgspec.json.decode(path.read_bytes(), type=ExperimentResult)


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only backend (the ``bench`` extra)."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError(
            "plots need matplotlib: pip install 'kvd[bench]' (scripts/test.sh installs it)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_plot(figure: Any, result: ExperimentResult, out: Path, suffix: str = "") -> None:
    out.mkdir(parents=True, exist_ok=True)
    name = f"{result.name}{suffix}.png"
    figure.tight_layout()
    figure.savefig(out / name, dpi=110)
    pyplot().close(figure)
    result.plots.append(name)


def pct(value: float) -> str:
    return f"{100 * value:.1f}%"
