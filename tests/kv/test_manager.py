"""The KV manager: lazy paging, sliding windows, prefix hits and scopes, swapping."""

from __future__ import annotations

import pytest

from kvd.kv import (
    NULL_PAGE,
    SHARED_ACCOUNT,
    BudgetError,
    KVError,
    KVManager,
    PageLayout,
    Residency,
    SharingPolicy,
    TenantBudget,
    build_layout,
)
from tests.kv.conftest import BLOCK, global_only_geometry, make_kv


def compute(kv: KVManager, seq, n: int, hit=None) -> None:  # type: ignore[no-untyped-def]
    kv.allocate(seq, n, hit)
    kv.commit(seq, n)


def prefill(kv: KVManager, seq) -> int:  # type: ignore[no-untyped-def]
    """Look up, allocate and compute the whole prompt; returns cached tokens."""
    hit = kv.lookup(seq)
    compute(kv, seq, len(seq.tokens) - hit.num_tokens, hit)
    kv.check_invariants()
    return hit.num_tokens


def evict_cached_page(kv: KVManager, page: int) -> None:
    """Make the pool forget one idle cached page (as LRU pressure would)."""
    del kv.registry.pool.lru[page]
    kv.registry.pool._forget(page)
    kv.registry.pool.free.append(page)


def test_layout_of_the_tiny_model(layout: PageLayout) -> None:
    assert [g.kind.value for g in layout.groups] == ["global", "sliding", "sliding"]
    assert [g.layers for g in layout.groups] == [(2,), (0, 1), (3, 4)]


def test_pages_are_allocated_per_block_on_demand(layout: PageLayout) -> None:
    kv = make_kv(layout)
    seq = kv.add_sequence(1, "a", list(range(10)))
    compute(kv, seq, 1)
    assert seq.num_blocks == 1 and kv.registry.ledger.accounts["a"].used == 3
    compute(kv, seq, 3)
    assert seq.num_blocks == 1  # block 0 is full, nothing new
    compute(kv, seq, 1)
    assert seq.num_blocks == 2 and kv.registry.ledger.accounts["a"].used == 6
    kv.check_invariants()
    kv.finish(seq)
    assert (
        kv.registry.ledger.accounts["a"].used == 0
        and kv.registry.pool.num_idle() == kv.registry.pool.capacity
    )
    kv.check_invariants()


def test_sliding_groups_release_blocks_outside_the_window(layout: PageLayout) -> None:
    kv = make_kv(layout)
    seq = kv.add_sequence(1, "a", list(range(40)))
    for computed in range(1, 41):
        compute(kv, seq, 1)
        first = max(0, (computed - 8 + 1) // BLOCK)  # the first block a next query sees
        for g in kv.registry.sliding_groups:
            table = seq.tables[g]
            assert all(p == NULL_PAGE for p in table[:first])
            assert all(p != NULL_PAGE for p in table[first:])
            assert len(table) - first <= 3  # window/block + the block being filled
        assert all(p != NULL_PAGE for p in seq.tables[0])  # global keeps everything
        kv.check_invariants()
    # A 40-token sequence holds 10 global pages and at most 3 per sliding group.
    assert kv.registry.ledger.accounts["a"].used == 10 + 2 * 2


def test_chunked_prefill_holds_window_plus_chunk_then_slides(layout: PageLayout) -> None:
    kv = make_kv(layout)
    seq = kv.add_sequence(1, "a", list(range(24)))
    kv.allocate(seq, 24)
    assert all(NULL_PAGE not in t and len(t) == 6 for t in seq.tables)  # the chunk needs them
    kv.commit(seq, 24)
    assert [sum(1 for p in t if p) for t in seq.tables] == [6, 2, 2]
    kv.check_invariants()


def test_prefix_hit_within_a_tenant(layout: PageLayout) -> None:
    kv = make_kv(layout)
    a = kv.add_sequence(1, "a", list(range(13)))
    assert prefill(kv, a) == 0
    kv.finish(a)
    b = kv.add_sequence(2, "a", list(range(13)) + [99, 98, 97])
    hit = kv.lookup(b)
    assert hit.num_tokens == 12 and hit.sliding_start == 1
    assert all(p != NULL_PAGE for p in hit.pages[0])
    assert all(t[0] == NULL_PAGE and NULL_PAGE not in t[1:] for t in hit.pages[1:])
    compute(kv, b, 4, hit)
    assert b.cached_tokens == 12
    assert (kv.prefix_hit_tokens, kv.prefix_query_tokens) == (12, 13 + 16)
    kv.check_invariants()


def test_a_hit_always_leaves_a_token_to_compute(layout: PageLayout) -> None:
    kv = make_kv(layout)
    a = kv.add_sequence(1, "a", list(range(8)))
    prefill(kv, a)
    b = kv.add_sequence(2, "a", list(range(8)))
    assert kv.lookup(b).num_tokens == 4  # two full blocks cached, but logits need the last token


def test_sliding_hit_needs_the_in_window_blocks(layout: PageLayout) -> None:
    kv = make_kv(layout)
    tokens = list(range(13))
    a = kv.add_sequence(1, "a", tokens)
    prefill(kv, a)
    kv.finish(a)
    # Lose block 2 of one sliding group: a 12-token hit would need blocks 1 and 2.
    evict_cached_page(kv, kv.registry.pool.index[(1, a.hashes[2])])
    b = kv.add_sequence(2, "a", tokens + [50, 51, 52])
    hit = kv.lookup(b)
    assert hit.num_tokens == 8 and hit.sliding_start == 0
    # Losing an out-of-window block does not matter: block 0 is not needed at 12.
    kv2 = make_kv(layout)
    a2 = kv2.add_sequence(1, "a", tokens)
    prefill(kv2, a2)
    kv2.finish(a2)
    for g in kv2.registry.sliding_groups:
        evict_cached_page(kv2, kv2.registry.pool.index[(g, a2.hashes[0])])
    assert kv2.lookup(kv2.add_sequence(2, "a", tokens + [50, 51, 52])).num_tokens == 12


def test_global_only_models_hit_every_full_block() -> None:
    kv = make_kv(build_layout(global_only_geometry(), BLOCK))
    a = kv.add_sequence(1, "a", list(range(20)))
    prefill(kv, a)
    b = kv.add_sequence(2, "a", list(range(20)) + [1])
    assert kv.lookup(b).num_tokens == 20


PREFIX = [7, 7, 7, 7, 8, 8, 8, 8]  # two full blocks


@pytest.mark.parametrize(
    ("policy", "same_salt", "expected"),
    [
        (SharingPolicy.ISOLATED, True, 0),
        (SharingPolicy.PUBLIC, True, 0),
        (SharingPolicy.SHARED, True, 12),
        (SharingPolicy.SHARED, False, 0),
    ],
)
def test_cross_tenant_hits_follow_the_policy(
    layout: PageLayout, policy: SharingPolicy, same_salt: bool, expected: int
) -> None:
    kv = make_kv(layout, policy=policy)
    tokens = list(range(13))
    a = kv.add_sequence(1, "a", tokens, cache_salt="s")
    prefill(kv, a)
    b = kv.add_sequence(2, "b", tokens + [1], cache_salt="s" if same_salt else "t")
    assert kv.lookup(b).num_tokens == expected


def test_cache_salt_splits_a_tenant(layout: PageLayout) -> None:
    kv = make_kv(layout)
    prefill(kv, kv.add_sequence(1, "a", list(range(13)), cache_salt="x"))
    assert kv.lookup(kv.add_sequence(2, "a", list(range(13)) + [1])).num_tokens == 0
    assert (
        kv.lookup(kv.add_sequence(3, "a", list(range(13)) + [1], cache_salt="x")).num_tokens == 12
    )


def test_public_prefix_is_the_only_cross_tenant_hit(layout: PageLayout) -> None:
    kv = make_kv(layout)
    kv.add_public_prefix("system", PREFIX + [9])  # 9 tokens: 2 full public blocks
    a = kv.add_sequence(1, "a", PREFIX + [9, 1, 2, 3, 4, 5])
    prefill(kv, a)
    # Public blocks are charged to the shared account, the rest to the tenant;
    # at 14 tokens the sliding groups already let public block 0 go (idle, cached).
    assert kv.registry.ledger.accounts[SHARED_ACCOUNT].used == 3 + 1
    b = kv.add_sequence(2, "b", PREFIX + [9, 1, 2, 3, 4, 5])
    hit = kv.lookup(b)
    assert hit.num_tokens == 8  # the public blocks, not a's own third block
    compute(kv, b, len(b.tokens) - 8, hit)
    assert kv.registry.public.hits["system"] == 8
    kv.check_invariants()
    # Salted requests still share the public prefix: its text is public.
    c = kv.add_sequence(3, "b", PREFIX + [9, 6], cache_salt="zz")
    assert kv.lookup(c).num_tokens == 8
    # Under isolated, public prefixes are scoped like everything else.
    kv.set_policy(SharingPolicy.ISOLATED)
    d = kv.add_sequence(4, "b", PREFIX + [9, 6])
    assert kv.lookup(d).num_tokens == 0


def test_public_prefixes_match_by_the_full_blocks_that_agree(layout: PageLayout) -> None:
    """A request that leaves the prefix in its partial last block, or in a
    later full block (a tokenizer merge at the boundary), still shares every
    full block before that point: one token of difference costs one block,
    not the match."""
    kv = make_kv(layout)
    kv.add_public_prefix("system", PREFIX + [9])  # 2 full blocks and a partial one
    a = kv.add_sequence(1, "a", PREFIX + [7, 1, 2, 3])  # differs in the partial block
    prefill(kv, a)
    b = kv.add_sequence(2, "b", PREFIX + [6, 5, 4, 3])
    assert kv.lookup(b).num_tokens == 2 * BLOCK  # a's public blocks
    c = kv.add_sequence(3, "b", PREFIX[:BLOCK] + [5] * BLOCK)  # differs in block 1
    assert kv.lookup(c).num_tokens == BLOCK
    assert kv.registry.public.matches(PREFIX[:BLOCK] + [5] * BLOCK, BLOCK) == [("system", 1, 1)]
    assert kv.registry.public.matches([5] * 2 * BLOCK, BLOCK) == []
    kv.check_invariants()


def test_removing_a_public_prefix_unpublishes_its_pages(layout: PageLayout) -> None:
    kv = make_kv(layout)
    kv.add_public_prefix("system", PREFIX)
    kv.add_public_prefix("short", PREFIX[:4])
    a = kv.add_sequence(1, "a", PREFIX + [1])
    prefill(kv, a)
    assert kv.registry.ledger.accounts[SHARED_ACCOUNT].used == 6
    kv.remove_public_prefix("system")  # block 0 is still covered by "short"
    assert kv.registry.ledger.accounts[SHARED_ACCOUNT].used == 3
    assert kv.registry.ledger.accounts["a"].used == 6
    kv.check_invariants()
    kv.remove_public_prefix("short")
    assert kv.registry.ledger.accounts[SHARED_ACCOUNT].used == 0
    assert kv.lookup(kv.add_sequence(2, "b", PREFIX + [1])).num_tokens == 0
    kv.finish(a)
    kv.check_invariants()
    with pytest.raises(KeyError):
        kv.remove_public_prefix("short")


def test_public_prefixes_count_against_reservations(layout: PageLayout) -> None:
    kv = make_kv(layout, pages=20, tenants={"a": TenantBudget(reservation=16)})
    with pytest.raises(BudgetError, match="pool has 19 pages"):
        kv.add_public_prefix("system", PREFIX)  # 2 blocks x 3 groups = 6 pages > 3 left
    assert len(kv.registry.public) == 0 and kv.registry.ledger.public_bound == 0
    kv.add_public_prefix("tiny", PREFIX[:4])
    with pytest.raises(ValueError, match="already exists"):
        kv.add_public_prefix("tiny", PREFIX[:4])
    assert kv.registry.ledger.public_bound == 3


def test_shared_pages_move_to_the_next_holder(layout: PageLayout) -> None:
    kv = make_kv(layout, policy=SharingPolicy.SHARED)
    a = kv.add_sequence(1, "a", list(range(9)))
    prefill(kv, a)
    b = kv.add_sequence(2, "b", list(range(9)))
    prefill(kv, b)
    assert kv.registry.ledger.accounts["a"].used == 9 and kv.registry.ledger.accounts["b"].used == 3
    kv.finish(a)
    assert kv.registry.ledger.accounts["b"].used == 9
    kv.check_invariants()


def test_release_keeps_tokens_and_a_re_prefill_hits_itself(layout: PageLayout) -> None:
    kv = make_kv(layout)
    seq = kv.add_sequence(1, "a", list(range(10)))
    prefill(kv, seq)
    kv.append_tokens(seq, [42])
    compute(kv, seq, 1)
    kv.release(seq)
    assert (
        seq.residency is Residency.WAITING
        and seq.num_computed == 0
        and kv.registry.ledger.accounts["a"].used == 0
    )
    assert prefill(kv, seq) == 8
    kv.check_invariants()


def test_swap_out_and_in_remaps_pages(layout: PageLayout) -> None:
    kv = make_kv(layout)
    seq = kv.add_sequence(1, "a", list(range(14)))
    prefill(kv, seq)
    held = {(g, b): p for g, t in enumerate(seq.tables) for b, p in enumerate(t) if p}
    out = kv.begin_swap_out(seq)
    assert {(c.group, c.block): c.page for c in out} == held
    assert kv.registry.ledger.accounts["a"].used == len(held)  # held until the copy is done
    kv.finish_swap_out(seq)
    assert seq.residency is Residency.SWAPPED and kv.registry.ledger.accounts["a"].used == 0
    other = kv.add_sequence(2, "b", list(range(100, 130)))
    prefill(kv, other)  # reuses the freed pages
    copies = kv.swap_in(seq)
    assert {(c.group, c.block) for c in copies} == set(held)
    assert seq.residency is Residency.RESIDENT and seq.num_computed == 14
    for c in copies:
        assert seq.tables[c.group][c.block] == c.page
    kv.append_tokens(seq, [1, 2, 3])
    compute(kv, seq, 3)
    kv.check_invariants()


def test_swap_in_waits_for_pages(layout: PageLayout) -> None:
    kv = make_kv(layout, pages=10)
    seq = kv.add_sequence(1, "a", list(range(8)))
    prefill(kv, seq)
    kv.begin_swap_out(seq)
    kv.finish_swap_out(seq)
    hog = kv.add_sequence(2, "b", list(range(12)))
    prefill(kv, hog)
    assert not kv.swapper.can_swap_in(seq)
    with pytest.raises(KVError, match="cannot swap in"):
        kv.swap_in(seq)
    kv.check_invariants()


def test_failed_allocation_changes_nothing(layout: PageLayout) -> None:
    kv = make_kv(layout, pages=8)  # 7 pages: two blocks of three groups
    seq = kv.add_sequence(1, "a", list(range(12)))
    assert not kv.can_allocate(seq, 12)
    with pytest.raises(KVError, match="cannot allocate 9 pages"):
        kv.allocate(seq, 12)
    assert seq.residency is Residency.WAITING and kv.registry.pool.num_idle() == 7
    kv.check_invariants()


def test_cap_limits_a_tenant(layout: PageLayout) -> None:
    kv = make_kv(layout, tenants={"a": TenantBudget(reservation=0, cap=6)})
    seq = kv.add_sequence(1, "a", list(range(12)))
    assert kv.can_allocate(seq, 8) and not kv.can_allocate(seq, 9)


def test_a_stale_hit_is_refused(layout: PageLayout) -> None:
    kv = make_kv(layout)
    a = kv.add_sequence(1, "a", list(range(13)))
    prefill(kv, a)
    kv.finish(a)
    b = kv.add_sequence(2, "a", list(range(13)) + [5])
    hit = kv.lookup(b)
    kv.flush_cache()
    with pytest.raises(KVError, match="stale"):
        kv.allocate(b, 2, hit)
    assert b.residency is Residency.WAITING
    kv.check_invariants()


def test_bad_calls_are_refused(layout: PageLayout) -> None:
    kv = make_kv(layout)
    with pytest.raises(BudgetError, match="unknown tenant"):
        kv.add_sequence(1, "nobody", [1])
    with pytest.raises(KVError, match="at least one token"):
        kv.add_sequence(1, "a", [])
    seq = kv.add_sequence(1, "a", [1, 2, 3])
    with pytest.raises(KVError, match="already exists"):
        kv.add_sequence(1, "a", [1])
    with pytest.raises(KVError, match="cannot compute"):
        kv.allocate(seq, 4)
    with pytest.raises(KVError, match="not resident"):
        kv.commit(seq, 1)
    compute(kv, seq, 2)
    with pytest.raises(KVError, match="cannot commit"):
        kv.commit(seq, 1)  # no slot was allocated for the third token
    with pytest.raises(KVError, match="not waiting"):
        kv.lookup(seq)
    with pytest.raises(KVError, match="not swapped"):
        kv.swap_in(seq)
    with pytest.raises(KVError, match="still has sequences"):
        kv.remove_tenant("a")
    kv.check_invariants()


def test_a_hit_from_before_a_policy_switch_is_refused(layout: PageLayout) -> None:
    kv = make_kv(layout, policy=SharingPolicy.SHARED)
    prefill(kv, kv.add_sequence(1, "a", list(range(9))))
    b = kv.add_sequence(2, "b", list(range(9)))
    hit = kv.lookup(b)
    assert hit.num_tokens == 8  # shared: b may use a's blocks
    kv.set_policy(SharingPolicy.ISOLATED)
    with pytest.raises(KVError, match="stale"):
        kv.allocate(b, 1, hit)  # would be a cross-tenant hit under isolated
    assert kv.lookup(b).num_tokens == 0
    kv.check_invariants()


def test_a_hit_belongs_to_its_sequence(layout: PageLayout) -> None:
    kv = make_kv(layout)
    prefill(kv, kv.add_sequence(1, "a", [1] * 9))
    y = kv.add_sequence(2, "a", [1] * 9)
    z = kv.add_sequence(3, "a", [5] * 9)
    with pytest.raises(KVError, match="prefix hit of sequence 2 given for 3"):
        kv.allocate(z, 1, kv.lookup(y))


def test_a_finished_sequence_object_is_refused(layout: PageLayout) -> None:
    kv = make_kv(layout)
    old = kv.add_sequence(1, "a", [1] * 8)
    prefill(kv, old)
    kv.finish(old)
    new = kv.add_sequence(1, "a", [2] * 8)  # the id is reused
    prefill(kv, new)
    for call in (kv.finish, kv.release, kv.lookup, kv.begin_swap_out):
        with pytest.raises(KVError, match="not live"):
            call(old)
    with pytest.raises(KVError, match="not live"):
        kv.allocate(old, 1)
    assert kv.registry.sequences[1] is new
    kv.check_invariants()


def test_a_prefix_replaced_under_the_same_name_does_not_publish_old_blocks() -> None:
    kv = make_kv(build_layout(global_only_geometry(), BLOCK), pages=41)
    old = list(range(100, 116))  # four blocks
    kv.add_public_prefix("sys", old)
    seq = kv.add_sequence(1, "a", [*old, 1, 2, 3])
    hit = kv.lookup(seq)
    compute(kv, seq, 4, hit)  # block 0 registered public
    kv.remove_public_prefix("sys")
    kv.add_public_prefix("sys", [9, 9, 9, 9])  # same name, other text: one block
    compute(kv, seq, 15)  # blocks 1..3 of the old prefix must not become public
    assert kv.registry.ledger.accounts[SHARED_ACCOUNT].used == 0
    assert sum(p is not None for p in kv.registry.pool.public) <= kv.registry.ledger.public_bound
    kv.check_invariants()


def test_extend_in_place_is_the_decode_fast_path(layout: PageLayout) -> None:
    kv = make_kv(layout)
    seq = kv.add_sequence(1, "a", list(range(6)))
    assert not kv.extend_in_place(seq, 1)  # waiting: the full path is needed
    compute(kv, seq, 5)
    assert kv.extend_in_place(seq, 1)  # position 5 lies in block 1, already held
    kv.commit(seq, 1)
    kv.append_tokens(seq, [1, 2, 3])
    assert kv.extend_in_place(seq, 2) and not kv.extend_in_place(seq, 3)  # 9 needs block 2
    assert not kv.extend_in_place(seq, 0)
    kv.check_invariants()


def decoding(kv: KVManager, seq_id: int, prompt: int, tenant: str = "a"):  # type: ignore[no-untyped-def]
    """A sequence whose prompt is computed and one sampled token appended."""
    seq = kv.add_sequence(seq_id, tenant, list(range(1, prompt + 1)))
    compute(kv, seq, prompt)
    kv.append_tokens(seq, [7])
    return seq


def test_extend_decodes_takes_slots_in_held_blocks_and_grows_only_all_or_none(
    layout: PageLayout,
) -> None:
    kv = make_kv(layout, pages=60)
    inside = decoding(kv, 1, 5)  # next position 5: block 1, held
    boundary = [decoding(kv, 2, 4), decoding(kv, 3, 8)]  # next position starts a block
    assert kv.extend_decodes([inside, *boundary]) == []  # pages for both: all grow
    assert [s.num_blocks for s in boundary] == [2, 3]
    assert [s.num_allocated for s in (inside, *boundary)] == [6, 5, 9]
    for seq in (inside, *boundary):
        kv.commit(seq, 1)
    kv.check_invariants()

    kv = make_kv(layout, pages=60)
    waiting = kv.add_sequence(9, "a", [1, 2, 3])  # not resident: never a decode here
    boundary = [decoding(kv, 2, 4), decoding(kv, 3, 8)]
    assert kv.extend_decodes([*boundary, waiting]) == [0, 1, 2]  # someone else: no growth
    assert [s.num_blocks for s in boundary] == [1, 2]

    tight = make_kv(layout, pages=1 + 3 * layout.num_groups)  # the null page and 3 blocks
    boundary = [decoding(tight, 2, 4), decoding(tight, 3, 4)]
    assert tight.registry.pool.num_idle() < 2 * layout.num_groups
    assert tight.extend_decodes(boundary) == [0, 1]  # not enough for both: neither grows
    assert [s.num_blocks for s in boundary] == [1, 1]
    tight.check_invariants()


def test_commit_batch_is_all_or_nothing_and_refuses_strangers(layout: PageLayout) -> None:
    kv = make_kv(layout)
    a, b = decoding(kv, 1, 5), decoding(kv, 2, 5)
    assert kv.extend_decodes([a, b]) == []
    with pytest.raises(KVError, match="cannot commit 2 tokens"):
        kv.commit_batch([a, b], [1, 2])
    assert (a.num_computed, b.num_computed) == (5, 5)  # nothing moved
    with pytest.raises(KVError, match="twice"):
        kv.commit_batch([a, a], [1, 1])
    with pytest.raises(KVError, match="twice"):  # the decode step's own path
        twice = kv.slots_of([b, a, b])
        kv.commit_decodes([b, a, b], twice, kv.step_columns(twice))
    assert (a.num_computed, b.num_computed) == (5, 5)
    other = make_kv(layout)
    stranger = decoding(other, 1, 5)
    with pytest.raises(KVError, match="not live"):
        kv.commit_batch([stranger], [1])
    kv.commit_batch([a, b], [1, 1])
    kv.append_decoded([a, b], [8, 9])
    assert a.tokens[-2:] == [7, 8] and b.tokens[-1] == 9
    kv.check_invariants()


def test_decode_blocks_enter_the_cache_when_the_sequence_lets_go(layout: PageLayout) -> None:
    """Prefill blocks are cached as they are computed; blocks that decode steps
    fill are offered when the sequence releases its pages (as SGLang does)."""
    kv = make_kv(layout, pages=60)
    seq = decoding(kv, 1, 4)  # the prompt fills block 0: cached at once
    for token in range(8):  # decode 8 tokens: blocks 1 and 2 fill
        assert kv.extend_decodes([seq]) == []
        kv.commit_decodes([seq], kv.slots_of([seq]), kv.step_columns(kv.slots_of([seq])))
        kv.append_decoded([seq], [20 + token])
    follow_up = kv.add_sequence(2, "a", seq.tokens[:12] + [99])
    assert kv.lookup(follow_up).num_tokens == 4  # only the prompt's block, so far
    kv.finish(seq)
    assert kv.lookup(follow_up).num_tokens == 12  # the decoded blocks, once released
    kv.check_invariants()


def test_columns_follow_the_sequences(layout: PageLayout) -> None:
    kv = make_kv(layout, pages=1000)
    seqs = [decoding(kv, i, 5) for i in range(70)]  # more than the initial 64 slots
    assert len({s.slot for s in seqs}) == 70
    kv.check_invariants()
    done = seqs[3]
    slot = done.slot
    kv.finish(done)
    again = kv.add_sequence(100, "a", [1, 2])
    assert again.slot == slot and again.num_computed == 0  # the slot, fresh
    compute(kv, again, 2)
    assert done.num_computed == 0 and done.residency is Residency.RELEASED  # its own copy
    kv.check_invariants()
