"""``kvd bench startup``: cold start and warm restart of the embedded default.

Each start is a fresh process: load the model (assembling the GGUF when the
cache is empty), build the engine and compile every bucket, i.e. everything
before the daemon would say it is ready. The first start runs on an empty
cache directory; the second reuses it (assembled model, tokenizer, compiled
programs).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import msgspec

from kvd.bench.kv import machine_description


class StartFigures(msgspec.Struct, frozen=True):
    start: str  # "cold" or "warm"
    load_s: float
    compile_s: float
    ready_s: float  # process start to ready, imports included
    programs: int
    peak_rss_bytes: int


class StartupReport(msgspec.Struct, frozen=True):
    machine: str
    model: str
    starts: list[StartFigures]


_CHILD = """
import json, resource, time
start = time.perf_counter()
from kvd.engine.engine import Engine, EngineConfig
from kvd.engine.loader import load_model
model = load_model("gemma3-270m", "float32")
loaded = time.perf_counter()
engine = Engine(model, EngineConfig())
compile_s = engine.warm_up()
ready = time.perf_counter()
print(json.dumps({"load_s": loaded - start, "compile_s": compile_s, "ready_s": ready - start,
                  "programs": engine.compiled_shapes(),
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def run_startup_bench() -> StartupReport:
    starts = []
    with tempfile.TemporaryDirectory(prefix="kvd-startup-") as cache:
        env = dict(os.environ, KVD_CACHE_DIR=cache)
        for label in ("cold", "warm"):
            began = time.perf_counter()
            out = subprocess.run(
                [sys.executable, "-c", _CHILD], capture_output=True, text=True, env=env, check=True
            )
            figures = json.loads(out.stdout.strip().splitlines()[-1])
            figures["ready_s"] = time.perf_counter() - began  # interpreter start included
            starts.append(StartFigures(start=label, **figures))
    return StartupReport(machine_description(), "gemma3-270m", starts)


def render(report: StartupReport) -> str:
    lines = [
        f"kvd bench startup: {report.model}, default engine config, "
        "to ready (all buckets compiled)",
        f"machine: {report.machine}",
        "",
        f"{'start':<6} {'load s':>7} {'compile s':>10} {'ready s':>8} {'programs':>9} "
        f"{'peak RSS':>9}",
    ]
    for s in report.starts:
        lines.append(
            f"{s.start:<6} {s.load_s:>7.1f} {s.compile_s:>10.1f} {s.ready_s:>8.1f} "
            f"{s.programs:>9} {s.peak_rss_bytes / 2**30:>7.2f} GiB"
        )
    return "\n".join(lines)
