"""KV events: what a gateway subscribed to a replica learns, block by block,
and that it never learns more of a tenant's blocks than the operator chose."""

from __future__ import annotations

import msgspec
import pytest

from kvd.kv import KVManager, PageLayout
from kvd.kv.events import GPU, BlockStored, EventEncoding, PrivateBlocks, published_hash
from kvd.kv.scope import PUBLIC_SCOPE
from kvd.kv.sequence import Sequence
from tests.kv.conftest import BLOCK, Subscriber, make_kv

PREFIX = [11, 12, 13, 14, 15, 16, 17, 18]  # two full blocks


def prefill(kv: KVManager, seq: Sequence) -> int:
    hit = kv.lookup(seq)
    kv.allocate(seq, len(seq.tokens) - hit.num_tokens, hit)
    kv.commit(seq, len(seq.tokens) - hit.num_tokens)
    kv.check_invariants()
    return hit.num_tokens


def run(kv: KVManager, seq_id: int, tenant: str, tokens: list[int], **kw: object) -> Sequence:
    seq = kv.add_sequence(seq_id, tenant, tokens, **kw)  # type: ignore[arg-type]
    prefill(kv, seq)
    kv.finish(seq)
    kv.check_invariants()
    return seq


def view(kv: KVManager, medium: str = GPU) -> set[tuple[int, int]]:
    index = kv.registry.pool.index if medium == GPU else kv.registry.host.blocks
    events = kv.registry.pool.events
    assert events is not None
    return {(g, events.published((g, h))) for g, h in index}


@pytest.mark.parametrize("encoding", list(EventEncoding))
def test_a_subscriber_learns_each_tenants_blocks_with_their_scope(
    layout: PageLayout, encoding: EventEncoding
) -> None:
    kv = make_kv(layout)
    events = kv.enable_events()
    sub = Subscriber(encoding)
    kv.add_public_prefix("system", PREFIX)
    prompt = [*PREFIX, 1, 2, 3, 4, 5]  # 2 public blocks, 1 private, 1 token over
    run(kv, 1, "a", prompt)
    run(kv, 2, "b", prompt)
    run(kv, 3, "b", prompt, cache_salt="s")
    sub.apply(events.take())
    assert sub.held(GPU) == view(kv)
    # One public chain (each tenant hit it), three private third blocks:
    # the same tokens, three scopes, three hashes.
    third = [k for k, t in sub.tokens.items() if t == [1, 2, 3, 4]]
    assert len({h for _, h in third}) == 3
    assert {sub.namespace[k] for k in third} == {"tenant:a", "tenant:b", "tenant:b:s"}
    public = [k for k, t in sub.tokens.items() if t in (PREFIX[:BLOCK], PREFIX[BLOCK:])]
    assert public and all(sub.namespace[k] is None for k in public)
    # Each private block's parent is the public chain's last block.
    last_public = {h for (g, h), t in sub.tokens.items() if t == PREFIX[BLOCK:]}
    assert all(sub.parents[k] in last_public for k in third)


@pytest.mark.parametrize("choice", list(PrivateBlocks))
def test_the_operator_chooses_what_a_private_block_reveals(
    layout: PageLayout, choice: PrivateBlocks
) -> None:
    kv = make_kv(layout)
    events = kv.enable_events(choice)
    sub = Subscriber()
    kv.add_public_prefix("system", PREFIX)
    run(kv, 1, "a", [*PREFIX, 1, 2, 3, 4, 5])
    sub.apply(events.take())
    private = {k for k, namespace in sub.namespace.items() if namespace is not None}
    public = sub.held(GPU) - private
    assert public and all(sub.tokens[k] for k in public)  # public text is always told
    # What anyone can compute of the text: the chain of published hashes.
    first = published_hash(None, PUBLIC_SCOPE, PREFIX[:BLOCK])
    second = published_hash(first, PUBLIC_SCOPE, PREFIX[BLOCK:])
    guess = published_hash(second, msgspec.msgpack.encode(("tenant", "a", None)), [1, 2, 3, 4])
    assert {h for _, h in public} == {first, second}
    if choice is PrivateBlocks.TOKEN_IDS:
        assert private and all(sub.tokens[k] == [1, 2, 3, 4] for k in private)
        assert {h for _, h in private} == {guess}
        assert sub.held(GPU) == view(kv)
    elif choice is PrivateBlocks.HASHES:
        assert private and all(sub.tokens[k] == [] for k in private)
        # Without its tokens, a guess of a tenant's text cannot be checked
        # against its hash: that is keyed with the process's secret.
        assert {h for _, h in private} & {guess} == set()
        assert all(sub.parents[k] == second for k in private)
        assert sub.held(GPU) == view(kv)
    else:
        assert not private and sub.held(GPU) < view(kv)
    kv.flush_cache()
    sub.apply(events.take())  # removals of blocks it never learned are not sent either
    assert sub.held(GPU) == view(kv)


def test_blocks_moving_between_the_tiers_are_told_in_order(layout: PageLayout) -> None:
    kv = make_kv(layout, pages=24)
    kv.enable_host_cache(32)
    events = kv.enable_events()
    sub = Subscriber()
    first = [*range(100, 112), 7]  # 3 full blocks
    hashes = run(kv, 1, "a", first).hashes
    i = 1
    while any((0, h) in kv.registry.pool.index for h in hashes):  # pushed out to the host cache
        i += 1
        run(kv, i, "b", [*range(200 * i, 200 * i + 12), 7])
        sub.apply(events.take())
        kv.registry.host.take_copies()
    assert sub.held(GPU) == view(kv) and sub.held("CPU") == view(kv, "CPU")
    assert sub.held("CPU"), "nothing reached the host cache"
    again = kv.add_sequence(9, "a", first)
    hit = kv.lookup(again)
    assert hit.reloads  # from the host cache back to the device
    kv.allocate(again, len(first) - hit.num_tokens, hit)
    sub.apply(events.take())
    assert sub.held(GPU) == view(kv) and sub.held("CPU") == view(kv, "CPU")
    kv.check_invariants()


def test_a_resync_tells_everything_held_from_scratch(layout: PageLayout) -> None:
    kv = make_kv(layout, pages=16)
    kv.enable_host_cache(32)
    events = kv.enable_events()
    for i in range(1, 8):
        run(kv, i, "a" if i % 2 else "b", [*range(50 * i, 50 * i + 12), 7])
        kv.registry.host.take_copies()
    events.take()  # lost: this subscriber joins late
    late = Subscriber()
    late.blocks["GPU"].add((0, 1))  # stale belief, cleared by the resync
    late.apply(events.resync())
    assert late.held(GPU) == view(kv) and late.held("CPU") == view(kv, "CPU")


def test_a_run_of_blocks_is_one_event_per_group(layout: PageLayout) -> None:
    kv = make_kv(layout)
    events = kv.enable_events()
    events.take()
    run(kv, 1, "a", [*range(30, 42), 7])  # 3 full blocks, in each of the 3 page groups
    stored = [e for e in events.take() if isinstance(e, BlockStored)]
    assert sorted(e.group_idx for e in stored if e.group_idx is not None) == [0, 1, 2]
    global_group = next(e for e in stored if e.kv_cache_spec_kind == "full_attention")
    assert len(global_group.block_hashes) == 3 and global_group.parent_block_hash is None
    assert global_group.token_ids == list(range(30, 42))
    assert all(
        e.kv_cache_spec_sliding_window == 8
        for e in stored
        if e.kv_cache_spec_kind != "full_attention"
    )


def test_a_block_two_requests_computed_stays_findable_while_either_holds_it(
    layout: PageLayout,
) -> None:
    """Two requests prefill the same text at once (neither could hit the
    other's blocks): the second's pages are spares of the first's keys. When
    the first's pages are evicted, the spares take the keys over, so the
    second's later blocks still chain on a findable parent, and a router
    following the events never sees a block whose parent it was told is gone."""
    kv = make_kv(layout, pages=40)
    events = kv.enable_events()
    sub = Subscriber()
    text = [*range(100, 108), 9]  # 2 full blocks and a token
    first, second = kv.add_sequence(1, "a", text), kv.add_sequence(2, "a", text)
    for seq in (first, second):  # both look up before either has registered
        kv.allocate(seq, len(text), kv.lookup(seq))
    for seq in (first, second):
        kv.commit(seq, len(text))
    kv.finish(first)
    assert kv.flush_cache() > 0  # the first's pages go: the second's take their keys
    sub.apply(events.take())
    assert sub.held(GPU) == view(kv) and len({h for _, h in view(kv)}) == 2
    again = kv.add_sequence(3, "a", [*text[:8], 1, 2, 3, 4, 5])
    assert prefill(kv, again) == 8  # the two blocks, from the second's pages
    kv.check_invariants()
    kv.finish(second)
    kv.finish(again)
    sub.apply(events.take())
    assert sub.held(GPU) == view(kv)
    kv.check_invariants()


def test_blocks_past_one_no_lookup_can_reach_leave_the_cache(layout: PageLayout) -> None:
    """A full-attention block whose parent is findable nowhere is no use to a
    lookup, which walks a chain from its first block: it leaves the device's
    cache with everything after it (as a router's tree drops a removed
    block's descendants), and a block cannot join the cache after such a
    parent. Here a parent released before its child goes to the host cache
    first, and the host cache then drops it (the pool alone: no sequence
    holds these pages)."""
    kv = make_kv(layout, pages=24)
    kv.enable_host_cache(8)
    pool, g = kv.registry.pool, kv.registry.global_groups[0]
    parent, child, grandchild = ((g, bytes([n]) * 32) for n in (1, 2, 3))
    pages = pool.take("a", 3)
    assert pool.register(pages[0], parent, None)
    assert pool.register(pages[1], child, None, parent)
    assert pool.register(pages[2], grandchild, None, child)
    assert not pool.register(pool.take("a", 1)[0], (g, b"x" * 32), None, (g, b"y" * 32))
    for page in pages:  # parent first: the head of the LRU
        pool.drop(page, "a")
    pool.take("b", pool.num_idle() - 2)  # evicts the parent (to the host cache) and the rest
    assert parent in kv.registry.host and {child, grandchild} <= pool.index.keys()
    kv.registry.host.drop_where()  # the host lets it go: nothing reaches the other two now
    assert not {child, grandchild} & pool.index.keys() and pool.num_idle() == 2
    pool.check_invariants()


def test_replicas_publish_the_same_block_under_the_same_hash(layout: PageLayout) -> None:
    """A router's index shares one tree across workers (Dynamo's does): the
    same tenant's same text has one published hash on every replica, and
    another tenant's the same text another."""
    told = []
    for _replica in range(2):
        kv = make_kv(layout)
        events = kv.enable_events()
        sub = Subscriber()
        for seq_id, tenant in ((1, "a"), (2, "b")):
            run(kv, seq_id, tenant, [*range(40, 52), 3])
        sub.apply(events.take())
        told.append({(sub.namespace[k], k) for k in sub.held(GPU)})
    assert told[0] == told[1]
    by_tenant = {namespace: {k for n, k in told[0] if n == namespace} for namespace, _ in told[0]}
    assert by_tenant["tenant:a"] and not by_tenant["tenant:a"] & by_tenant["tenant:b"]
