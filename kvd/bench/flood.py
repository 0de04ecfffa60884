"""``kvd bench flood``: time isolation between tenants, through HTTP on a real daemon.

One ``batch``-tier tenant with no reservation floods the daemon with
concurrent long prompts; an ``interactive`` tenant with a 30% reservation
sends short greedy requests one after another. The same interactive requests
first run on the idle daemon, for their outputs and TTFT alone. From the
daemon's own logs: how many steps each interactive request queued
(``request.start``), who was preempted and how (``kv.preempt``), and the
slowest step once serving (``engine.step``), against ``target_step_ms``.
"""

from __future__ import annotations

import hashlib
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from kvd.bench.daemon import DaemonShape, LoggedDaemon, stream_completion
from kvd.bench.http import percentile
from kvd.bench.kv import machine_description

if TYPE_CHECKING:
    from kvctl.admin import Client

BULK_KEY = "kvd-flood-bulk"
INTER_KEY = "kvd-flood-inter"


class FloodReport(msgspec.Struct, frozen=True):
    machine: str
    model: str
    mode: str
    flood_tier: str
    target_step_ms: float | None
    flood_requests: int
    flood_prompt_tokens: int
    interactive_requests: int
    outputs_equal_idle: bool
    ttft_idle_p50_s: float
    ttft_idle_max_s: float
    ttft_flood_p50_s: float
    ttft_flood_max_s: float
    queue_steps_max: int
    queue_steps: list[int]
    preempted: dict[str, dict[str, int]]  # tenant -> kind -> count
    longest_step_s: float  # once the flood began
    steps_over_twice_target: int | None
    flood_completed: int
    flood_seconds: float
    ttft_idle_s: list[float] = []
    ttft_flood_s: list[float] = []


def _config(
    model: str,
    shape: DaemonShape,
    target: float | None,
    sock: str,
    mode: str,
    flood_tier: str,
) -> str:
    target_line = f"target_step_ms = {target}" if target is not None else ""
    # Static partitions hold nothing beyond a reservation: the flooder gets the rest.
    bulk_reservation = "70%" if mode == "static" else "0"
    return f"""
[server]
listen = "127.0.0.1:0"
metrics_listen = "127.0.0.1:0"
admin_socket = "{sock}"
# Beside the socket, in the run's temporary directory: a bench never
# touches (nor restores) the state of a daemon installed on this host.
state_file = "{sock}.state.json"
step_log_interval = 1.0
queue_timeout = 3600

[model]
source = "{model}"
name = "flood"
{shape.toml()}
[pool]
size = "{shape.pool}"

[budget]
mode = "{mode}"

[scheduler]
{target_line}

[[tenants]]
name = "bulk"
api_key_sha256 = "{hashlib.sha256(BULK_KEY.encode()).hexdigest()}"
tier = "{flood_tier}"
reservation = "{bulk_reservation}"
max_queue = 64

[[tenants]]
name = "inter"
api_key_sha256 = "{hashlib.sha256(INTER_KEY.encode()).hexdigest()}"
reservation = "30%"
"""


def _text(i: int, words: int) -> str:
    return "".join(f"Record {i}-{j}: the value of item {j} is {j * 7 % 13}. " for j in range(words))


def _complete(url: str, key: str, prompt: str, max_tokens: int) -> tuple[str, float]:
    """A streamed greedy completion: (its text, time to first token)."""
    done = stream_completion(
        url, key, {"model": "flood", "prompt": prompt, "max_tokens": max_tokens}
    )
    return done.text, done.ttft_s


def run_flood_modes(
    modes: tuple[str, ...],
    *,
    model: str = "gemma3-270m",
    flood_requests: int = 24,
    flood_words: int = 100,
    interactive_requests: int = 8,
    target_step_ms: float | None = 2000.0,
    shape: DaemonShape,
    flood_tier: str = "batch",
    log: Callable[[str], None] = lambda _text: None,
) -> list[FloodReport]:
    """One daemon, a measured run per budget mode in turn (``kvd bench
    flood`` runs one, the isolation experiment all three): the mode (and the
    flooder's reservation, which static needs) set live over the admin
    socket, as an operator would, with the cache flushed between runs."""
    from kvctl.admin import Client
    from kvd.engine.loader import load_model

    tokenizer = load_model(model).tokenizer if model != "random" else None
    bulk_prompts = [_text(i, flood_words) for i in range(flood_requests)]
    prompt_tokens = len(tokenizer.encode(bulk_prompts[0])) if tokenizer else 0
    inter_prompts = [
        f"Question {i}: name one colour of the sky." for i in range(interactive_requests)
    ]
    reports = []
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "flood.toml"
        sock = f"{tmp}/a.sock"
        config.write_text(_config(model, shape, target_step_ms, sock, modes[0], flood_tier))
        log(f"starting kvd serve ({model}), target_step_ms={target_step_ms}")
        daemon = LoggedDaemon(config)
        try:
            url = daemon.wait_ready()
            admin = Client(sock)
            for mode in modes:
                _set_mode(admin, mode)
                log(f"budget mode {mode}")
                measured = _measure(daemon, url, bulk_prompts, inter_prompts, log)
                reports.append(
                    _report(
                        daemon.events[measured.mark :],
                        measured,
                        model=model,
                        mode=mode,
                        flood_tier=flood_tier,
                        target_step_ms=target_step_ms,
                        prompt_tokens=prompt_tokens,
                    )
                )
        finally:
            daemon.stop()
    return reports


def _set_mode(admin: Client, mode: str) -> None:
    """Static partitions hold nothing beyond a reservation: there the flooder
    reserves 70% (every other mode, none). Ordered so that the reservations
    always fit the mode they are checked under."""
    bulk_reservation = "70%" if mode == "static" else "0"
    current = admin.request("GET", "/v1/budget")["mode"]
    if current != mode and mode != "static":
        admin.request("PUT", "/v1/budget", {"mode": mode})
    admin.request("PATCH", "/v1/tenants/bulk", {"reservation": bulk_reservation})
    if current != mode and mode == "static":
        admin.request("PUT", "/v1/budget", {"mode": mode})
    admin.request("POST", "/v1/flush")


class _Measured(msgspec.Struct):
    mark: int  # the daemon's first event of the measured flood
    flood_requests: int
    idle: list[tuple[str, float]]
    flooded: list[tuple[str, float]]
    flood_done: list[float]
    flood_seconds: float


def _measure(
    daemon: LoggedDaemon,
    url: str,
    bulk_prompts: list[str],
    inter_prompts: list[str],
    log: Callable[[str], None],
) -> _Measured:
    log("idle run: the interactive requests alone")
    idle = [_complete(url, INTER_KEY, p, 8) for p in inter_prompts]
    log(f"flood: {len(bulk_prompts)} prompts from the flooding tenant")
    flood_done: list[float] = []
    flood_started = time.monotonic()
    mark = len(daemon.events)

    def bulk(prompt: str) -> None:
        _complete(url, BULK_KEY, prompt, 16)
        flood_done.append(time.monotonic() - flood_started)

    threads = [threading.Thread(target=bulk, args=(p,)) for p in bulk_prompts]
    for thread in threads:
        thread.start()
    # The flood is queued and its prefills are under way.
    daemon.wait_for(
        lambda events: (
            sum(_is(e, "request.accepted", "bulk") for e in events[mark:]) >= len(bulk_prompts)
            and any(_is(e, "request.start", "bulk") for e in events[mark:])
        )
    )
    flooded = []
    for i, prompt in enumerate(inter_prompts):
        flooded.append(_complete(url, INTER_KEY, prompt, 8))
        log(f"  interactive {i}: first token after {flooded[-1][1]:.2f} s")
    for thread in threads:
        thread.join()
    flood_seconds = time.monotonic() - flood_started
    ended = len(daemon.events)
    # The engine.step summary of the flood's last steps (logged each
    # step_log_interval while steps run).
    daemon.wait_for(
        lambda events: any(e.get("event") == "engine.step" for e in events[ended:]), timeout=5.0
    )
    return _Measured(mark, len(bulk_prompts), idle, flooded, flood_done, flood_seconds)


def _is(event: dict[str, Any], name: str, tenant: str) -> bool:
    return event.get("event") == name and event.get("tenant") == tenant


def _report(
    events: list[dict[str, Any]],
    run: _Measured,
    *,
    model: str,
    mode: str,
    flood_tier: str,
    target_step_ms: float | None,
    prompt_tokens: int,
) -> FloodReport:
    idle, flooded = run.idle, run.flooded
    starts = [e["queue_steps"] for e in events if _is(e, "request.start", "inter")]
    preempted: dict[str, dict[str, int]] = {}
    for e in events:
        if e.get("event") == "kv.preempt":
            kinds = preempted.setdefault(e["tenant"], {})
            kinds[e["kind"]] = kinds.get(e["kind"], 0) + 1
    steps = [e for e in events if e.get("event") == "engine.step"]
    longest = max((e["longest_step_s"] for e in steps), default=0.0)
    over = None
    if target_step_ms is not None:
        over = sum(1 for e in steps if e["longest_step_s"] > 2 * target_step_ms / 1e3)
    return FloodReport(
        machine=machine_description(),
        model=model,
        mode=mode,
        flood_tier=flood_tier,
        target_step_ms=target_step_ms,
        flood_requests=run.flood_requests,
        flood_prompt_tokens=prompt_tokens,
        interactive_requests=len(flooded),
        outputs_equal_idle=[o for o, _ in idle] == [o for o, _ in flooded],
        ttft_idle_p50_s=round(percentile([t for _, t in idle], 0.5), 3),
        ttft_idle_max_s=round(max(t for _, t in idle), 3),
        ttft_flood_p50_s=round(percentile([t for _, t in flooded], 0.5), 3),
        ttft_flood_max_s=round(max(t for _, t in flooded), 3),
        queue_steps_max=max(starts, default=-1),
        queue_steps=starts,
        preempted=preempted,
        longest_step_s=round(longest, 3),
        steps_over_twice_target=over,
        flood_completed=len(run.flood_done),
        flood_seconds=round(run.flood_seconds, 1),
        ttft_idle_s=[round(t, 3) for _, t in idle],
        ttft_flood_s=[round(t, 3) for _, t in flooded],
    )


def render(report: FloodReport) -> str:
    target = report.target_step_ms
    return "\n".join(
        [
            "kvd bench flood: one tenant floods, a reserved interactive tenant sends "
            "short greedy requests",
            f"machine: {report.machine}; model {report.model}; budget mode {report.mode}; "
            f"flood tier {report.flood_tier}; target_step_ms {target}",
            f"flood: {report.flood_requests} x {report.flood_prompt_tokens}-token prompts, "
            f"{report.flood_completed} completed in {report.flood_seconds} s",
            f"interactive ({report.interactive_requests} requests): TTFT p50/max idle "
            f"{report.ttft_idle_p50_s}/{report.ttft_idle_max_s} s, under the flood "
            f"{report.ttft_flood_p50_s}/{report.ttft_flood_max_s} s",
            f"  queue steps before start: {report.queue_steps} (max {report.queue_steps_max})",
            f"  outputs equal to the idle run: {report.outputs_equal_idle}",
            f"preemptions: {report.preempted or 'none'}",
            f"slowest step under the flood: {report.longest_step_s} s"
            + (
                f" ({report.steps_over_twice_target} log intervals with a step over 2x target)"
                if target is not None
                else ""
            ),
        ]
    )
