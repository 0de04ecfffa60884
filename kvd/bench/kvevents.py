"""``kvd bench kv-events``: what publishing KV events costs a step.

Two schedulers serve the same workload in lockstep, each on an engine of its
own (same model, same shapes): one with events off, one with them on, their
steps alternating, so each step with events is timed next to the very same
step without them and the machine's drift falls on both alike. The workload
is what makes events: requests of four tenants, each a shared system prompt
plus a question of its own, arriving while others decode, over a pool small
enough that cached blocks are evicted all along. With events on, the KV
manager logs them and a real publisher sends each step's batch over ZMQ (a
Unix socket) to a subscriber thread that decodes every message, as the
daemon does after each step; with ``indexer``, NVIDIA Dynamo's KV indexer
(PyPI ``ai-dynamo-runtime``) follows the same socket, and at the end its
view is checked against the pool.
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


class KVEventsBenchReport(msgspec.Struct, frozen=True):
    machine: str
    model: str
    requests: int
    steps: int
    off_ms: float  # mean step, events off
    on_ms: float  # mean step, events on (the step and the hand-over to the publisher)
    ratio: float  # on / off, over the whole run
    pair_ratio_p50: float  # median over steps of on / off
    blocks_told: int
    batches_received: int
    indexer: str | None = None  # Dynamo's version, when it followed the events
    indexer_blocks: int | None = None  # the blocks it holds at the end
    pool_blocks: int | None = None  # full-attention blocks the pool holds then
    indexer_decode_errors: int | None = None


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


def _scheduler(engine: Any, tenants: set[str], requests: int) -> Any:
    from kvd.sched.scheduler import Scheduler, TenantConfig

    scheduler = Scheduler(engine)
    for name in tenants:
        scheduler.set_tenant(TenantConfig(name, max_queue=requests))
    return scheduler


def run_kv_events_bench(
    requests: int = 96,
    tokens: int = 16,
    quick: bool = False,
    say: Callable[[str], None] = lambda _text: None,
    indexer: bool = False,
) -> KVEventsBenchReport:
    from kvd.engine.engine import Engine, EngineConfig
    from kvd.engine.loader import EMBEDDED_MODEL, load_model, random_model_with_tokenizer
    from kvd.sched.sampling_params import SamplingParams
    from kvd.server.config import KVEventsSection
    from kvd.server.kvevents import KVEventPublisher

    if quick:
        model, name = random_model_with_tokenizer(max_position=1024), "random (tiny)"
    else:
        model, name = load_model(EMBEDDED_MODEL), EMBEDDED_MODEL
    # A pool of ~10 requests' worth of pages: blocks are evicted throughout.
    config = EngineConfig(
        max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=256, pool_tokens=3072
    )
    engines = [Engine(model, config), Engine(model, config)]
    for engine in engines:  # the second reads the first's programs from the compile cache
        say(f"compiling {name}")
        engine.warm_up()
    work = _workload(model.tokenizer, requests, seed=7)
    tenants = {tenant for tenant, _ in work}
    off, on = (_scheduler(engine, tenants, requests) for engine in engines)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    times: dict[bool, list[float]] = {False: [], True: []}
    checked: tuple[str, int, int, int] | None = None
    with tempfile.TemporaryDirectory(prefix="kvd-ev-", dir="/tmp") as directory:
        section = KVEventsSection(enable=True, endpoint=f"ipc://{directory}/pub")
        publisher = KVEventPublisher(section)
        reader = _Reader(section.endpoint)
        dynamo = None
        try:
            if indexer:
                from kvd.bench.fleet import DynamoIndexer

                say("starting Dynamo's KV indexer on the event socket")
                block = engines[1].layout.block_size
                dynamo = DynamoIndexer([section.endpoint], block, Path(directory) / "indexer.log")
            deadline = time.monotonic() + 60  # every subscriber in before the first step
            while publisher.subscribers_joined < 1 + indexer and time.monotonic() < deadline:
                time.sleep(0.01)
            publisher.attach(on.kv.enable_events())
            arrivals = iter(enumerate(work))
            pending = True
            say(f"{requests} requests, each step with and without events in turn")
            while pending or off.has_work() or on.has_work():
                if pending:  # two arrivals a step: prefills beside the decodes
                    for _ in range(2):
                        item = next(arrivals, None)
                        if item is None:
                            pending = False
                            break
                        i, (tenant, prompt) = item
                        for scheduler in (off, on):
                            scheduler.submit(f"r{i}", tenant, prompt, params)
                for scheduler, events in ((off, False), (on, True)):
                    start = time.perf_counter()
                    scheduler.step()
                    if events:
                        publisher.offer()
                    times[events].append(time.perf_counter() - start)
            for scheduler in (off, on):
                scheduler.kv.check_invariants()
            log = publisher.events
            assert log is not None
            told = log.stored_blocks + log.removed_blocks
            deadline = time.monotonic() + 10
            while publisher.published < publisher.accepted and time.monotonic() < deadline:
                time.sleep(0.01)
            if dynamo is not None:
                pool = on.kv.findable_blocks()["global"]
                (held,) = dynamo.caught_up([pool])
                checked = (dynamo.version, held, pool, dynamo.decode_errors())
        finally:
            publisher.close()
            reader.close()
            if dynamo is not None:
                dynamo.close()
    off_ms = statistics.fmean(times[False]) * 1e3
    on_ms = statistics.fmean(times[True]) * 1e3
    pairs = [b / a for a, b in zip(times[False], times[True], strict=True)]
    return KVEventsBenchReport(
        machine_description(),
        name,
        requests,
        len(pairs),
        off_ms,
        on_ms,
        on_ms / off_ms,
        statistics.median(pairs),
        told,
        reader.received,
        *(checked or ()),
    )


def render(report: KVEventsBenchReport) -> str:
    return "\n".join(
        [
            "kvd bench kv-events: the same steps with KV events off and on, in lockstep",
            "(on: logged, published over ZMQ and decoded by a subscriber thread)",
            f"machine: {report.machine}",
            f"model: {report.model}, {report.requests} requests, {report.steps} steps each",
            "",
            f"mean step, events off: {report.off_ms:9.2f} ms",
            f"mean step, events on:  {report.on_ms:9.2f} ms",
            f"on / off: {report.ratio:.3f}x over the run, {report.pair_ratio_p50:.3f}x median "
            "step pair",
            f"blocks told: {report.blocks_told:,}; batches received: {report.batches_received:,}",
        ]
        + (
            []
            if report.indexer is None
            else [
                f"Dynamo's KV indexer (ai-dynamo-runtime {report.indexer}) on the same socket: "
                f"holds {report.indexer_blocks} blocks, the pool {report.pool_blocks} "
                f"full-attention blocks; decode errors {report.indexer_decode_errors}"
            ]
        )
    )
