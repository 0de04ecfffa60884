"""``kvd bench kv-events``: what publishing KV events costs a step.

The same workload runs with events off and on, in alternating rounds (off,
on, off, on, ...) so the machine's drift falls on both alike: requests of
several tenants, each a shared system prompt plus a question of its own,
arriving while others decode, over a pool small enough that cached blocks
are evicted all along (every step stores and removes blocks). With events
on, the scheduler's KV manager logs them and a real publisher sends each
step's batch over ZMQ (a Unix socket) to a subscriber thread that decodes
every message, as the daemon does after each step.
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from kvd.bench.kv import machine_description


class EventRound(msgspec.Struct, frozen=True):
    events: bool
    steps: int
    mean_step_ms: float
    blocks_told: int


class KVEventsBenchReport(msgspec.Struct, frozen=True):
    machine: str
    model: str
    requests: int
    rounds: list[EventRound]
    off_ms: float  # median over the rounds of the mean step
    on_ms: float
    ratio: float  # on / off
    batches_received: int


def _workload(tokenizer: Any, requests: int, seed: int) -> list[tuple[str, list[int]]]:
    rng = np.random.default_rng(seed)
    system = tokenizer.encode("You are a careful assistant for a bakery. " * 12)
    tenants = ("alice", "bob", "carol", "dave")
    work = []
    for i in range(requests):
        words = " ".join(str(x) for x in rng.integers(0, 10_000, 40))
        work.append((tenants[i % 4], system + tokenizer.encode(words, add_bos=False)))
    return work


class _Reader:
    """A gateway's subscriber: decodes every message it receives."""

    def __init__(self, endpoint: str) -> None:
        import zmq

        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.received = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        decoder = msgspec.msgpack.Decoder()
        while not self.stop.is_set():
            if self.sock.poll(50):
                _, _, payload = self.sock.recv_multipart()
                decoder.decode(payload)
                self.received += 1

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.sock.close(linger=0)
        self.context.term()


def _round(
    engine: Any, work: list[tuple[str, list[int]]], events: bool, directory: Path, tokens: int
) -> tuple[EventRound, int]:
    from kvd.engine.sampling import SamplingParams
    from kvd.sched.scheduler import Scheduler, TenantConfig
    from kvd.server.config import KVEventsSection
    from kvd.server.kvevents import KVEventPublisher

    scheduler = Scheduler(engine)
    for name in {tenant for tenant, _ in work}:
        scheduler.set_tenant(TenantConfig(name, max_queue=len(work)))
    publisher = reader = None
    if events:
        section = KVEventsSection(enable=True, endpoint=f"ipc://{directory}/pub")
        publisher = KVEventPublisher(section)
        reader = _Reader(section.endpoint)
        publisher.attach(scheduler.kv.enable_events())
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    times: list[float] = []
    arrivals = iter(enumerate(work))
    pending = True
    try:
        while pending or scheduler.has_work():
            if pending:  # two arrivals a step: prefills beside the decodes
                for _ in range(2):
                    item = next(arrivals, None)
                    if item is None:
                        pending = False
                        break
                    i, (tenant, prompt) = item
                    scheduler.submit(f"r{i}", tenant, prompt, params)
            start = time.perf_counter()
            scheduler.step()
            if publisher is not None:
                publisher.offer()
            times.append(time.perf_counter() - start)
        scheduler.kv.check_invariants()
        told = 0
        received = 0
        if publisher is not None and reader is not None:
            log = publisher.events
            assert log is not None
            told = log.stored_blocks + log.removed_blocks
            deadline = time.monotonic() + 10
            while publisher.published < publisher.accepted and time.monotonic() < deadline:
                time.sleep(0.01)
            received = reader.received
    finally:
        if publisher is not None:
            publisher.close()
        if reader is not None:
            reader.close()
    return EventRound(events, len(times), statistics.fmean(times) * 1e3, told), received


def run_kv_events_bench(
    rounds: int = 3,
    requests: int = 48,
    tokens: int = 16,
    quick: bool = False,
    say: Callable[[str], None] = lambda _text: None,
) -> KVEventsBenchReport:
    from kvd.engine.engine import Engine, EngineConfig
    from kvd.engine.loader import EMBEDDED_MODEL, load_model, random_model_with_tokenizer

    if quick:
        model, name = random_model_with_tokenizer(max_position=1024), "random (tiny)"
    else:
        model, name = load_model(EMBEDDED_MODEL), EMBEDDED_MODEL
    # A pool of ~10 requests' worth of pages: blocks are evicted throughout.
    engine = Engine(
        model,
        EngineConfig(
            max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=256, pool_tokens=3072
        ),
    )
    say(f"compiling {name}")
    engine.warm_up()
    work = _workload(model.tokenizer, requests, seed=7)
    results: list[EventRound] = []
    received = 0
    with tempfile.TemporaryDirectory(prefix="kvd-ev-", dir="/tmp") as directory:
        for index in range(rounds * 2):
            events = index % 2 == 1
            say(f"round {index + 1} of {rounds * 2}: events {'on' if events else 'off'}")
            result, got = _round(engine, work, events, Path(directory), tokens)
            results.append(result)
            received += got
    off = statistics.median(r.mean_step_ms for r in results if not r.events)
    on = statistics.median(r.mean_step_ms for r in results if r.events)
    return KVEventsBenchReport(
        machine_description(), name, requests, results, off, on, on / off, received
    )


def render(report: KVEventsBenchReport) -> str:
    lines = [
        "kvd bench kv-events: the same workload with KV events off and on (alternating rounds;",
        "on: logged, published over ZMQ and decoded by a subscriber thread)",
        f"machine: {report.machine}",
        f"model: {report.model}, {report.requests} requests a round",
        "",
        f"{'round':>5} {'events':>7} {'steps':>6} {'mean step ms':>13} {'blocks told':>12}",
    ]
    for i, r in enumerate(report.rounds, 1):
        lines.append(
            f"{i:>5} {'on' if r.events else 'off':>7} {r.steps:>6} {r.mean_step_ms:>13.2f} "
            f"{r.blocks_told:>12,}"
        )
    lines += [
        "",
        f"median step: off {report.off_ms:.2f} ms, on {report.on_ms:.2f} ms: "
        f"{report.ratio:.3f}x ({report.batches_received:,} batches received)",
    ]
    return "\n".join(lines)
