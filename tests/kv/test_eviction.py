"""Each fairness rule of eviction planning, and that a plan, once carried out, suffices.

The layout here is global-only with one page group, so a sequence of n tokens
holds exactly ceil(n / 4) pages and the arithmetic stays visible.
"""

from __future__ import annotations

import pytest

from kvd.kv import (
    BudgetMode,
    EvictionPlan,
    KVManager,
    PageLayout,
    SharingPolicy,
    TenantBudget,
    build_layout,
    plan_eviction,
)
from kvd.kv.sequence import Sequence
from tests.kv.conftest import BLOCK, global_only_geometry, make_kv


@pytest.fixture
def flat() -> PageLayout:
    layout = build_layout(global_only_geometry(), BLOCK)
    assert layout.num_groups == 1
    return layout


def running(kv: KVManager, seq_id: int, tenant: str, pages: int, tier: int = 0) -> Sequence:
    tokens = pages * BLOCK
    seq = kv.add_sequence(seq_id, tenant, [seq_id * 1000 + i for i in range(tokens)], tier=tier)
    kv.allocate(seq, tokens)
    kv.commit(seq, tokens)
    return seq


def plan_for(kv: KVManager, seq: Sequence, tokens: int) -> EvictionPlan | None:
    return plan_eviction(kv, seq, kv.demand(seq, tokens))


def carry_out(kv: KVManager, plan: EvictionPlan) -> None:
    for victim in plan.victims:
        kv.release(kv.registry.sequences[victim.seq_id])
    kv.check_invariants()


def three_tenants(flat: PageLayout) -> KVManager:
    # 30 allocatable pages; a is guaranteed 12, b 6, c nothing.
    budgets = {"a": TenantBudget(12), "b": TenantBudget(6), "c": TenantBudget()}
    return make_kv(flat, pages=31, tenants=budgets)


def test_no_victims_when_idle_pages_suffice(flat: PageLayout) -> None:
    kv = three_tenants(flat)
    seq = kv.add_sequence(1, "a", [1, 2, 3])
    plan = plan_for(kv, seq, 3)
    assert plan is not None and plan.victims == () and plan.reason == "none-needed"


def test_guarantee_reclaims_from_the_tenant_with_most_surplus(flat: PageLayout) -> None:
    kv = three_tenants(flat)
    running(kv, 1, "b", 6)  # b at its reservation
    running(kv, 2, "b", 3)  # b: surplus 3
    running(kv, 3, "c", 6)
    running(kv, 4, "c", 15)  # c: surplus 21; the pool is full
    assert kv.registry.pool.num_idle() == 0
    req = kv.add_sequence(9, "a", list(range(24)))  # 6 pages, within a's 12
    plan = plan_for(kv, req, 24)
    assert plan is not None and plan.reason == "reclaim-surplus"
    assert [v.seq_id for v in plan.victims] == [4]  # c's newest frees enough
    carry_out(kv, plan)
    assert kv.can_allocate(req, 24)


def test_surplus_is_recomputed_after_each_victim(flat: PageLayout) -> None:
    kv = three_tenants(flat)
    running(kv, 1, "b", 14)  # b: surplus 8
    running(kv, 2, "c", 10)  # c: oldest
    running(kv, 3, "c", 6)  # c: surplus 16 -> pool full
    req = kv.add_sequence(9, "a", list(range(48)))  # 12 pages: a's whole guarantee
    plan = plan_for(kv, req, 48)
    assert plan is not None
    # c (16) loses seq 3 (6 pages) -> c 10 > b 8: c again (seq 2, 10 pages) frees 16 >= 12.
    assert [(v.seq_id, v.pages_freed) for v in plan.victims] == [(3, 6), (2, 10)]
    carry_out(kv, plan)
    assert kv.can_allocate(req, 48)


def test_surplus_alternates_between_tenants(flat: PageLayout) -> None:
    kv = three_tenants(flat)
    running(kv, 1, "b", 6)
    running(kv, 2, "b", 5)  # b: surplus 5
    running(kv, 3, "c", 4)
    running(kv, 4, "c", 15)  # c: surplus 19 -> full
    req = kv.add_sequence(9, "a", list(range(48)))  # 12 pages
    plan = plan_for(kv, req, 48)
    assert plan is not None
    # c loses 15 (-> surplus 4 < b's 5) and that already frees 15 >= 12.
    assert [v.seq_id for v in plan.victims] == [4]
    # Ask for more than c's newest frees: b (now most surplus) is next, not c again.
    kv2 = three_tenants(flat)
    running(kv2, 1, "b", 6)
    running(kv2, 2, "b", 5)
    running(kv2, 3, "c", 4)
    running(kv2, 4, "c", 10)
    running(kv2, 5, "a", 5)  # full; a below its 12 by 7
    req2 = kv2.add_sequence(9, "a", list(range(28)))  # 7 pages
    plan2 = plan_for(kv2, req2, 28)
    assert plan2 is not None
    assert [v.seq_id for v in plan2.victims] == [4]  # c surplus 14 covers it


def test_tenants_at_their_reservation_are_never_reclaimed(flat: PageLayout) -> None:
    kv = three_tenants(flat)
    running(kv, 1, "b", 6)  # b exactly at its reservation
    running(kv, 2, "c", 12)  # c: 12 surplus
    running(kv, 3, "a", 12)  # a at its reservation: full
    # Within a's guarantee nothing is left; a burst displaces nobody else.
    burst = kv.add_sequence(9, "a", list(range(4)))
    assert plan_for(kv, burst, 4) is None
    # b below its reservation reclaims from c only, never from a.
    kv.release(kv.registry.sequences[1])
    running(kv, 4, "c", 6)  # c takes the idle pages: full again
    req = kv.add_sequence(10, "b", list(range(24)))
    plan = plan_for(kv, req, 24)
    assert plan is not None and {v.tenant for v in plan.victims} == {"c"}


def test_lowest_tier_then_newest_within_a_tenant(flat: PageLayout) -> None:
    kv = three_tenants(flat)
    running(kv, 1, "c", 6, tier=1)  # batch, oldest
    running(kv, 2, "c", 6, tier=0)  # interactive
    running(kv, 3, "c", 6, tier=1)  # batch
    running(kv, 4, "c", 6, tier=0)  # interactive, newest
    running(kv, 5, "c", 6, tier=1)  # batch, newest: full
    req = kv.add_sequence(9, "a", list(range(48)))  # 12 pages
    plan = plan_for(kv, req, 48)
    assert plan is not None
    assert [v.seq_id for v in plan.victims] == [5, 3]


def test_a_burst_only_displaces_the_tenants_own_less_important_work(flat: PageLayout) -> None:
    kv = three_tenants(flat)
    running(kv, 1, "c", 10)  # c: all surplus
    old = running(kv, 2, "a", 8)
    newer = running(kv, 3, "a", 12, tier=1)  # a: 20 > 12, full
    batch = kv.add_sequence(9, "a", list(range(4)), tier=1)  # newest batch: displaces nobody
    assert plan_for(kv, batch, 4) is None
    # An interactive request outranks a's running batch work (tier before age).
    urgent = kv.add_sequence(10, "a", list(range(4)), tier=0)
    plan = plan_for(kv, urgent, 4)
    assert plan is not None and [v.seq_id for v in plan.victims] == [newer.seq_id]
    # The old interactive sequence may grow at the cost of a's newer batch work,
    # never at c's.
    kv.append_tokens(old, [1, 2, 3, 4])
    plan = plan_for(kv, old, 4)
    assert plan is not None and plan.reason == "own-sequences"
    assert [v.seq_id for v in plan.victims] == [newer.seq_id]
    carry_out(kv, plan)
    assert kv.can_allocate(old, 4)


def test_cap_excess_is_made_up_from_own_sequences(flat: PageLayout) -> None:
    kv = make_kv(flat, pages=31, tenants={"a": TenantBudget(reservation=3, cap=9)})
    first = running(kv, 1, "a", 4)
    running(kv, 2, "a", 5)  # a at its cap with 21 pages idle
    kv.append_tokens(first, [1, 2, 3, 4])
    assert not kv.can_allocate(first, 4)
    plan = plan_for(kv, first, 4)
    assert plan is not None and [v.seq_id for v in plan.victims] == [2]
    carry_out(kv, plan)
    assert kv.can_allocate(first, 4)


def test_free_mode_is_first_come_first_served(flat: PageLayout) -> None:
    budgets = {"a": TenantBudget(reservation=12), "b": TenantBudget()}
    kv = make_kv(flat, pages=21, mode=BudgetMode.FREE, tenants=budgets)
    old = running(kv, 1, "b", 10)
    running(kv, 2, "b", 10)  # full
    waiting = kv.add_sequence(9, "a", list(range(4)))
    assert plan_for(kv, waiting, 4) is None  # reservations mean nothing: a waits
    kv.append_tokens(old, [1])
    plan = plan_for(kv, old, 1)  # a running sequence must grow: the newest goes
    assert plan is not None and plan.reason == "fcfs"
    assert [v.seq_id for v in plan.victims] == [2]


def test_static_partitions_are_never_reclaimed(flat: PageLayout) -> None:
    budgets = {"a": TenantBudget(reservation=15), "b": TenantBudget(reservation=15)}
    kv = make_kv(flat, pages=31, mode=BudgetMode.STATIC, tenants=budgets)
    running(kv, 1, "b", 15)
    more = kv.add_sequence(9, "b", list(range(4)))
    assert not kv.can_allocate(more, 4)  # over its partition, though 15 pages are idle
    assert plan_for(kv, more, 4) is None
    other = kv.add_sequence(10, "a", list(range(60)))
    assert kv.can_allocate(other, 60)


def test_lowering_a_reservation_makes_surplus_reclaimable(flat: PageLayout) -> None:
    budgets = {"a": TenantBudget(reservation=15), "b": TenantBudget(reservation=15)}
    kv = make_kv(flat, pages=31, mode=BudgetMode.STATIC, tenants=budgets)
    running(kv, 1, "b", 5)
    running(kv, 3, "b", 10)
    running(kv, 2, "a", 10)
    kv.set_tenant("b", TenantBudget(reservation=5))  # live change while b holds 15
    kv.set_tenant("a", TenantBudget(reservation=25))
    req = kv.add_sequence(9, "a", list(range(60)))  # 15 pages, within 25
    plan = plan_for(kv, req, 60)
    assert plan is not None and [v.seq_id for v in plan.victims] == [3]


def test_reclaiming_never_pushes_a_tenant_under_its_reservation(flat: PageLayout) -> None:
    """b's only sequence is larger than its surplus: taking it would leave b
    under its reservation, so a waits instead (it used to take it)."""
    budgets = {"a": TenantBudget(reservation=15), "b": TenantBudget(reservation=15)}
    kv = make_kv(flat, pages=31, mode=BudgetMode.STATIC, tenants=budgets)
    running(kv, 1, "b", 15)
    running(kv, 2, "a", 10)
    kv.set_tenant("b", TenantBudget(reservation=5))
    kv.set_tenant("a", TenantBudget(reservation=25))
    req = kv.add_sequence(9, "a", list(range(60)))
    assert plan_for(kv, req, 60) is None


def test_shared_pages_do_not_count_as_freed(flat: PageLayout) -> None:
    budgets = {"a": TenantBudget(reservation=12), "c": TenantBudget()}
    kv = make_kv(flat, pages=31, policy=SharingPolicy.SHARED, tenants=budgets)
    base = [5] * 16
    first = kv.add_sequence(1, "c", base + [1])
    kv.allocate(first, 17)
    kv.commit(first, 17)  # 5 pages
    second = kv.add_sequence(2, "c", base + [2])
    hit = kv.lookup(second)
    assert hit.num_tokens == 16
    kv.allocate(second, 1, hit)
    kv.commit(second, 1)  # shares 4 pages, adds 1
    running(kv, 3, "c", 24)  # 30 used: full
    req = kv.add_sequence(9, "a", list(range(100, 148)))  # 12 pages
    plan = plan_for(kv, req, 48)
    assert plan is not None
    assert [(v.seq_id, v.pages_freed) for v in plan.victims] == [(3, 24)]
    # Without seq 3, freeing seq 2 alone frees only its own last page.
    kv.release(kv.registry.sequences[3])
    running(kv, 4, "c", 12)  # 18 used, 12 idle
    running(kv, 5, "c", 12)  # full again
    req2 = kv.add_sequence(10, "a", list(range(200, 248)))
    plan2 = plan_for(kv, req2, 48)
    assert plan2 is not None
    carry_out(kv, plan2)
    assert kv.can_allocate(req2, 48)


def test_reclaiming_prefers_a_victim_that_fits_the_surplus(flat: PageLayout) -> None:
    kv = make_kv(flat, pages=13, tenants={"a": TenantBudget(10), "c": TenantBudget(2)})
    running(kv, 1, "a", 1)  # older, 1 page
    running(kv, 2, "a", 10)  # newer, 10 pages: a holds 11, surplus 1
    running(kv, 3, "c", 1)  # full
    req = kv.add_sequence(9, "c", list(range(4)))
    plan = plan_for(kv, req, 4)
    # Newest-first would take a's 10-page sequence and a's guarantee with it.
    assert plan is not None and [v.seq_id for v in plan.victims] == [1]


def test_reclaiming_prefers_a_victim_that_frees_enough_alone(flat: PageLayout) -> None:
    """c's surplus (6) holds either its newest sequence (2 pages) or an older
    one (6 pages), not both: taking the newest first, as eviction order says,
    would use up the surplus and free too little, and a would wait."""
    budgets = {"a": TenantBudget(12), "c": TenantBudget(18)}
    kv = make_kv(flat, pages=31, tenants=budgets)
    running(kv, 1, "c", 16)
    running(kv, 2, "c", 6)  # older: 6 pages
    running(kv, 3, "c", 2)  # newest: 2 pages; c holds 24, surplus 6; 6 idle
    req = kv.add_sequence(9, "a", list(range(48)))  # 12 pages, a's reservation
    plan = plan_for(kv, req, 48)
    assert plan is not None and [v.seq_id for v in plan.victims] == [2]
    carry_out(kv, plan)
    assert kv.can_allocate(req, 48)
    assert kv.registry.ledger.accounts["c"].used >= kv.registry.ledger.accounts["c"].reservation


def test_pages_the_requesters_hit_needs_are_not_counted_as_freed(flat: PageLayout) -> None:
    kv = make_kv(flat, pages=13, tenants={"a": TenantBudget()})
    prompt = list(range(41))
    victim = kv.add_sequence(1, "a", prompt, tier=1)  # less important, holds the prefix
    kv.allocate(victim, 40)
    kv.commit(victim, 40)
    running(kv, 3, "a", 2)  # idle 0
    req = kv.add_sequence(2, "a", prompt + [7] * 11, tier=0)
    hit = kv.lookup(req)
    demand = kv.demand(req, 12, hit)
    # Evicting the victim would only turn the hit's pages into pages to revive.
    assert plan_eviction(kv, req, demand, hit) is None
    assert plan_eviction(kv, req, demand) is not None  # blind to the hit, it would try


def test_shared_charges_move_to_the_next_holder_in_the_plan(flat: PageLayout) -> None:
    budgets = {"a": TenantBudget(0), "b": TenantBudget(0), "c": TenantBudget(10)}
    kv = make_kv(flat, pages=21, policy=SharingPolicy.SHARED, tenants=budgets)
    tokens = list(range(65))
    a = kv.add_sequence(1, "a", tokens)
    kv.allocate(a, 64)
    kv.commit(a, 64)  # 16 pages charged to a
    b = kv.add_sequence(2, "b", tokens)
    kv.allocate(b, 1, kv.lookup(b))  # b shares a's 16 pages, 1 page of its own
    req = kv.add_sequence(3, "c", [5] * 17)
    plan = plan_for(kv, req, 16)  # c needs 4 pages within its reservation, 3 idle
    # Releasing a frees nothing but moves 16 charges to b, whose surplus then pays.
    assert plan is not None and [v.seq_id for v in plan.victims] == [1, 2]
    carry_out(kv, plan)
    assert kv.can_allocate(req, 16)


def test_a_page_whose_host_copy_evicts_its_own_parent_is_handed_out_whole() -> None:
    """Taking an idle cached page offers its block to a full host cache, which
    makes room by dropping its oldest block: here the page's own parent. The
    block, findable nowhere after that, leaves the device index while the
    page is being handed out: it must be handed out once (not also freed),
    and its host copy, which no lookup could reach, must go too. (Found by the
    policy fuzz: a KeyError from the LRU.)"""
    from kvd.kv.hostcache import HostCache
    from kvd.kv.ledger import Ledger
    from kvd.kv.pool import PagePool

    ledger = Ledger(3)
    ledger.set_tenant("a", TenantBudget())
    pool = PagePool(4, ledger)
    host = HostCache(1)
    host.add_account("a")
    host.on_drop = pool.lost
    pool.host = host
    parent_page, child_page = pool.take("a", 2)
    parent, child = (0, b"parent"), (0, b"child")
    assert pool.register(parent_page, parent, None)
    assert pool.register(child_page, child, None, parent=parent)
    pool.drop(parent_page, "a")
    pool.drop(child_page, "a")  # both idle and cached, the parent the older
    first = pool.take("a", 2)  # the free page, then the parent's: its block goes to the host
    assert parent_page in first and parent in host and child in pool.index
    (last,) = pool.take("a", 1)  # the child's: the host drops the parent to keep it
    assert last == child_page
    assert parent not in host and child not in host and child not in pool.index
    assert last not in pool.free and pool.ref[last] == 1 and pool.key[last] is None
    assert ledger.tenant("a").used == 3 and pool.num_idle() == 0
