"""The host cache on the simulated executor, whose pages hold
each position's token and which checks every page a step reads: a block
copied back from the host with the wrong content fails the step (CorruptKV)."""

from __future__ import annotations

import pytest

from kvd.kv.ledger import SHARED_ACCOUNT
from kvd.kv.scope import SharingPolicy
from kvd.sched.hostcopies import _row
from kvd.sched.scheduler import Scheduler, SchedulerConfig, TenantConfig
from tests.sched.simulated import greedy, make_executor
from tests.sched.test_scheduler import Run, expected, prompt, rates

BLOCK = 4


def scheduler(
    host_pages: int,
    *,
    policy: SharingPolicy = SharingPolicy.PUBLIC,
    pages: int = 60,
    tenants: tuple[str, ...] = ("a", "b"),
    quota: int | None = None,
) -> Scheduler:
    executor = make_executor(pages=pages)
    s = Scheduler(executor, SchedulerConfig(policy=policy, host_pages=host_pages))
    for name in tenants:
        s.set_tenant(TenantConfig(name, host_quota_pages=quota))
    return s


def serve(s: Scheduler, tenant: str, ids: list[int], name: str, tokens: int = 4) -> list[int]:
    s.submit(name, tenant, ids, greedy(tokens))
    out = Run(s).drain()[name]
    s.kv.check_invariants()
    return out


def flood(s: Scheduler, tenant: str, seed: int, count: int = 6) -> None:
    """Unrelated prompts that take every idle page, evicting the cache."""
    for i in range(count):
        serve(s, tenant, prompt(seed + i, 40), f"flood-{seed}-{i}")


def test_an_evicted_prefix_comes_back_from_the_host_with_the_same_tokens() -> None:
    shared = prompt(1, 40)
    outputs = {}
    for host in (0, 200):
        s = scheduler(host)
        first = serve(s, "a", shared + [5], "first")
        flood(s, "b", 100)
        assert not any(
            s.kv.registry.pool.lookup((0, h)) for h in s.kv.registry.sequences
        )  # nothing live
        before = s.kv.stats()
        again = serve(s, "a", shared + [7], "again")
        after = s.kv.stats()
        assert again == expected(shared + [7], 4)
        assert first == expected(shared + [5], 4)
        outputs[host] = after.prefix_hit_tokens - before.prefix_hit_tokens
        if host:
            assert after.host_offloads > 0
            assert after.host_hit_tokens - before.host_hit_tokens >= 8 * BLOCK
            assert not s.host_copies.store.keys() - {
                b.row for b in s.kv.registry.host.blocks.values()
            }
    # Without the host cache the flood left nothing; with it, the 40-token prefix hit.
    assert outputs[0] == 0 and outputs[200] == 40


@pytest.mark.parametrize("policy", [SharingPolicy.ISOLATED, SharingPolicy.PUBLIC])
def test_no_cross_tenant_hit_on_either_tier(policy: SharingPolicy) -> None:
    s = scheduler(200, policy=policy)
    secret = prompt(3, 40)
    serve(s, "a", secret + [5], "a1")
    flood(s, "a", 200)
    assert len(s.kv.registry.host) > 0
    before = s.kv.stats()
    out = serve(s, "b", secret + [5], "b1")
    after = s.kv.stats()
    assert out == expected(secret + [5], 4)
    assert after.prefix_hit_tokens == before.prefix_hit_tokens  # not a token from a's blocks
    assert after.host_hit_tokens == before.host_hit_tokens


def test_flush_removal_and_quotas_leave_no_host_block_behind() -> None:
    s = scheduler(200, tenants=("a", "b", "c"))
    serve(s, "a", prompt(4, 40) + [5], "a1")
    serve(s, "c", prompt(5, 40) + [5], "c1")
    flood(s, "b", 300)
    host = s.kv.registry.host
    assert host.used.get("a") and host.used.get("c")
    # A quota lowered live drops the excess at once, oldest first.
    s.set_tenant(TenantConfig("a", host_quota_pages=2))
    assert host.used.get("a", 0) == 2
    s.set_tenant(TenantConfig("a", host_quota_pages=0))
    assert "a" not in host.used
    # A removed tenant's blocks go with it, and its idle device pages are not kept later.
    s.remove_tenant("c")
    assert "c" not in host.used
    flood(s, "b", 400)
    assert "c" not in host.used
    s.kv.check_invariants()
    # Flush empties both tiers.
    assert len(host) > 0
    s.kv.flush_cache()
    s.sync_host_cache()
    assert len(host) == 0 and not s.kv.registry.pool.lru and not s.host_copies.store
    s.kv.check_invariants()


def test_a_quota_caps_a_tenant_and_leaves_the_others_room() -> None:
    s = scheduler(40, quota=8)
    serve(s, "a", prompt(6, 40) + [5], "a1")
    flood(s, "a", 500)
    assert s.kv.registry.host.used.get("a", 0) <= 8
    serve(s, "b", prompt(7, 40) + [5], "b1")
    flood(s, "b", 600)
    assert 0 < s.kv.registry.host.used.get("b", 0) <= 8
    assert s.kv.registry.host.used.get("a", 0) > 0  # b's blocks did not push a's out
    assert SHARED_ACCOUNT not in s.kv.registry.host.used


def test_swap_and_the_host_cache_share_one_budget() -> None:
    """Swapped-out sequences come first: a swap-out drops cached host blocks
    to fit, and the two never hold more than the budget together."""
    s = scheduler(24, pages=40)
    s.rates = rates(s.executor, swap_cheap=True)
    serve(s, "a", prompt(8, 40) + [5], "a1")
    flood(s, "a", 700, count=3)
    cached = len(s.kv.registry.host)
    assert cached > 0
    # Three long requests at once overfill the pool: someone is swapped out.
    for i in range(3):
        s.submit(f"long{i}", "b", prompt(800 + i, 44), greedy(12))
    run = Run(s)
    peak_swap = 0
    while s.has_work():
        run.step()
        peak_swap = max(peak_swap, s.swap_space.held)
        assert s.swap_space.held + len(s.kv.registry.host) <= 24
        s.kv.check_invariants()
    for i in range(3):
        assert run.outputs[f"long{i}"] == expected(prompt(800 + i, 44), 12)
    assert s.stats().preempted_swap > 0 and peak_swap > 0
    assert s.swap_space.held == 0 and s.kv.registry.host.swap_held == 0


def test_copies_run_in_the_order_they_were_decided() -> None:
    """A block copied back into a page that is evicted again before the step
    (its sequence preempted, the page taken by another) must be copied in
    before it is copied out: the fuzz found the reverse order losing it."""
    s = scheduler(50)
    cache, pool = s.kv.registry.host, s.executor.pool
    page = 5
    pool[page] = 111
    assert cache.offer((0, b"k"), page, "a", None)
    s.sync_host_cache()
    pool[page] = 0  # the page was reused since
    cache.copy_in(cache.claim((0, b"k")), page)  # a hit brings the block back into it
    assert cache.offer((0, b"k2"), page, "a", None)  # and it is evicted again at once
    s.sync_host_cache()
    assert (pool[page] == 111).all()
    (again,) = cache.blocks.values()
    assert (_row(s.host_copies.store[again.row]) == 111).all()
