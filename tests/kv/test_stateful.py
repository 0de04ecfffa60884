"""Random operation sequences against the KV core, with every invariant checked
after every step.

Checked throughout:
- each page is free, cached-idle or referenced, never two at once; refcounts
  equal the block-table references; per-account charges sum to used pages
  (``KVManager.check_invariants``);
- every prefix hit returns pages produced under the requester's own scope for
  the same tokens, and a scope names another tenant only for registered public
  prefixes or under the ``shared`` policy;
- a demand within a tenant's reservation has an eviction plan unless whole
  sequences stand in the way (no other tenant's sequence fits inside that
  tenant's surplus and frees the shortage alone), and the plan, carried out,
  frees what it promised (reservations are honoured).
"""

from __future__ import annotations

from typing import ClassVar

import msgspec
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvd.kv import (
    BudgetError,
    BudgetMode,
    KVError,
    KVManager,
    PrefixHit,
    Residency,
    SharingPolicy,
    TenantBudget,
    build_layout,
    plan_eviction,
)
from kvd.kv.eviction import _Simulation
from kvd.kv.records import Demand
from kvd.kv.scope import PUBLIC_SCOPE
from kvd.kv.sequence import Sequence
from tests.kv.conftest import BLOCK, Subscriber, tiny_geometry

TENANTS = ("a", "b", "c")
SALTS = (None, "s1")
# Candidate public prefixes: one block, two blocks, and a non-aligned one.
PREFIXES = {"p1": [1, 2, 3, 0], "p2": [1, 2, 3, 0, 3, 3, 2, 1], "p3": [2, 2, 2, 2, 2, 1]}
POOL_PAGES = 28

tokens_st = st.lists(st.integers(0, 3), min_size=1, max_size=22)


class KVMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = KVManager(build_layout(tiny_geometry(), BLOCK), POOL_PAGES)
        self.kv.set_tenant("a", TenantBudget(reservation=9))
        self.kv.set_tenant("b", TenantBudget(reservation=6, cap=20))
        self.kv.set_tenant("c", TenantBudget())
        # Every change is told as a KV event; ``whole`` replays them as a gateway would.
        self.events = self.kv.enable_events()
        self.subscriber = Subscriber()
        self.next_id = 0
        # (group, hash) -> (scope bytes, tokens up to the block's end) of its producer
        self.produced: dict[tuple[int, bytes], tuple[bytes, tuple[int, ...]]] = {}
        original = self.kv.prefix_cache.register_blocks

        def recording(seq: Sequence, start: int, stop: int) -> None:
            original(seq, start, stop)
            self._record(seq, start, stop)

        self.kv.prefix_cache.register_blocks = recording  # type: ignore[method-assign]

    # -- bookkeeping of who produced each cached block -------------------------

    def _record(self, seq: Sequence, start: int, stop: int) -> None:
        assert seq.scope is not None
        pool = self.kv.registry.pool
        for block in range(start, stop):
            key_hash = seq.hashes[block]
            produced = (seq.scope.of_block(block), tuple(seq.tokens[: (block + 1) * BLOCK]))
            for g, table in enumerate(seq.tables):
                page = table[block]
                if page and pool.key[page] == (g, key_hash):
                    earlier = self.produced.setdefault((g, key_hash), produced)
                    assert earlier == produced, "two contents share one cache key"

    def _check_hit(self, seq: Sequence, hit: PrefixHit) -> None:
        assert seq.scope is not None
        assert hit.num_tokens == hit.num_blocks * BLOCK < len(seq.tokens)
        for g, pages in enumerate(hit.pages):
            sliding = g in self.kv.registry.sliding_groups
            for block, page in enumerate(pages):
                if sliding and block < hit.sliding_start:
                    assert page == 0
                    continue
                assert page, "a hit must only claim resident KV"
                key = (g, seq.hashes[block])
                assert self.kv.registry.pool.key[page] == key
                scope, tokens = self.produced[key]
                assert scope == seq.scope.of_block(block), "cross-scope hit"
                assert tokens == tuple(seq.tokens[: (block + 1) * BLOCK])
                self._check_scope_is_allowed(seq, scope)

    def _check_scope_is_allowed(self, seq: Sequence, scope: bytes) -> None:
        policy = self.kv.policy
        if scope == PUBLIC_SCOPE:
            assert policy is not SharingPolicy.ISOLATED
            return
        decoded = msgspec.msgpack.decode(scope)
        if decoded[0] == "shared":
            assert policy is SharingPolicy.SHARED and decoded[1] == seq.cache_salt
        else:
            assert decoded == ["tenant", seq.tenant, seq.cache_salt]

    # -- picking sequences ---------------------------------------------------

    def _pick(self, data: st.DataObject, state: Residency) -> Sequence:
        ids = sorted(i for i, s in self.kv.registry.sequences.items() if s.residency is state)
        return self.kv.registry.sequences[data.draw(st.sampled_from(ids))]

    def _no_cross_tenant_holders(self) -> bool:
        return all(h is None or len(h) <= 1 for h in self.kv.registry.pool.holders)

    def _grow(self, seq: Sequence, num_tokens: int, hit: PrefixHit | None) -> None:
        kv = self.kv
        demand = kv.demand(seq, num_tokens, hit)
        if not kv.can_allocate(seq, num_tokens, hit):
            plan = plan_eviction(kv, seq, demand, hit)
            guaranteed = demand.charges <= kv.registry.ledger.shortfall(seq.tenant)
            if plan is None:
                if (
                    kv.registry.ledger.mode is not BudgetMode.FREE
                    and guaranteed
                    and self._no_cross_tenant_holders()
                ):
                    self._refused_only_for_whole_sequences(seq, demand, hit)
                return
            for victim in plan.victims:
                assert victim.seq_id != seq.seq_id
                kv.release(kv.registry.sequences[victim.seq_id])
            kv.check_invariants()
            assert kv.registry.pool.num_idle() >= demand.idle_pages
            assert kv.registry.ledger.headroom(seq.tenant) >= demand.charges
            assert (
                hit is None or hit.epoch == kv.registry.pool.evictions
            )  # releasing evicts nothing
            now = kv.demand(seq, num_tokens, hit)
            assert now.idle_pages <= kv.registry.pool.num_idle()
            if not kv.fits(seq.tenant, now):
                # Only possible when a victim shared pages of the hit: the
                # requester must now pay for reviving them.
                assert now.charges > demand.charges
                return
        kv.allocate(seq, num_tokens, hit)
        kv.commit(seq, num_tokens)

    def _refused_only_for_whole_sequences(
        self, seq: Sequence, demand: Demand, hit: PrefixHit | None
    ) -> None:
        """A demand within the reservation may wait only because victims are
        whole sequences: no other tenant's sequence fits inside its tenant's
        surplus and frees the shortage on its own."""
        kv = self.kv
        short = demand.idle_pages - kv.registry.pool.num_idle()
        sim = _Simulation(kv, seq, hit)  # preview changes nothing: one serves every candidate
        for other in kv.registry.sequences.values():
            if other.tenant == seq.tenant or other.residency is not Residency.RESIDENT:
                continue
            freed, relieved = sim.preview(other)
            assert not (relieved <= kv.registry.ledger.surplus(other.tenant) and freed >= short), (
                "a demand within the reservation was refused",
                other.seq_id,
            )

    # -- rules ---------------------------------------------------------------

    def add(self, data: st.DataObject) -> None:
        prefix = data.draw(st.sampled_from([None, *PREFIXES]), "prefix")
        tokens = (PREFIXES[prefix] if prefix else []) + data.draw(tokens_st, "tail")
        self.kv.add_sequence(
            self.next_id,
            data.draw(st.sampled_from(TENANTS), "tenant"),
            tokens,
            tier=data.draw(st.integers(0, 1), "tier"),
            cache_salt=data.draw(st.sampled_from(SALTS), "salt"),
        )
        self.next_id += 1

    def start(self, data: st.DataObject) -> None:
        seq = self._pick(data, Residency.WAITING)
        chunk = data.draw(st.integers(1, 12), "chunk")
        hit = self.kv.lookup(seq)
        self._check_hit(seq, hit)
        if data.draw(st.integers(0, 5), "reconfigure between lookup and allocate") == 0:
            # A hit looked up under one sharing configuration must not be
            # allocated under another (it could be a cross-scope hit now).
            generation = self.kv.generation
            self.set_policy(data)
            if self.kv.generation != generation:
                with pytest.raises(KVError, match="stale"):
                    self.kv.allocate(seq, 1, hit)
                hit = self.kv.lookup(seq)
                self._check_hit(seq, hit)
        self._grow(seq, min(chunk, len(seq.tokens) - hit.num_tokens), hit)

    def step(self, data: st.DataObject) -> None:
        seq = self._pick(data, Residency.RESIDENT)
        chunk = data.draw(st.integers(1, 12), "chunk")
        if seq.num_computed == len(seq.tokens):
            self.kv.append_tokens(seq, [data.draw(st.integers(0, 3), "token")])
        self._grow(seq, min(chunk, len(seq.tokens) - seq.num_computed), None)

    def finish(self, data: st.DataObject) -> None:
        if not self.kv.registry.sequences:
            return
        seq = self.kv.registry.sequences[
            data.draw(st.sampled_from(sorted(self.kv.registry.sequences)))
        ]
        self.kv.finish(seq)

    def preempt_by_release(self, data: st.DataObject) -> None:
        self.kv.release(self._pick(data, Residency.RESIDENT))

    def swap_out(self, data: st.DataObject) -> None:
        seq = self._pick(data, Residency.RESIDENT)
        pool = self.kv.registry.pool
        private = [
            page
            for page in seq.held_pages()
            if pool.public[page] is None and sum((pool.holders[page] or {}).values()) == 1
        ]
        shared = sorted(set(seq.held_pages()) - set(private))
        copies = self.kv.begin_swap_out(seq)
        assert sorted(c.page for c in copies) == sorted(private)
        self.kv.check_invariants()
        self.kv.finish_swap_out(seq)
        # Shared and public pages stay held (and shared) through the swap.
        assert sorted(seq.held_pages()) == shared
        self.kv.check_invariants()

    def swap_in(self, data: st.DataObject) -> None:
        seq = self._pick(data, Residency.SWAPPED)
        if not self.kv.swapper.can_swap_in(seq):
            return
        blocks = seq.swapped_blocks
        kept = list(seq.held_pages())
        copies = self.kv.swap_in(seq)
        assert set(kept) <= set(seq.held_pages())
        assert blocks is not None
        assert sorted((c.group, c.block) for c in copies) == sorted(
            (g, b) for g, bs in enumerate(blocks) for b in bs
        )

    def set_policy(self, data: st.DataObject) -> None:
        policy = data.draw(st.sampled_from(SharingPolicy), "policy")
        self.kv.set_policy(policy)

    def set_mode(self, data: st.DataObject) -> None:
        mode = data.draw(st.sampled_from(BudgetMode), "mode")
        self.kv.set_mode(mode)

    def set_reservation(self, data: st.DataObject) -> None:
        tenant = data.draw(st.sampled_from(TENANTS), "tenant")
        reservation = data.draw(st.integers(0, 20), "reservation")
        extra = data.draw(st.integers(0, 20), "extra")
        ledger = self.kv.registry.ledger
        others = sum(a.reservation for n, a in ledger.accounts.items() if n != tenant)
        fits = others + reservation + ledger.public_bound <= ledger.capacity
        cap = min(reservation + extra, ledger.capacity)
        try:
            self.kv.set_tenant(tenant, TenantBudget(reservation, cap))
        except BudgetError:
            assert not fits
        else:
            assert fits

    def add_public_prefix(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(PREFIXES)), "prefix")
        if name in self.kv.registry.public:
            return
        pages = (
            sum(len(t) // BLOCK for _, t in self.kv.registry.public.items())
            * self.kv.registry.num_groups
        )
        pages += len(PREFIXES[name]) // BLOCK * self.kv.registry.num_groups
        fits = self.kv.registry.ledger.total_reserved() + pages <= self.kv.registry.ledger.capacity
        try:
            self.kv.add_public_prefix(name, PREFIXES[name])
        except BudgetError:
            assert not fits
        else:
            assert fits

    def remove_public_prefix(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(PREFIXES)), "prefix")
        if name in self.kv.registry.public:
            self.kv.remove_public_prefix(name)

    def flush(self, data: st.DataObject) -> None:
        self.kv.flush_cache()

    # One rule drawing the operation: hypothesis favours the first entries of a
    # sampled_from, so the workload operations come first and repeat.
    OPERATIONS = (
        "step",
        "start",
        "add",
        "step",
        "start",
        "add",
        "step",
        "finish",
        "swap_out",
        "swap_in",
        "preempt_by_release",
        "set_reservation",
        "set_policy",
        "set_mode",
        "add_public_prefix",
        "remove_public_prefix",
        "flush",
    )
    NEEDS: ClassVar[dict[str, Residency]] = {
        "start": Residency.WAITING,
        "step": Residency.RESIDENT,
        "preempt_by_release": Residency.RESIDENT,
        "swap_out": Residency.RESIDENT,
        "swap_in": Residency.SWAPPED,
    }

    @rule(data=st.data())
    def act(self, data: st.DataObject) -> None:
        operation = data.draw(st.sampled_from(self.OPERATIONS), "operation")
        needed = self.NEEDS.get(operation)
        if needed is not None and not any(
            s.residency is needed for s in self.kv.registry.sequences.values()
        ):
            return
        getattr(self, operation)(data)

    @invariant()
    def whole(self) -> None:
        self.kv.check_invariants()
        self.subscriber.apply(self.events.take())
        assert self.subscriber.held("GPU") == {
            (g, self.events.published((g, h))) for g, h in self.kv.registry.pool.index
        }, "a subscriber's view of the pool is not the pool"
        ledger = self.kv.registry.ledger
        assert ledger.total_reserved() + ledger.public_bound <= ledger.capacity
        shared = ledger.accounts["@shared"].used
        public_pages = sum(1 for p in self.kv.registry.pool.public if p is not None)
        assert shared <= public_pages <= ledger.public_bound


TestKVMachine = KVMachine.TestCase
TestKVMachine.settings = settings(
    max_examples=200,
    stateful_step_count=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
