"""Who gives up pages when a demand cannot be met from idle pages.

Evicting the largest sequence frees the most pages fastest and reliably
punishes whoever does the most legitimate work, so victims are chosen by a
written-down fairness order instead:

1. A demand *within the requester's guarantee* (reserve and static modes: the
   pages it still lacks up to its reservation) may reclaim **other tenants'
   surplus**: from the tenant with the most surplus over its reservation
   first; within a tenant, the lowest priority tier first, then the newest.
   A tenant with no surplus is never a victim for someone else: guarantees
   are not taken to serve anybody.
2. A demand *beyond the guarantee* (a burst) only uses idle pages. If they do
   not suffice, the requester may only displace its **own** less important
   sequences (a lower tier, or the same tier and newer than the requester).
3. ``free`` mode is first come, first served: a running sequence that must grow
   displaces sequences less important than itself (lowest tier, then newest),
   whoever owns them; a waiting sequence displaces nobody and waits.

Granularity: victims are whole sequences (a sliding-window model cannot
resume from a truncated sequence: the window blocks before the cut are
gone). Within the chosen tenant the first sequence in eviction order that
fits inside its surplus and alone frees what is still needed goes, else the
first that fits; a tenant whose every sequence is larger than its surplus is
not a victim at all, since reclaiming is never allowed to push a tenant under
its reservation. When no victim fits, the requester waits (until a sequence
ends): a demand within a reservation can wait only for that reason. Pages that
sequences staying behind (or the requester's own prefix hit) still hold do not
count as freed. The plan is pure: the scheduler recomputes or swaps the
victims, then allocates.
"""

from __future__ import annotations

import msgspec

from kvd.kv.ledger import SHARED_ACCOUNT, BudgetMode
from kvd.kv.manager import Demand, KVManager, PrefixHit
from kvd.kv.sequence import Residency, Sequence


class Victim(msgspec.Struct, frozen=True):
    seq_id: int
    tenant: str
    tier: int
    arrival: int
    pages_freed: int  # pages that become idle once this victim (after earlier ones) lets go


class EvictionPlan(msgspec.Struct, frozen=True):
    victims: tuple[Victim, ...]
    reason: str  # "none-needed", "reclaim-surplus", "own-sequences" or "fcfs"

    @property
    def pages_freed(self) -> int:
        return sum(v.pages_freed for v in self.victims)


def less_important(candidate: Sequence, than: Sequence) -> bool:
    """True if ``candidate`` yields to ``than``: a lower tier, or the same tier and newer."""
    return (candidate.tier, candidate.arrival) > (than.tier, than.arrival)


def plan_eviction(
    kv: KVManager, requester: Sequence, demand: Demand, hit: PrefixHit | None = None
) -> EvictionPlan | None:
    """Victims whose pages let ``demand`` be allocated for ``requester``, or None.

    ``hit`` is the prefix hit the demand was computed with: its pages count as
    the requester's, so no victim is chosen for pages the requester would only
    have to revive. None means the demand cannot be met now without breaking
    the policy: the requester waits (or, if running, the scheduler preempts
    the requester itself).
    """
    ledger = kv.registry.ledger
    tenant = requester.tenant
    over_budget = demand.charges - ledger.headroom(tenant) if demand.charges else 0
    short = demand.idle_pages - kv.registry.pool.num_idle()
    if over_budget <= 0 and short <= 0:
        return EvictionPlan((), "none-needed")
    sim = _Simulation(kv, requester, hit)
    if ledger.mode is BudgetMode.FREE:
        if requester.residency is not Residency.RESIDENT:
            return None
        candidates = [s for s in _resident(kv) if less_important(s, requester)]
        return _greedy(sim, candidates, max(short, over_budget), 0, None, "fcfs")
    guaranteed = min(demand.charges, ledger.shortfall(tenant))
    if over_budget <= 0 and short <= guaranteed:
        return _reclaim_surplus(sim, requester, short)
    own = [s for s in _resident(kv) if s.tenant == tenant and less_important(s, requester)]
    return _greedy(sim, own, max(short, 0), over_budget, tenant, "own-sequences")


def _resident(kv: KVManager) -> list[Sequence]:
    return [s for s in kv.registry.sequences.values() if s.residency is Residency.RESIDENT]


def _eviction_order(seq: Sequence) -> tuple[int, int]:
    return (-seq.tier, -seq.arrival)  # lowest tier first, then newest


class _Simulation:
    """Page holders and charges as they would be after the victims chosen so far.

    It follows the pool's own rules: a page is freed when its last holder lets
    go, and a page whose payer lets go while others still hold it is charged
    to the next holder (possible only under the ``shared`` policy).
    """

    def __init__(self, kv: KVManager, requester: Sequence, hit: PrefixHit | None) -> None:
        self.kv = kv
        self.holders: dict[int, dict[str, int]] = {}
        self.charged: dict[str, int] = {}  # change of each account's charges (negative: fewer)
        if hit is not None:
            for pages in hit.pages:
                for page in pages:
                    if page and kv.registry.pool.holders[page] is not None:
                        self._holders(page)[requester.tenant] = (
                            self._holders(page).get(requester.tenant, 0) + 1
                        )

    def _holders(self, page: int) -> dict[str, int]:
        held = self.holders.get(page)
        if held is None:
            held = dict(self.kv.registry.pool.holders[page] or {})
            self.holders[page] = held
        return held

    def surplus(self, tenant: str) -> int:
        return self.kv.registry.ledger.surplus(tenant) + self.charged.get(tenant, 0)

    def _payer(self, page: int, holders: dict[str, int]) -> str | None:
        if not holders:
            return None
        return (
            SHARED_ACCOUNT
            if self.kv.registry.pool.public[page] is not None
            else next(iter(holders))
        )

    def preview(self, seq: Sequence) -> tuple[int, int]:
        """(pages freed, pages its tenant stops paying) if ``seq`` let go now; no change."""
        freed = relieved = 0
        for page in seq.held_pages():
            held = dict(self._holders(page))
            before = self._payer(page, held)
            held[seq.tenant] -= 1
            if not held[seq.tenant]:
                del held[seq.tenant]
            freed += not held
            relieved += before == seq.tenant and self._payer(page, held) != seq.tenant
        return freed, relieved

    def release(self, seq: Sequence) -> int:
        """Let ``seq`` go; returns the pages that become idle."""
        freed = 0
        for page in seq.held_pages():
            held = self._holders(page)
            before = self._payer(page, held)
            held[seq.tenant] -= 1
            if not held[seq.tenant]:
                del held[seq.tenant]
            after = self._payer(page, held)
            freed += after is None
            if before != after:
                assert before is not None
                self.charged[before] = self.charged.get(before, 0) - 1
                if after is not None:
                    self.charged[after] = self.charged.get(after, 0) + 1
        return freed


def _victim(seq: Sequence, freed: int) -> Victim:
    return Victim(seq.seq_id, seq.tenant, seq.tier, seq.arrival, freed)


def _reclaim_surplus(sim: _Simulation, requester: Sequence, short: int) -> EvictionPlan | None:
    by_tenant: dict[str, list[Sequence]] = {}
    for seq in _resident(sim.kv):
        if seq.tenant != requester.tenant:
            by_tenant.setdefault(seq.tenant, []).append(seq)
    for seqs in by_tenant.values():
        seqs.sort(key=_eviction_order)
    victims: list[Victim] = []
    freed = 0
    while freed < short:
        surplus = {t: sim.surplus(t) for t, seqs in by_tenant.items() if seqs}
        surplus = {t: s for t, s in surplus.items() if s > 0}
        if not surplus:
            return None
        tenant = max(surplus, key=lambda t: (surplus[t], t))
        victim = _within_surplus(sim, by_tenant[tenant], surplus[tenant], short - freed)
        if victim is None:
            del by_tenant[tenant]  # taking any of its sequences would break its guarantee
            continue
        by_tenant[tenant].remove(victim)
        pages = sim.release(victim)
        freed += pages
        victims.append(_victim(victim, pages))
    return EvictionPlan(tuple(victims), "reclaim-surplus")


def _within_surplus(
    sim: _Simulation, seqs: list[Sequence], surplus: int, needed: int
) -> Sequence | None:
    """The first sequence in eviction order whose release stays within the
    surplus (so the tenant keeps its guarantee) and frees the ``needed``
    pages on its own; failing that, the first that stays within the surplus
    (a smaller one taken first could use up the surplus a sufficient one
    needed); None if every one is larger than the surplus."""
    fitting = None
    for seq in seqs:
        freed, relieved = sim.preview(seq)
        if relieved <= surplus:
            if freed >= needed:
                return seq
            fitting = fitting or seq
    return fitting


def _greedy(
    sim: _Simulation,
    candidates: list[Sequence],
    short: int,
    over_budget: int,
    tenant: str | None,
    reason: str,
) -> EvictionPlan | None:
    """Take candidates in eviction order until idle pages suffice, and until
    ``tenant`` is relieved of ``over_budget`` charges."""
    candidates.sort(key=_eviction_order)
    victims: list[Victim] = []
    freed = 0
    for seq in candidates:
        relieved = -sim.charged.get(tenant, 0) if tenant is not None else 0
        if freed >= short and relieved >= over_budget:
            break
        pages = sim.release(seq)
        freed += pages
        victims.append(_victim(seq, pages))
    relieved = -sim.charged.get(tenant, 0) if tenant is not None else 0
    if freed >= short and relieved >= over_budget:
        return EvictionPlan(tuple(victims), reason)
    return None
