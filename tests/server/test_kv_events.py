"""KV events from a serving daemon, on real ZMQ sockets: what a gateway
subscribed to a replica (vLLM's PUB and replay protocol) learns is what the
replica's pool holds, a slow gateway never holds a step back, and a bad
``[kv_events]`` section is one line at start-up."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio
import zmq

from kvd.kv.events import GPU, EventEncoding, KVEventLog, PrivateBlocks, published_hash
from kvd.kv.scope import PUBLIC_SCOPE
from kvd.server.config import ConfigError, load_config
from kvd.server.kvevents import END_OF_REPLAY, KVEventPublisher, KVEventsError
from tests.conftest import short_dir
from tests.kv.conftest import Subscriber
from tests.server.conftest import ALICE, BOB, write_config
from tests.server.harness import Served, serving, until

PROMPT = "Tell me about the history of bread, " * 6


def events_config(tmp_path: Path, **section: Any) -> tuple[Path, str, str]:
    """The tiny config with ``[kv_events]`` on Unix-domain endpoints."""
    sockets = short_dir("kvd-ev-")
    pub, replay = f"ipc://{sockets}/pub", f"ipc://{sockets}/replay"
    values = {"enable": True, "endpoint": pub, "replay_endpoint": replay, "topic": "kvd"}
    values |= section
    lines = "\n".join(f"{k} = {msgspec.json.encode(v).decode()}" for k, v in values.items())
    path = write_config(tmp_path / "kvd.toml", host_size="4MiB")
    path.write_text(path.read_text() + f"\n[kv_events]\n{lines}\n")
    return path, pub, replay


def replay_from(endpoint: str, start: int) -> list[tuple[int, list[Any]]]:
    """Every batch from ``start`` the replay socket holds, decoded."""
    return [(seq, msgspec.msgpack.decode(p)) for seq, p in replay_payloads(endpoint, start)]


def replay_payloads(endpoint: str, start: int) -> list[tuple[int, bytes]]:
    """Ask the replay socket for every batch from ``start``: the 8-byte start
    sent, ``[seq, payload]`` read until seq -1 (a DEALER, which takes the
    ROUTER's many replies where a REQ would take one); the payloads as sent."""
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.connect(endpoint)
    batches = []
    try:
        sock.send_multipart((b"", start.to_bytes(8, "big")))
        while True:
            empty, seq, payload = sock.recv_multipart()
            assert empty == b""
            if seq == END_OF_REPLAY:
                assert payload == b""
                break
            batches.append((int.from_bytes(seq, "big"), payload))
    finally:
        sock.close()
        context.term()
    return batches


def apply_batches(subscriber: Subscriber, batches: list[tuple[int, list[Any]]]) -> None:
    for _, (ts, events, rank) in batches:
        assert isinstance(ts, float) and rank == 0
        subscriber.apply_decoded(events)


async def published_all(served: Served) -> None:
    publisher = served.daemon.kv_events
    assert publisher is not None
    await served.settled()
    await until(lambda: publisher.published == publisher.accepted, "the publisher caught up")


def pool_view(served: Served, medium: str = GPU) -> set[tuple[int, int]]:
    kv = served.scheduler.kv
    index = kv.registry.pool.index if medium == GPU else kv.registry.host.blocks
    events = kv.registry.pool.events
    assert events is not None
    return {(g, events.published((g, h))) for g, h in index}


async def test_a_gateway_following_the_events_holds_what_the_pool_holds(tmp_path: Path) -> None:
    config, pub, replay = events_config(tmp_path)
    async with serving(tmp_path, config_path=config) as served:
        live = zmq.Context()
        sub = live.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kvd")
        sub.connect(pub)
        try:
            for key in (ALICE, ALICE, BOB):
                reply = await served.complete(key, PROMPT, max_tokens=6)
                assert reply.status_code == 200, await reply.get_json()
            await served.admin_json("post", "/v1/flush")
            await served.complete(ALICE, PROMPT + " and cheese", max_tokens=6)
            await published_all(served)
            await served.assert_whole()
            batches = await trio.to_thread.run_sync(replay_from, replay, 0)
            # Every batch since the start, numbered from 0 without a gap.
            assert [seq for seq, _ in batches] == list(range(len(batches)))
            gateway = Subscriber()
            apply_batches(gateway, batches)
            assert gateway.held(GPU) == pool_view(served)
            assert gateway.held("CPU") == pool_view(served, "CPU")
            # And what the operator sees: every idle cached page is one block told.
            status = await served.status()
            assert len(gateway.held(GPU)) == status["pool"]["cached"] > 0
            assert len(gateway.held("CPU")) == status["host"]["cached_pages"]
            first_events = batches[0][1][1]
            assert first_events[0] == ["AllBlocksCleared"]  # arrays: the default form
            # Alice's and Bob's identical prompts are two scopes a router can tell apart.
            scopes = {n for n in gateway.namespace.values() if n is not None}
            assert scopes >= {"tenant:alice", "tenant:bob"}
            # The live stream: [topic, 8-byte seq, msgpack batch] (a late
            # subscriber may miss the first ones: that is what replays are for).
            await served.complete(BOB, "one more for the live socket", max_tokens=2)
            await published_all(served)
            frames = await trio.to_thread.run_sync(
                lambda: sub.poll(10_000) and sub.recv_multipart()
            )
            assert frames, "nothing on the PUB socket"
            topic, seq, payload = frames
            assert topic == b"kvd" and len(seq) == 8
            ts, events, rank = msgspec.msgpack.decode(payload)
            kinds = {"AllBlocksCleared", "BlockStored", "BlockRemoved"}
            assert events and all(event[0] in kinds for event in events)
            metrics = await served.metrics()
            assert metrics["kvd_kv_event_batches_total"] >= len(batches)
            assert metrics["kvd_kv_event_replays_total"] == 1
            assert metrics["kvd_kv_event_overflows_total"] == 0
        finally:
            sub.close(linger=0)
            live.term()


async def test_a_router_that_subscribes_late_learns_what_the_pool_holds(tmp_path: Path) -> None:
    """No replay asked: the XPUB hears the subscriber arrive and the next
    batch is a resync, here in the map form (``encoding = "map"``)."""
    config, pub, _ = events_config(tmp_path, encoding="map")
    async with serving(tmp_path, config_path=config) as served:
        for key in (ALICE, BOB):
            reply = await served.complete(key, PROMPT, max_tokens=4)
            assert reply.status_code == 200
        await published_all(served)
        context = zmq.Context()
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.RCVTIMEO, 30_000)
        sub.connect(pub)
        try:
            gateway = Subscriber(EventEncoding.MAP)

            def follow_until_resynced() -> None:
                while True:  # batches before the resync may be partial: skipped
                    _topic, _seq, payload = sub.recv_multipart()
                    _ts, events, _rank = msgspec.msgpack.decode(payload)
                    if events and events[0] == {"type": "AllBlocksCleared"}:
                        gateway.apply_decoded(events)
                        return

            await trio.to_thread.run_sync(follow_until_resynced)
            await published_all(served)  # the daemon is idle: nothing follows
            assert gateway.held(GPU) == pool_view(served) != set()
            assert {n for n in gateway.namespace.values()} >= {"tenant:alice", "tenant:bob"}
            assert served.daemon.kv_events is not None
            assert served.daemon.kv_events.subscribers_joined == 1
        finally:
            sub.close(linger=0)
            context.term()


async def test_private_blocks_can_be_kept_from_the_gateway(tmp_path: Path) -> None:
    config, _, replay = events_config(tmp_path, private_blocks="none")
    async with serving(tmp_path, config_path=config) as served:
        await served.admin_json(
            "post", "/v1/prefixes", {"name": "house", "text": "You are a helpful baker. " * 4}
        )
        reply = await served.complete(ALICE, "You are a helpful baker. " * 4 + PROMPT)
        assert reply.status_code == 200
        await published_all(served)
        gateway = Subscriber()
        apply_batches(gateway, await trio.to_thread.run_sync(replay_from, replay, 0))
        told = gateway.held(GPU)
        assert told and told < pool_view(served)  # the public prefix, not alice's own blocks
        assert all(gateway.namespace[key] is None for key in told)


class HeldPublisher(KVEventPublisher):
    """A publisher whose thread waits (a gateway that cannot keep up)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        self.release = threading.Event()
        super().__init__(*args, **kw)

    def _run(self) -> None:
        self.release.wait()
        super()._run()


def test_a_full_queue_costs_the_step_nothing_and_ends_in_a_resync(tmp_path: Path) -> None:
    config, _, replay = events_config(tmp_path, max_queue=1)
    section = load_config(config).kv_events
    publisher = HeldPublisher(section)
    try:
        log = KVEventLog(4, [], PrivateBlocks.TOKEN_IDS)
        publisher.attach(log)
        first = published_hash(None, PUBLIC_SCOPE, [1, 2, 3, 4])
        second = published_hash(first, PUBLIC_SCOPE, [5, 6, 7, 8])
        log.stored((0, b"a" * 32), first, None, [1, 2, 3, 4], PUBLIC_SCOPE)
        publisher.offer()  # queued
        log.stored((0, b"b" * 32), second, first, [5, 6, 7, 8], PUBLIC_SCOPE)
        publisher.offer()  # the queue is full: not queued, never waited for
        log.removed((0, b"a" * 32), GPU)
        publisher.offer()
        assert publisher.overflows == 2 and publisher.accepted == 1
        publisher.release.set()
        while publisher.published < 1:
            threading.Event().wait(0.01)
        publisher.offer()  # room again: a resync
        assert publisher.accepted == 2
        while publisher.published < 2:
            threading.Event().wait(0.01)
        gateway = Subscriber()
        apply_batches(gateway, replay_from(publisher.replay_endpoint or replay, 0))
        assert gateway.held(GPU) == {(0, second)}
    finally:
        publisher.release.set()
        publisher.close()


def test_a_bad_kv_events_section_is_one_line(tmp_path: Path) -> None:
    config, _, _ = events_config(tmp_path, endpoint="tcp://nowhere")
    with pytest.raises(ConfigError, match=r"kv_events.endpoint: 'tcp://nowhere' is not a ZMQ"):
        load_config(config)
    config, _, _ = events_config(tmp_path, private_blocks="some")
    with pytest.raises(ConfigError, match="kv_events.private_blocks"):
        load_config(config)
    config, _, _ = events_config(tmp_path, encoding="json")
    with pytest.raises(ConfigError, match="kv_events.encoding"):
        load_config(config)
    # Any port (the OS picks: the log says which), then one already taken.
    config, _, _ = events_config(
        tmp_path, endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*"
    )
    section = load_config(config).kv_events
    first = KVEventPublisher(section)
    try:
        assert first.replay_endpoint is not None and not first.replay_endpoint.endswith("*")
        taken = msgspec.structs.replace(section, replay_endpoint=first.replay_endpoint)
        with pytest.raises(KVEventsError, match="kv_events.replay_endpoint: cannot bind"):
            KVEventPublisher(taken)
    finally:
        first.close()
