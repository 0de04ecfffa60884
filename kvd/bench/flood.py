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

import msgspec

from kvd.bench.daemon import LoggedDaemon, stream_completion
from kvd.bench.http import percentile
from kvd.bench.kv import machine_description

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
    max_model_len: int,
    pool: str,
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
step_log_interval = 1.0
queue_timeout = 3600

[model]
source = "{model}"
name = "flood"
max_model_len = {max_model_len}
max_num_seqs = 32
max_num_batched_tokens = 512

[pool]
size = "{pool}"

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


def run_flood_bench(
    model: str = "gemma3-270m",
    flood_requests: int = 24,
    flood_words: int = 100,
    interactive_requests: int = 8,
    target_step_ms: float | None = 2000.0,
    pool: str = "256MiB",
    max_model_len: int = 2048,
    mode: str = "reserve",
    flood_tier: str = "batch",
    log: Callable[[str], None] = lambda _text: None,
) -> FloodReport:
    from kvd.engine.loader import load_model

    tokenizer = load_model(model).tokenizer if model != "random" else None
    bulk_prompts = [_text(i, flood_words) for i in range(flood_requests)]
    prompt_tokens = len(tokenizer.encode(bulk_prompts[0])) if tokenizer else 0
    inter_prompts = [
        f"Question {i}: name one colour of the sky." for i in range(interactive_requests)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "flood.toml"
        config.write_text(
            _config(model, max_model_len, pool, target_step_ms, f"{tmp}/a.sock", mode, flood_tier)
        )
        log(f"starting kvd serve ({model}), target_step_ms={target_step_ms}")
        daemon = LoggedDaemon(config)
        try:
            url = daemon.wait_ready()
            log("idle run: the interactive requests alone")
            idle = [_complete(url, INTER_KEY, p, 8) for p in inter_prompts]
            log(f"flood: {flood_requests} x ~{prompt_tokens} tokens from the flooding tenant")
            flood_done: list[float] = []
            flood_started = time.monotonic()
            mark = len(daemon.events)

            def bulk(prompt: str) -> None:
                _complete(url, BULK_KEY, prompt, 16)
                flood_done.append(time.monotonic() - flood_started)

            threads = [threading.Thread(target=bulk, args=(p,)) for p in bulk_prompts]
            for thread in threads:
                thread.start()
            time.sleep(2.0)  # the flood is queued and its prefills under way
            flooded = []
            for i, prompt in enumerate(inter_prompts):
                flooded.append(_complete(url, INTER_KEY, prompt, 8))
                log(f"  interactive {i}: first token after {flooded[-1][1]:.2f} s")
            for thread in threads:
                thread.join()
            flood_seconds = time.monotonic() - flood_started
            time.sleep(1.5)  # the last engine.step summary
        finally:
            daemon.stop()
    events = daemon.events[mark:]
    starts = [
        e["queue_steps"]
        for e in events
        if e.get("event") == "request.start" and e.get("tenant") == "inter"
    ]
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
        flood_requests=flood_requests,
        flood_prompt_tokens=prompt_tokens,
        interactive_requests=interactive_requests,
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
        flood_completed=len(flood_done),
        flood_seconds=round(flood_seconds, 1),
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
