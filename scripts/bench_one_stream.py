"""One streaming client against any OpenAI-compatible server (kvd, llama.cpp's
llama-server, vLLM): requests one after another, each a shared ~450-token
prompt and a question of its own, greedy, a fixed number of tokens. Prints the
decode rate (tokens after the first over the time after the first), the mean
gap between tokens, and TTFT.

Run it against each server in turn, in one session, on a quiet machine:

    .venv/bin/python scripts/bench_one_stream.py --url http://127.0.0.1:8000 --key kvd-dev-alice \
        --metrics http://127.0.0.1:9464
    .venv/bin/python scripts/bench_one_stream.py --url http://127.0.0.1:8090

``--metrics`` (kvd's Prometheus listener) also reads the server's own
inter-token histogram over the same requests: the gap between two tokens as
the step loop hands them to their stream, in the server's process. The
difference from the client's gap is what the streaming path costs per token
(channel, response shaping, SSE framing, the socket). ``--repeat 1`` makes the
prompt 155 tokens of the 270M's tokenizer instead of 581. ``--prompt-tokens N``
sends token ids instead of text, exactly N a prompt (a shared run and 8 of
each request's own), to compare with ``kvd bench decode --batches 1
--prompt-len N``, the in-process step at the same context.

``--inprocess CONFIG --rounds R`` (with ``--prompt-tokens``) makes that
comparison in one run: this process also loads CONFIG's engine and
scheduler as ``kvd serve`` does (give the daemon's own config), then
alternates R rounds of the same requests, each first stepped in a plain
loop here, then sent to the server. Each round's difference (the client's
mean gap less the in-process one) is taken between neighbours, so a
machine whose speed swings from minute to minute moves both sides of it;
the median difference is what serving costs per token beside the step (the
server's event loop, HTTP, the thread hop, and the client, on the same
cores), where ``--metrics`` measures the streaming path alone.

``--cpu-of PID`` (a server on this machine) reads the CPU time each of its
threads spent over the server's rounds (``/proc/PID/task``), and prints it
per chunk received, by thread: ``main`` (kvd's event loop: HTTP, the
relay, the step loop's own work), ``kvd-step`` (the step thread), the
compute threads under their own names; and this client's own CPU per
chunk. On a machine whose cores the step keeps busy, the event loop's and
the client's CPU is what the gap pays beside the step; unlike the gap, it
holds still while the machine's speed swings.

``--burn MS`` (with ``--inprocess``) adds a third arm to each round: the
same in-process requests while another process spins ``MS`` of CPU once a
token (its period is that round's in-process gap), as a server's event loop
and its client would, with none of their work. Its median difference from
the plain in-process arm is what that much CPU alone costs the step on
these cores; next to the server's difference, it tells whether the serving
path costs anything beside its CPU (a wait, a hand-off late).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import httpx

from kvd.bench import sse

SHARED_TEXT = (
    "You are a careful assistant for a small public library. The library opens at nine in "
    "the morning and closes at six in the evening on weekdays, and at one in the afternoon "
    "on Saturdays; it is closed on Sundays and public holidays. Members may borrow up to "
    "eight books at a time for three weeks, and may renew each loan twice unless another "
    "member has reserved the book. Overdue books cost ten cents a day, up to the price of "
    "the book. Children under twelve need a parent's signature to join. The reading room "
    "on the first floor is quiet; the ground floor has the children's corner, the "
    "newspapers and four public computers, which members may book for an hour at a time. "
)
QUESTIONS = [
    "When does the library close on Saturdays?",
    "How many books can a member borrow?",
    "How long is a loan?",
    "What does an overdue book cost?",
    "Who needs a parent's signature?",
    "Where is the quiet reading room?",
    "How long can a computer be booked?",
    "Is the library open on Sunday?",
    "How many times can a loan be renewed?",
    "Where are the newspapers?",
    "When does the library open on weekdays?",
    "What is on the ground floor?",
]


def one_request(
    client: httpx.Client, url: str, model: str, prompt: str | list[int], tokens: int
) -> tuple[float, int, float, int]:
    """(TTFT, tokens after the first, seconds from the first token to the
    last, chunks with text)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,  # kvd and vLLM; llama-server reads it too
        "stream_options": {"include_usage": True},
    }
    produced = 0
    start = time.perf_counter()
    first: float | None = None
    arrivals: list[float] = []
    with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in sse.lines(response.iter_text()):
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                produced = chunk["usage"]["completion_tokens"]
            if not chunk.get("choices") or not chunk["choices"][0].get("text"):
                continue
            now = time.perf_counter()
            if first is None:
                first = now
            else:
                arrivals.append(now - first)
    assert first is not None and arrivals, "fewer than two chunks arrived"
    # Tokens from the usage report (a chunk may carry several), else one a chunk.
    after_first = (produced or len(arrivals) + 1) - 1
    return first - start, after_first, arrivals[-1], len(arrivals) + 1


ITL = "kvd_inter_token_latency_seconds"


def handoff_totals(client: httpx.Client, metrics: str) -> tuple[float, float]:
    """(sum of seconds, count) of the server's inter-token histogram, all tenants."""
    text = client.get(f"{metrics}/metrics").text
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith(f"{ITL}_sum"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith(f"{ITL}_count"):
            count += float(line.rsplit(" ", 1)[1])
    return total, count


class InProcess:
    """The daemon's scheduler over its engine, loaded from its config as
    ``kvd serve`` loads it, stepped in a plain loop: the in-process side."""

    def __init__(self, config_path: str, tokens: int) -> None:
        import gc

        from kvd.sched.sampling_params import SamplingParams
        from kvd.server.config import ConfigError, load_config
        from kvd.server.loading import load

        try:
            config = load_config(config_path)
        except (ConfigError, OSError) as exc:
            raise SystemExit(f"--inprocess: {exc}") from None
        if not config.tenants:
            raise SystemExit(f"{config_path} names no tenant to submit as")
        print(f"loading {config_path} in process (compiles, as the daemon's start does)")
        self.scheduler = load(config, lambda event, fields: None).scheduler
        gc.collect()
        gc.freeze()  # as the daemon does once ready
        self.tenant = config.tenants[0].name
        self.params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        self.submitted = 0

    def gap(self, prompt: list[int]) -> float:
        """One request's mean gap between tokens, in seconds, as the step
        loop sees them (the daemon's ``kvd_inter_token_latency_seconds``)."""
        self.submitted += 1
        self.scheduler.submit(f"inprocess-{self.submitted}", self.tenant, prompt, self.params)
        arrivals: list[float] = []
        finished = False
        while not finished:
            events = self.scheduler.step().events
            now = time.perf_counter()
            for event in events:
                if event.token is not None:
                    arrivals.append(now)
                finished |= event.finished
        return (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1)


def server_round(
    client: httpx.Client,
    args: Any,
    prompts: Sequence[str | list[int]],
    meter: ThreadCpu | None = None,
) -> tuple[list[float], list[float], list[float]]:
    """(TTFTs, decode rates, mean gaps) of ``prompts`` sent one after another."""
    ttfts, rates, gaps = [], [], []
    chunks = 0
    if meter is not None:
        meter.start()
    for prompt in prompts:
        ttft, after_first, seconds, received = one_request(
            client, args.url, args.model, prompt, args.tokens
        )
        ttfts.append(ttft)
        rates.append(after_first / seconds)
        gaps.append(seconds / after_first)
        chunks += received
    if meter is not None:
        meter.stop(chunks)
    return ttfts, rates, gaps


def cpu_seconds(stat_path: str) -> float:
    """The CPU time a process or thread has spent, from its ``/proc`` stat
    file: utime and stime, fields 14 and 15 of stat(5) (after the name,
    which may hold spaces and parentheses)."""
    with open(stat_path) as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class ThreadCpu:
    """CPU seconds of each thread of a process on this machine (and of this
    client), summed by thread name over spans, per chunk received."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.totals: dict[str, float] = {}
        self.chunks = 0
        self._before: dict[int, tuple[str, float]] = {}
        self._own = 0.0
        self.read()  # fails now, clearly, for a process not there

    def read(self) -> dict[int, tuple[str, float]]:
        threads = {}
        try:
            tids = os.listdir(f"/proc/{self.pid}/task")
        except OSError as exc:
            raise SystemExit(f"--cpu-of {self.pid}: no such process here ({exc})") from None
        for tid in tids:
            try:
                with open(f"/proc/{self.pid}/task/{tid}/comm") as comm:
                    name = comm.read().strip()
                seconds = cpu_seconds(f"/proc/{self.pid}/task/{tid}/stat")
            except OSError:
                continue  # the thread ended meanwhile
            key = "main" if int(tid) == self.pid else name
            threads[int(tid)] = (key, seconds)
        return threads

    def start(self) -> None:
        self._before, self._own = self.read(), time.process_time()

    def stop(self, chunks: int) -> None:
        totals = self.totals
        own = time.process_time() - self._own
        totals["(this client)"] = totals.get("(this client)", 0.0) + own
        for tid, (name, seconds) in self.read().items():
            spent = seconds - self._before.get(tid, (name, 0.0))[1]
            totals[name] = totals.get(name, 0.0) + spent
        self.chunks += chunks

    def report(self) -> str:
        lines = [f"CPU per chunk received, by thread ({self.chunks} chunks):"]
        for name, seconds in sorted(self.totals.items(), key=lambda kv: -kv[1]):
            if seconds > 0:
                lines.append(f"  {name:24s} {1e3 * seconds / max(self.chunks, 1):.3f} ms")
        return "\n".join(lines)


# Spins a CPU time (argv[1], seconds) once a period (argv[2]), by its own
# thread's clock: the CPU is spent however often the process is preempted.
_BURNER = """
import sys, time
cpu, period = float(sys.argv[1]), float(sys.argv[2])
print("spinning", flush=True)
while True:
    woke = time.perf_counter()
    until = time.thread_time() + cpu
    while time.thread_time() < until:
        pass
    time.sleep(max(0.0, period - (time.perf_counter() - woke)))
"""


class Burner:
    """Another process on this machine spinning ``cpu_ms`` of CPU once every
    ``period_s`` while the block runs (``--burn``)."""

    def __init__(self, cpu_ms: float, period_s: float) -> None:
        self.cpu_ms, self.period_s = cpu_ms, period_s
        self.process: subprocess.Popen[str] | None = None

    def __enter__(self) -> Burner:
        self.process = subprocess.Popen(
            [sys.executable, "-c", _BURNER, str(self.cpu_ms / 1e3), str(self.period_s)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        if self.process.stdout.readline() != "spinning\n":
            self.__exit__()
            raise SystemExit("--burn: the burner process did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            if self.process.stdout is not None:
                self.process.stdout.close()
            self.process = None


def burn_round(
    inprocess: InProcess, prompts: list[list[int]], cpu_ms: float, gap_ms: float
) -> float:
    """The in-process mean gap (ms) of ``prompts`` beside a burner spinning
    ``cpu_ms`` once every ``gap_ms``."""
    with Burner(cpu_ms, gap_ms / 1e3):
        return 1e3 * statistics.mean(inprocess.gap(prompt) for prompt in prompts)


def _summary(label: str, differences: list[float]) -> str:
    return (
        f"{label}, median {statistics.median(differences):+.2f} ms "
        f"(from {min(differences):+.2f} to {max(differences):+.2f})"
    )


def alternate(
    client: httpx.Client,
    args: Any,
    inprocess: InProcess,
    prompts: list[list[int]],
    meter: ThreadCpu | None,
) -> None:
    """``--inprocess``: rounds of the same requests in process, then at the
    server (then in process beside a burner, with ``--burn``)."""
    differences, burned = [], []
    for number in range(1, args.rounds + 1):
        own = 1e3 * statistics.mean(inprocess.gap(prompt) for prompt in prompts)
        beside = None
        # The burner's arm comes before the server's in even rounds, after it in odd ones.
        if args.burn is not None and number % 2 == 0:
            beside = burn_round(inprocess, prompts, args.burn, own)
        served = 1e3 * statistics.mean(server_round(client, args, prompts, meter)[2])
        if args.burn is not None and beside is None:
            beside = burn_round(inprocess, prompts, args.burn, own)
        differences.append(served - own)
        line = (
            f"round {number}: {own:.2f} ms between tokens in process, {served:.2f} at the "
            f"client ({served - own:+.2f})"
        )
        if beside is not None:
            burned.append(beside - own)
            line += f", {beside:.2f} in process beside {args.burn:g} ms of CPU a token"
            line += f" ({beside - own:+.2f})"
        print(line, flush=True)
    rounds = f"{args.rounds} rounds of {len(prompts)} requests"
    print(_summary(f"{rounds}: the client's gap less the in-process step's", differences))
    if burned:
        print(
            _summary(
                f"{rounds}: the in-process step beside {args.burn:g} ms of another "
                "process's CPU a token, less the in-process step alone",
                burned,
            )
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--key", default=None, help="Bearer key (kvd's tenants need one).")
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=4, help="Copies of the shared text.")
    parser.add_argument("--metrics", default=None, help="kvd's metrics URL (its own gaps).")
    parser.add_argument(
        "--prompt-tokens", type=int, default=None, help="Token-id prompts of exactly this many."
    )
    parser.add_argument(
        "--inprocess",
        default=None,
        metavar="CONFIG",
        help="Also step this kvd config's engine here, alternating rounds with the server's.",
    )
    parser.add_argument("--rounds", type=int, default=5, help="Rounds with --inprocess.")
    parser.add_argument(
        "--burn",
        type=float,
        default=None,
        metavar="MS",
        help="With --inprocess: also step in process beside a process spinning MS of CPU a token.",
    )
    parser.add_argument(
        "--cpu-of",
        type=int,
        default=None,
        metavar="PID",
        help="The server's process (on this machine): its threads' CPU per chunk.",
    )
    args = parser.parse_args()
    if args.inprocess is not None and args.prompt_tokens is None:
        parser.error("--inprocess needs --prompt-tokens (the same token ids on both sides)")
    if args.rounds < 1 or args.requests < 1:
        parser.error("--rounds and --requests must be at least 1")
    if args.burn is not None and (args.inprocess is None or not 0 < args.burn < 1000):
        parser.error("--burn needs --inprocess, and a CPU time above 0 and under 1000 ms")
    shared = SHARED_TEXT * args.repeat
    prompts: list[str | list[int]] = [f"{shared}Q: {q}\nA:" for q in QUESTIONS]
    warm: str | list[int] = shared + "Q: Hello?\nA:"
    ids: list[list[int]] = []
    if args.prompt_tokens is not None:
        if args.prompt_tokens < 16:
            parser.error("--prompt-tokens must be at least 16")
        # Ordinary ids of a 262k vocabulary, past the special tokens.
        drawn = random.Random(0).sample(range(1_000, 200_000), args.prompt_tokens + 8 * 13)
        common, own = drawn[: args.prompt_tokens - 8], drawn[args.prompt_tokens - 8 :]
        ids = [common + own[8 * i : 8 * i + 8] for i in range(13)]  # the last: the warm-up's
        prompts, warm = list(ids[:12]), ids[12]
    meter = ThreadCpu(args.cpu_of) if args.cpu_of is not None else None
    inprocess = None
    if args.inprocess is not None:
        inprocess = InProcess(args.inprocess, args.tokens)
        inprocess.gap(ids[12])  # warm, as the server is below
    headers = {"Authorization": f"Bearer {args.key}"} if args.key else {}
    # A connection per request: llama-server closes idle kept-alive ones.
    limits = httpx.Limits(max_keepalive_connections=0)
    with httpx.Client(headers=headers, timeout=300, limits=limits) as client:
        one_request(client, args.url, args.model, warm, 4)  # warm
        if inprocess is not None:
            alternate(client, args, inprocess, ids[: min(args.requests, 12)], meter)
            if meter is not None:
                print(meter.report())
            return
        before = handoff_totals(client, args.metrics) if args.metrics else None
        ttfts, rates, gaps = server_round(client, args, prompts[: args.requests], meter)
        after = handoff_totals(client, args.metrics) if args.metrics else None
    print(
        f"{args.url}: {len(ttfts)} requests, decode {statistics.median(rates):.1f} tok/s "
        f"(median), gap {1e3 * statistics.median(gaps):.2f} ms, "
        f"TTFT p50 {statistics.median(ttfts):.3f} s"
    )
    if before is not None and after is not None:
        handoff = (after[0] - before[0]) / max(after[1] - before[1], 1)
        client_gap = sum(1e3 * g for g in gaps) / len(gaps)
        print(
            f"server step loop: {1e3 * handoff:.2f} ms between a request's tokens (mean, "
            f"{after[1] - before[1]:.0f} gaps); client: {client_gap:.2f} ms (mean); "
            f"the streaming path costs {client_gap - 1e3 * handoff:+.2f} ms a token"
        )
    if meter is not None:
        print(meter.report())


if __name__ == "__main__":
    main()
