"""KV events as the routers operators run read them.

NVIDIA Dynamo's standalone KV indexer (PyPI ``ai-dynamo-runtime``, its Rust
decoder and radix tree) subscribes to an in-process replica's events, and
what it holds and scores is checked against the pool. llm-d's decoder is Go,
with no Python package: its wire rules are checked on the bytes kvd sends,
as its current vLLM adapter reads them (``pkg/kvevents/engineadapter``).
"""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import trio

from kvd.kv.events import FULL_ATTENTION, SALT_TAG
from tests.server.conftest import ALICE, BOB
from tests.server.harness import Served, serving, until
from tests.server.test_kv_events import events_config, published_all


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextmanager
def dynamo_indexer(endpoint: str, block_size: int, log: Path) -> Iterator[httpx.Client]:
    """Dynamo's indexer subscribed to ``endpoint`` as worker 1 (its HTTP API
    on a free port; it listens on every interface, and is asked only on
    127.0.0.1)."""
    port = free_port()
    command = [
        sys.executable, "-m", "dynamo.indexer", "--workers", f"1={endpoint}",
        "--block-size", str(block_size), "--port", str(port), "--threads", "1",
    ]  # fmt: skip
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            yield client
    finally:
        process.terminate()
        process.wait(timeout=30)


def indexer_up(client: httpx.Client) -> bool:
    try:
        return client.get("/health").status_code == 200
    except httpx.TransportError:
        return False


def dynamo_view(client: httpx.Client) -> set[int]:
    """The block hashes the indexer holds on the device, from its dump."""
    held: set[int] = set()
    for index in client.get("/dump").json().values():
        for entry in index["events"]:
            stored = entry["event"]["data"].get("stored")
            if stored is not None and entry["storage_tier"] == "device":
                held |= {block["block_hash"] for block in stored["blocks"]}
    return held


def full_attention_view(served: Served) -> set[int]:
    """What the pool holds of the full-attention groups (the ones a router
    can match a prompt against), as published hashes."""
    kv = served.scheduler.kv
    events = kv.pool.events
    assert events is not None
    groups = {g for g, spec in enumerate(events.groups) if spec.kind == FULL_ATTENTION}
    return {events.published((g, h)) for g, h in kv.pool.index if g in groups}


def score(client: httpx.Client, tokens: list[int], namespace: str | None = None) -> int:
    body: dict[str, Any] = {"token_ids": tokens, "model_name": "default"}
    if namespace is not None:
        body["cache_salt"] = namespace
    reply = client.post("/query", json=body)
    assert reply.status_code == 200, reply.text
    return sum(sum(ranks.values()) for ranks in reply.json()["scores"].values())


async def indexer_matches(client: httpx.Client, served: Served, what: str) -> None:
    """Until the indexer holds exactly the pool's full-attention blocks (it
    applies each batch soon after it is sent, on threads of its own)."""
    held: set[int] = set()
    try:
        with trio.fail_after(60):
            while True:
                await published_all(served)
                held = await trio.to_thread.run_sync(dynamo_view, client)
                if held == full_attention_view(served):
                    return
                await trio.sleep(0.05)
    except trio.TooSlowError:
        pool = full_attention_view(served)
        raise AssertionError(
            f"{what}: not within 60 s; the indexer holds {len(held)} blocks, the pool "
            f"{len(pool)}, {len(held & pool)} in common"
        ) from None


async def test_dynamos_indexer_holds_and_scores_what_the_pool_holds(tmp_path: Path) -> None:
    config, pub, _ = events_config(tmp_path)
    async with serving(tmp_path, config_path=config) as served:
        block = served.scheduler.kv.block_size
        with dynamo_indexer(pub, block, tmp_path / "indexer.log") as client:
            await until(lambda: indexer_up(client), "the indexer answers", timeout=60)
            publisher = served.daemon.kv_events
            assert publisher is not None
            await until(lambda: publisher.subscribers_joined, "the indexer subscribed", 60)
            house = list(range(300, 300 + 3 * block))  # a public prefix of 3 blocks
            code, body = await served.admin_json(
                "post", "/v1/prefixes", {"name": "house", "tokens": house}
            )
            assert code in (200, 201), body
            mine = [2, *range(1000, 1000 + 5 * block)]  # alice's alone
            for key, prompt in ((ALICE, mine), (ALICE, mine), (BOB, [2, *range(5000, 5050)])):
                reply = await served.complete(key, prompt, max_tokens=3)
                assert reply.status_code == 200, await reply.get_json()
            for key in (ALICE, BOB):
                reply = await served.complete(key, [*house, *range(7000, 7020)], max_tokens=2)
                assert reply.status_code == 200, await reply.get_json()
            await indexer_matches(client, served, "the indexer holds the pool's blocks")
            assert len(full_attention_view(served)) >= 5 + 3 + 3  # alice's, the prefix's, bob's
            status = await served.status()  # what kvctl status shows the operator
            held = await trio.to_thread.run_sync(dynamo_view, client)
            assert status["pool"]["findable_blocks"]["global"] == len(held)
            # Never a decode error: the log would say "Failed to decode".
            assert "Failed to decode" not in (tmp_path / "indexer.log").read_text()

            full = len(mine) // block * block
            assert await trio.to_thread.run_sync(score, client, mine, "tenant:alice") == full
            assert await trio.to_thread.run_sync(score, client, mine, "tenant:bob") == 0
            assert await trio.to_thread.run_sync(score, client, mine) == 0
            # A public prefix is unscoped: a query without a salt finds it for
            # anyone (Dynamo seeds every block of a salted query with the salt,
            # so a router asks both ways; docs/scale-out.md).
            assert await trio.to_thread.run_sync(score, client, house) == len(house)
            assert await trio.to_thread.run_sync(score, client, house, "tenant:bob") == 0

            # Evictions: distinct prompts until the pool drops cached blocks.
            kv = served.scheduler.kv
            before, n = kv.pool.evictions, 0
            while kv.pool.evictions == before:
                n += 1
                prompt = [2, *range(20_000 + 97 * n, 20_000 + 97 * n + 6 * block)]
                reply = await served.complete(BOB, prompt, max_tokens=2)
                assert reply.status_code == 200 and n < 500
            await indexer_matches(client, served, "the indexer followed the evictions")
            # A flush empties the pool's cache, and the indexer with it.
            code, _ = await served.admin_json("post", "/v1/flush")
            assert code == 200
            await indexer_matches(client, served, "the indexer followed the flush")
            assert await trio.to_thread.run_sync(score, client, mine, "tenant:alice") == 0
            assert "Failed to decode" not in (tmp_path / "indexer.log").read_text()


def llm_d_decode(payload: bytes) -> list[dict[str, Any]]:
    """A batch as llm-d's vLLM adapter decodes it (its Go code, as Python):
    an array of exactly ``[ts, events, data_parallel_rank]``; each event an
    array, its tag a string; ``BlockStored`` at least 5 long, hashes and a
    parent that are 64-bit integers (msgpack decodes narrower ones into
    types it refuses, and one bad event drops the batch), ``extra_keys``
    entries nil or arrays, ``group_idx`` >= 0; ``BlockRemoved`` at least 2."""
    batch = msgspec.msgpack.decode(payload)
    assert isinstance(batch, list) and len(batch) == 3
    ts, events, _rank = batch
    assert isinstance(ts, float)
    decoded = []
    for event in events:
        assert isinstance(event, list) and isinstance(event[0], str), event
        tag = event[0]
        if tag == "BlockStored":
            assert len(event) >= 5
            hashes, parent, tokens, size = event[1:5]
            field = (event + [None] * 12)[5:12]
            _lora_id, medium, lora_name, extra_keys, group, kind, window = field
            assert all(type(h) is int and 2**32 <= h < 2**64 for h in hashes)
            assert parent is None or 2**32 <= parent < 2**64
            assert all(type(t) is int for t in tokens) and type(size) is int
            assert extra_keys is None or all(e is None or isinstance(e, list) for e in extra_keys)
            assert group is None or (type(group) is int and group >= 0)
            assert medium in (None, "GPU", "CPU") and lora_name is None
            decoded.append(
                {"tag": tag, "hashes": hashes, "extra_keys": extra_keys, "kind": kind}
            )
        elif tag == "BlockRemoved":
            assert len(event) >= 2
            assert all(type(h) is int and 2**32 <= h < 2**64 for h in event[1])
            decoded.append({"tag": tag, "hashes": event[1]})
        else:
            assert tag == "AllBlocksCleared", event
            decoded.append({"tag": tag})
    return decoded


@pytest.mark.parametrize("private_blocks", ["token_ids", "hashes"])
async def test_every_batch_decodes_as_llm_d_decodes_it(tmp_path: Path, private_blocks: str) -> None:
    config, _, replay = events_config(tmp_path, private_blocks=private_blocks)
    async with serving(tmp_path, config_path=config) as served:
        for key in (ALICE, BOB, ALICE):
            reply = await served.complete(key, "The history of bread, " * 8, max_tokens=3)
            assert reply.status_code == 200
        await served.admin_json("post", "/v1/flush")
        await published_all(served)
        raw = await trio.to_thread.run_sync(raw_replay, replay)
        stored = [e for payload in raw for e in llm_d_decode(payload) if e["tag"] == "BlockStored"]
        assert stored and any(e["kind"] == FULL_ATTENTION for e in stored)
        # Scoped blocks carry their namespace as one tagged string, which llm-d
        # folds into its keys (a salted prefix never matches an unsalted
        # query there, as with vLLM's cache_salt).
        tagged = {k[0] for e in stored for k in e["extra_keys"] or [] if k}
        assert tagged == {f"{SALT_TAG}tenant:alice", f"{SALT_TAG}tenant:bob"}


def raw_replay(endpoint: str) -> list[bytes]:
    """Every batch's payload bytes from the replay socket, as sent."""
    import zmq

    from kvd.server.kvevents import END_OF_REPLAY

    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.connect(endpoint)
    payloads = []
    try:
        sock.send_multipart((b"", (0).to_bytes(8, "big")))
        while True:
            _empty, seq, payload = sock.recv_multipart()
            if seq == END_OF_REPLAY:
                return payloads
            payloads.append(payload)
    finally:
        sock.close()
        context.term()
