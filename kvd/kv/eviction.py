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

Granularity: victims are whole sequences, so reclaiming a tenant's surplus
can take it below its reservation; it is then itself under its guarantee and
entitled to reclaim in turn. Pages shared with sequences that stay do not
count as freed. The plan is pure: the scheduler recomputes or swaps the
victims, then allocates.
"""

from __future__ import annotations

import msgspec

from kvd.kv.ledger import BudgetMode
from kvd.kv.manager import Demand, KVManager
from kvd.kv.sequence import KVState, Sequence


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


def plan_eviction(kv: KVManager, requester: Sequence, demand: Demand) -> EvictionPlan | None:
    """Victims whose pages let ``demand`` be allocated for ``requester``, or None.

    None means the demand cannot be met now without breaking the policy: the
    requester waits (or, if running, the scheduler preempts the requester).
    """
    ledger = kv.ledger
    tenant = requester.tenant
    over_budget = demand.charges - ledger.headroom(tenant) if demand.charges else 0
    short = demand.idle_pages - kv.pool.num_idle()
    if over_budget <= 0 and short <= 0:
        return EvictionPlan((), "none-needed")
    if ledger.mode is BudgetMode.FREE:
        if requester.state is not KVState.RESIDENT:
            return None
        candidates = [s for s in _resident(kv) if less_important(s, requester)]
        return _greedy(kv, candidates, max(short, over_budget), "fcfs", charged_to=None)
    guaranteed = min(demand.charges, ledger.shortfall(tenant))
    if over_budget <= 0 and short <= guaranteed:
        return _reclaim_surplus(kv, requester, short)
    own = [s for s in _resident(kv) if s.tenant == tenant and less_important(s, requester)]
    return _greedy(kv, own, max(short, 0), "own-sequences", over_budget, tenant)


def _resident(kv: KVManager) -> list[Sequence]:
    return [s for s in kv.sequences.values() if s.state is KVState.RESIDENT]


def _eviction_order(seq: Sequence) -> tuple[int, int]:
    return (-seq.tier, -seq.arrival)  # lowest tier first, then newest


class _Simulation:
    """Reference counts as they would be after the victims chosen so far."""

    def __init__(self, kv: KVManager) -> None:
        self.kv = kv
        self.ref: dict[int, int] = {}
        self.charged: dict[str, int] = {}

    def release(self, seq: Sequence) -> tuple[int, int]:
        """Pages freed by ``seq`` letting go, and how many of them its tenant paid."""
        pool = self.kv.pool
        freed = paid = 0
        for page in seq.held_pages():
            left = self.ref.get(page, pool.ref[page]) - 1
            self.ref[page] = left
            if left == 0:
                freed += 1
                paid += pool.account_of(page) == seq.tenant
        self.charged[seq.tenant] = self.charged.get(seq.tenant, 0) + paid
        return freed, paid


def _reclaim_surplus(kv: KVManager, requester: Sequence, short: int) -> EvictionPlan | None:
    ledger = kv.ledger
    by_tenant: dict[str, list[Sequence]] = {}
    for seq in _resident(kv):
        if seq.tenant != requester.tenant:
            by_tenant.setdefault(seq.tenant, []).append(seq)
    for seqs in by_tenant.values():
        seqs.sort(key=_eviction_order, reverse=True)  # pop() yields the first victim
    sim = _Simulation(kv)
    victims: list[Victim] = []
    freed = 0
    while freed < short:
        surplus = {
            t: ledger.surplus(t) - sim.charged.get(t, 0) for t, seqs in by_tenant.items() if seqs
        }
        surplus = {t: s for t, s in surplus.items() if s > 0}
        if not surplus:
            return None
        tenant = max(surplus, key=lambda t: (surplus[t], t))
        seq = by_tenant[tenant].pop()
        pages, _ = sim.release(seq)
        freed += pages
        victims.append(Victim(seq.seq_id, seq.tenant, seq.tier, seq.arrival, pages))
    return EvictionPlan(tuple(victims), "reclaim-surplus")


def _greedy(
    kv: KVManager,
    candidates: list[Sequence],
    short: int,
    reason: str,
    over_budget: int = 0,
    charged_to: str | None = None,
) -> EvictionPlan | None:
    """Take candidates in eviction order until idle pages and budget both suffice."""
    candidates.sort(key=_eviction_order)
    sim = _Simulation(kv)
    victims: list[Victim] = []
    freed = uncharged = 0
    for seq in candidates:
        if freed >= short and uncharged >= over_budget:
            break
        pages, paid = sim.release(seq)
        freed += pages
        uncharged += paid if charged_to is not None else 0
        victims.append(Victim(seq.seq_id, seq.tenant, seq.tier, seq.arrival, pages))
    if freed >= short and uncharged >= over_budget:
        return EvictionPlan(tuple(victims), reason)
    return None
