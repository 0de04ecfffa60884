"""A seeded soak of the reserve mode under an abusive tenant.

The hypothesis machine explores every operation; this drives the one scenario
it reaches only rarely, thousands of times: a tenant floods the pool with long
sequences while two tenants with reservations send short ones. Every demand
within a reservation must get a plan, and the plan, carried out, must free
what it promised. Invariants are checked after every operation.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from kvd.kv import (
    BudgetMode,
    KVManager,
    Residency,
    SharingPolicy,
    TenantBudget,
    build_layout,
    plan_eviction,
)
from kvd.kv.sequence import Sequence
from tests.kv.conftest import BLOCK, tiny_geometry


def _grow(kv: KVManager, seq: Sequence, tokens: int, seen: Counter[str]) -> None:
    hit = kv.lookup(seq) if seq.residency is Residency.WAITING else None
    start = hit.num_tokens if hit is not None else seq.num_computed
    tokens = min(tokens, len(seq.tokens) - start)
    demand = kv.demand(seq, tokens, hit)
    if not kv.fits(seq.tenant, demand):
        plan = plan_eviction(kv, seq, demand, hit)
        if demand.charges <= kv.registry.ledger.shortfall(seq.tenant):
            assert plan is not None, "a demand within the reservation was refused"
            seen["guaranteed"] += 1
        if plan is None:
            seen["refused"] += 1
            return
        seen[plan.reason] += 1
        for victim in plan.victims:
            assert victim.tenant == seq.tenant or kv.registry.ledger.surplus(victim.tenant) > 0
            kv.release(kv.registry.sequences[victim.seq_id])
        assert kv.registry.pool.num_idle() >= demand.idle_pages
        if not kv.can_allocate(seq, tokens, hit):
            seen["changed"] += 1
            return
    kv.allocate(seq, tokens, hit)
    kv.commit(seq, tokens)


@pytest.mark.parametrize("seed", range(12))
def test_reservations_hold_under_an_abusive_tenant(seed: int) -> None:
    rng = random.Random(seed)
    kv = KVManager(build_layout(tiny_geometry(), BLOCK), 61)
    kv.set_tenant("a", TenantBudget(reservation=15))
    kv.set_tenant("b", TenantBudget(reservation=12, cap=30))
    kv.set_tenant("abuser", TenantBudget())
    kv.add_public_prefix("system", [9, 9, 9, 9, 8, 8, 8, 8])
    seen: Counter[str] = Counter()
    next_id = 0
    for _ in range(600):
        op = rng.random()
        if op < 0.25:
            tenant = rng.choice(["abuser", "abuser", "a", "b"])
            length = rng.randrange(24, 60) if tenant == "abuser" else rng.randrange(2, 12)
            prompt = [9, 9, 9, 9, 8, 8, 8, 8] if rng.random() < 0.5 else []
            prompt += [rng.randrange(4) for _ in range(length)]
            kv.add_sequence(next_id, tenant, prompt, tier=int(tenant == "abuser"))
            next_id += 1
        elif op < 0.85 and kv.registry.sequences:
            seq = kv.registry.sequences[rng.choice(sorted(kv.registry.sequences))]
            if seq.residency is Residency.SWAPPED:
                if kv.swapper.can_swap_in(seq):
                    kv.swap_in(seq)
            else:
                if seq.residency is Residency.RESIDENT and seq.num_computed == len(seq.tokens):
                    kv.append_tokens(seq, [rng.randrange(4)])
                _grow(kv, seq, rng.randrange(1, 10), seen)
        elif op < 0.93 and kv.registry.sequences:
            seq = kv.registry.sequences[rng.choice(sorted(kv.registry.sequences))]
            if seq.residency is Residency.RESIDENT and rng.random() < 0.5:
                kv.begin_swap_out(seq)
                kv.finish_swap_out(seq)
            else:
                kv.finish(seq)
        elif op < 0.97:
            kv.set_policy(rng.choice([SharingPolicy.PUBLIC, SharingPolicy.ISOLATED]))
        else:
            kv.set_mode(rng.choice([BudgetMode.RESERVE, BudgetMode.STATIC, BudgetMode.RESERVE]))
        kv.check_invariants()
    # The scenario must really have pressed on the guarantee.
    assert seen["reclaim-surplus"] > 0, seen
