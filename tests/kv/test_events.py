"""KV events: what a gateway subscribed to a replica learns, block by block,
and that it never learns more of a tenant's blocks than the operator chose."""

from __future__ import annotations

import pytest

from kvd.kv import KVManager, PageLayout
from kvd.kv.events import GPU, BlockStored, EventEncoding, PrivateBlocks, external_hash
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
    index = kv.pool.index if medium == GPU else kv.host.blocks
    return {(g, external_hash(h)) for g, h in index}


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
    if choice is PrivateBlocks.TOKEN_IDS:
        assert private and all(sub.tokens[k] == [1, 2, 3, 4] for k in private)
        assert sub.held(GPU) == view(kv)
    elif choice is PrivateBlocks.HASHES:
        assert private and all(sub.tokens[k] == [] for k in private)
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
    while any((0, h) in kv.pool.index for h in hashes):  # pushed out to the host cache
        i += 1
        run(kv, i, "b", [*range(200 * i, 200 * i + 12), 7])
        sub.apply(events.take())
        kv.host.take_copies()
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
        kv.host.take_copies()
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
