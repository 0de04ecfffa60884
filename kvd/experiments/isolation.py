"""Question 6, whether reservation + burst holds isolation under a
deliberately abusive tenant: `kvd bench flood` on the real 270M under each
budget mode. The abuser floods concurrent long prompts at the victim's own
tier (an abusive tenant does not label itself batch: tiers cannot help, only
the budget can); the victim, with a 30% reservation, sends short greedy
requests one after another, first on the idle daemon, then under the flood. From the
daemon's own logs: the steps each interactive request queued, preemptions by
tenant and kind; from the client: TTFT, and whether the outputs equal the
idle run's. In `static` mode the flooder holds a 70% partition (a static
tenant holds nothing beyond its reservation); in `free` and `reserve` it has
no reservation at all.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from kvd.bench.daemon import QUICK_DAEMON, DaemonShape
from kvd.bench.flood import FloodReport, run_flood_modes
from kvd.experiments.results import ExperimentResult, Say, new_result, pyplot, save_plot, timed

QUESTION = "whether reservation-plus-burst holds isolation under a deliberately abusive tenant"
MODES = ("free", "static", "reserve")


def run(out: Path, quick: bool, say: Say, model: str | None = None) -> ExperimentResult:
    result = new_result(
        "isolation",
        QUESTION,
        quick,
        [
            "mode",
            "victim TTFT p50/max s",
            "idle p50 s",
            "queue steps (max)",
            "preempted",
            "outputs = idle",
            "flood done",
            "slowest step s",
        ],
    )
    with timed(result):
        model = model or ("random" if quick else "gemma3-270m")
        say(f"budget modes {', '.join(MODES)}, one daemon")
        reports: list[FloodReport] = run_flood_modes(
            MODES,
            model=model,
            flood_requests=6 if quick else 16,
            flood_words=20 if quick else 80,
            interactive_requests=3 if quick else 6,
            target_step_ms=None if quick else 800.0,
            shape=QUICK_DAEMON if quick else DaemonShape(2048, pool="128MiB"),
            flood_tier="interactive",
            log=lambda text: say(f"  {text}"),
        )
        for r in reports:
            preempted = ", ".join(
                f"{tenant}: " + "/".join(f"{n} {kind}" for kind, n in kinds.items())
                for tenant, kinds in r.preempted.items()
            )
            result.rows.append(
                [
                    r.mode,
                    f"{r.ttft_flood_p50_s:.2f}/{r.ttft_flood_max_s:.2f}",
                    f"{r.ttft_idle_p50_s:.2f}",
                    f"{r.queue_steps_max}",
                    preempted or "none",
                    "yes" if r.outputs_equal_idle else "NO",
                    f"{r.flood_completed}/{r.flood_requests} in {r.flood_seconds:.0f} s",
                    f"{r.longest_step_s:.2f}",
                ]
            )
        result.data = {"model": model, "runs": msgspec.to_builtins(reports)}
        by = {r.mode: r for r in reports}
        inter_preempted = {m: sum(r.preempted.get("inter", {}).values()) for m, r in by.items()}
        result.answer = "; ".join(
            f"`{m}`: the victim's first token after at most {r.ttft_flood_max_s:.2f} s "
            f"(p50 {r.ttft_flood_p50_s:.2f} s, idle {r.ttft_idle_p50_s:.2f} s), at most "
            f"{r.queue_steps_max} queued steps, {inter_preempted[m]} preemptions, outputs "
            + ("equal to" if r.outputs_equal_idle else "different from")
            + " the idle run's"
            for m, r in by.items()
        )
        result.notes.append(
            f"{reports[0].flood_requests} flood prompts of {reports[0].flood_prompt_tokens} tokens "
            f"(max_tokens 16), {reports[0].interactive_requests} interactive requests "
            "(max_tokens 8); queue steps = engine steps between a request's arrival and its start"
        )
        _plot(result, reports, out)
    return result


def _plot(result: ExperimentResult, reports: list[FloodReport], out: Path) -> None:
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(7, 3.8))
    data = [reports[0].ttft_idle_s] + [r.ttft_flood_s for r in reports]
    labels = ["idle"] + [f"{r.mode}\n(flood)" for r in reports]
    axis.boxplot(data, showfliers=True)
    axis.set_xticks(range(1, len(labels) + 1), labels)
    for i, values in enumerate(data, start=1):
        axis.plot([i] * len(values), values, "o", alpha=0.5, ms=4)
    axis.set_yscale("log")
    axis.set_ylabel("interactive TTFT (s)")
    axis.set_title(f"Reserved tenant's TTFT under a flood ({result.data['model']})", fontsize=9)
    save_plot(figure, result, out)
