"""How a victim gives its pages back: recomputed later, or swapped to host.

Swapping copies the victim's private pages to host memory (pages it shares
stay on the device, held and shared); recomputing drops them and prefills
again later, finding in the prefix cache whatever other sequences still hold.
The cost model picks the cheaper, within a host budget: the swap space as a
whole and each tenant's share of it are bounded, and a victim that would not
fit is recomputed.
"""

from __future__ import annotations

from kvd.kv.eviction import plan_eviction
from kvd.kv.manager import KVManager, PrefixHit
from kvd.kv.records import Demand
from kvd.kv.sequence import Sequence
from kvd.sched.book import RequestBook
from kvd.sched.costmodel import Rates
from kvd.sched.executor import Executor
from kvd.sched.hostcopies import HostCopies
from kvd.sched.requests import (
    Request,
    RequestPhase,
)
from kvd.sched.settings import SchedulerConfig
from kvd.sched.stepplan import StepPlan
from kvd.sched.swapspace import SwapSpace

RECOMPUTE = "recompute"
SWAP = "swap"


def preemption_kind(
    mode: str,
    rates: Rates | None,
    kv: KVManager,
    seq: Sequence,
    swap: SwapSpace,
    tenant_limit: int | None,
) -> str:
    """``mode``: "auto" (the cost model decides), "recompute" or "swap"; a swap
    that does not fit the host budget, or of a sequence with nothing computed,
    is a recompute."""
    if seq.num_computed == 0:
        return RECOMPUTE  # nothing computed yet: nothing to swap
    pages = kv.swap_out_pages(seq)
    if not swap.fits(seq.tenant, pages, tenant_limit):
        return RECOMPUTE
    if mode != "auto" or rates is None:
        return SWAP if mode == SWAP else RECOMPUTE
    recompute = rates.recompute_s(seq.num_computed, kv.shared_prefix_tokens(seq))
    return SWAP if rates.swap_s(pages) < recompute else RECOMPUTE


class Preemption:
    """Growing a request's sequence (evicting per policy when it must), and
    preempting and swapping back in.

    Changes, through the book's methods (``preempted``, ``swap_failed``,
    ``swapped_out``, ``swapped_in``, ``requeued``): requests' phase between
    running, waiting and swapped, their host pages, the swap space, the
    preemption counts and log, and failed copies."""

    def __init__(
        self,
        book: RequestBook,
        kv: KVManager,
        executor: Executor,
        config: SchedulerConfig,
        host_copies: HostCopies,
        rates: Rates | None,
    ) -> None:
        self.book = book
        self.kv = kv
        self.executor = executor
        self.config = config
        self.host_copies = host_copies
        self.rates = rates  # the cost model's, once measured (None: by policy alone)

    def grow(self, request: Request, n: int, hit: PrefixHit | None, plan: StepPlan) -> int:
        """Pages for up to ``n`` more tokens (after ``hit``, for a waiting
        request); returns how many it got (0: none, and it waits).

        The one way a sequence grows: in place when its last block has room;
        otherwise as much of ``n`` as the idle pages and the tenant's budget
        allow; only when not one block fits, by evicting per policy. A running
        sequence that cannot grow at all yields (is preempted), as in vLLM.
        """
        seq = request.seq
        assert seq is not None
        kv = self.kv
        if hit is None and kv.extend_in_place(seq, n):
            return n
        demand = kv.try_allocate(seq, n, hit)
        if demand is None:
            return n
        fit = self.most_that_fits(seq, n, hit)
        if fit:
            kv.allocate(seq, fit, hit)
            return fit
        evict = plan_eviction(kv, seq, demand, hit)
        if evict is None:
            if request.phase is RequestPhase.RUNNING:
                self.preempt(request, plan)  # it cannot grow: it yields
            return 0
        for victim in evict.victims:
            # The plan counts every page a victim lets go of as freed: a swap
            # would keep its shared pages, so these victims are recomputed.
            self.preempt(self.book.by_seq(victim.seq_id), plan, must_free=True)
        if hit is not None and not kv.hit_is_current(hit):
            return 0  # the victims' pages evicted what the hit was made of: next step
        n = self.most_that_fits(seq, n, hit, whole=True)
        if n:
            kv.allocate(seq, n, hit)
        return n

    def most_that_fits(
        self, seq: Sequence, n: int, hit: PrefixHit | None, whole: bool = False
    ) -> int:
        """The most of ``n`` tokens (``whole``: all of them or none) that the idle
        pages and the tenant's budget allow now, without evicting anyone."""
        kv = self.kv
        if kv.can_allocate(seq, n, hit):
            return n
        if whole:
            return 0
        low, high = 0, n  # low fits (0 always does), high does not
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if kv.can_allocate(seq, mid, hit) else (low, mid)
        return low

    def preemption_kind(self, seq: Sequence) -> str:
        tenant = self.book.tenants.get(seq.tenant)
        return preemption_kind(
            self.config.preemption,
            self.rates,
            self.kv,
            seq,
            self.book.swap_space,
            tenant.swap_pages if tenant else None,
        )

    def preempt(self, request: Request, plan: StepPlan, *, must_free: bool = False) -> None:
        """Recompute or swap ``request`` (``must_free``: it is an eviction
        victim, and a swap that would keep shared pages is a recompute)."""
        seq = request.seq
        assert seq is not None
        plan.remove(request)
        kind = self.preemption_kind(seq)
        if kind == SWAP and must_free and self.kv.swap_out_pages(seq) < len(seq.held_pages()):
            kind = RECOMPUTE
        self.book.preempted(request, kind)
        if kind == SWAP:
            copies = self.kv.begin_swap_out(seq)
            self.host_copies.sync()  # blocks it reloaded this step: copied in before out
            try:
                data = self.executor.copy_out([c.page for c in copies])
            except Exception as exc:  # noqa: BLE001  # recovered from: recomputed instead
                # The host could not take the pages (out of memory, a failed
                # transfer): the device still holds them, so recomputing later
                # loses nothing. A broken device fails the next step anyway.
                self.kv.abort_swap_out(seq)
                self.book.swap_failed(request, RECOMPUTE, f"{type(exc).__name__}: {exc}")
                kind = RECOMPUTE
        if kind == SWAP:
            self.kv.finish_swap_out(seq)
            self.book.swapped_out(request, [(c.group, c.block) for c in copies], data)
            return
        self.kv.release(seq)  # recompute: tokens kept, pages dropped
        self.book.requeued(request)

    def can_resume(self, seq: Sequence) -> bool:
        """Its pages fit back, and so does the block its next token needs
        (else it would swap in only to yield again in the same step)."""
        kv = self.kv
        demand = kv.swap_in_demand(seq)
        extra = kv.layout.num_groups if seq.num_computed >= seq.num_blocks * kv.block_size else 0
        pages = demand.fresh_pages + extra
        return kv.fits(seq.tenant, Demand(pages, 0, pages))

    def swap_in(self, request: Request, plan: StepPlan) -> None:
        seq = request.seq
        assert seq is not None and request.host_pages is not None
        if len(plan.work) >= plan.max_seqs or not self.can_resume(seq):
            return
        blocks, data = request.host_pages
        rows = {key: i for i, key in enumerate(blocks)}
        copies = self.kv.swap_in(seq)
        self.host_copies.sync()  # its pages may hold evicted blocks not yet copied out
        self.executor.copy_in(
            [c.page for c in copies], data[[rows[(c.group, c.block)] for c in copies]]
        )
        self.book.swapped_in(request)
        if self.rates is not None:
            plan.add_copy(self.rates.swap_s(len(blocks)) / 2)
        n = plan.room(seq.num_computed, len(seq.tokens) - seq.num_computed)
        if n > 0:
            granted = self.grow(request, n, None, plan)
            if granted:
                plan.add(request, granted, seq.num_computed)
