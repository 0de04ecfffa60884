"""KV events as the routers operators run read them.

NVIDIA Dynamo's standalone KV indexer (PyPI ``ai-dynamo-runtime``, its Rust
decoder and radix tree) subscribes to an in-process replica's events, and
what it holds and scores is checked against the pool. llm-d's decoder is Go,
with no Python package: its wire rules are checked on the bytes kvd sends,
as its current vLLM adapter reads them (``pkg/kvevents/engineadapter``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio

from kvd.bench.fleet import DynamoIndexer
from kvd.kv.events import FULL_ATTENTION, SALT_TAG
from tests.server.conftest import ALICE, BOB
from tests.server.harness import Served, serving, until
from tests.server.test_kv_events import events_config, published_all, replay_payloads


def full_attention_view(served: Served) -> set[int]:
    """What the pool holds of the full-attention groups (the ones a router
    can match a prompt against), as published hashes."""
    kv = served.scheduler.kv
    events = kv.registry.pool.events
    assert events is not None
    groups = {g for g, spec in enumerate(events.groups) if spec.kind == FULL_ATTENTION}
    return {events.published((g, h)) for g, h in kv.registry.pool.index if g in groups}


def score(indexer: DynamoIndexer, tokens: list[int], namespace: str | None = None) -> int:
    """Prompt tokens the indexer finds cached (the one replica), in ``namespace``."""
    return sum(indexer.scores(tokens, namespace).values())


async def indexer_matches(indexer: DynamoIndexer, served: Served, what: str) -> None:
    """Until the indexer holds exactly the pool's full-attention blocks (it
    applies each batch soon after it is sent, on threads of its own)."""
    held: set[int] = set()
    try:
        with trio.fail_after(60):
            while True:
                await published_all(served)
                held = (await trio.to_thread.run_sync(indexer.held, 1))[0]
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
        log = tmp_path / "indexer.log"
        # Its HTTP API listens on every interface (it has no option to
        # narrow it); it is only ever asked on 127.0.0.1.
        indexer = await trio.to_thread.run_sync(DynamoIndexer, [pub], block, log)
        try:
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
            await indexer_matches(indexer, served, "the indexer holds the pool's blocks")
            assert len(full_attention_view(served)) >= 5 + 3 + 3  # alice's, the prefix's, bob's
            status = await served.status()  # what kvctl status shows the operator
            held = await trio.to_thread.run_sync(indexer.blocks, 1)
            assert [status["pool"]["findable_blocks"]["global"]] == held
            assert indexer.decode_errors() == 0

            full = len(mine) // block * block
            assert await trio.to_thread.run_sync(score, indexer, mine, "tenant:alice") == full
            assert await trio.to_thread.run_sync(score, indexer, mine, "tenant:bob") == 0
            assert await trio.to_thread.run_sync(score, indexer, mine) == 0
            # A public prefix is unscoped: a query without a salt finds it for
            # anyone (Dynamo seeds every block of a salted query with the salt,
            # so a router asks both ways; docs/howto/scale-out.md).
            assert await trio.to_thread.run_sync(score, indexer, house) == len(house)
            assert await trio.to_thread.run_sync(score, indexer, house, "tenant:bob") == 0

            # Evictions: distinct prompts until the pool drops cached blocks.
            kv = served.scheduler.kv
            before, n = kv.registry.pool.evictions, 0
            while kv.registry.pool.evictions == before:
                n += 1
                prompt = [2, *range(20_000 + 97 * n, 20_000 + 97 * n + 6 * block)]
                reply = await served.complete(BOB, prompt, max_tokens=2)
                assert reply.status_code == 200 and n < 500
            await indexer_matches(indexer, served, "the indexer followed the evictions")
            # A flush empties the pool's cache, and the indexer with it.
            code, _ = await served.admin_json("post", "/v1/flush")
            assert code == 200
            await indexer_matches(indexer, served, "the indexer followed the flush")
            assert await trio.to_thread.run_sync(score, indexer, mine, "tenant:alice") == 0
            assert indexer.decode_errors() == 0
            # Nor did it ever miss a parent or a block to remove: its tree was ours.
            assert "Failed to find" not in log.read_text()
        finally:
            indexer.close()


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
            decoded.append({"tag": tag, "hashes": hashes, "extra_keys": extra_keys, "kind": kind})
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
        raw = await trio.to_thread.run_sync(replay_payloads, replay, 0)
        stored = [e for _, p in raw for e in llm_d_decode(p) if e["tag"] == "BlockStored"]
        assert stored and any(e["kind"] == FULL_ATTENTION for e in stored)
        # Scoped blocks carry their namespace as one tagged string, which llm-d
        # folds into its keys (a salted prefix never matches an unsalted
        # query there, as with vLLM's cache_salt).
        tagged = {k[0] for e in stored for k in e["extra_keys"] or [] if k}
        assert tagged == {f"{SALT_TAG}tenant:alice", f"{SALT_TAG}tenant:bob"}
