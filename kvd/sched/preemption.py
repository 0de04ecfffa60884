"""How a victim gives its pages back: recomputed later, or swapped to host.

Swapping copies the victim's private pages to host memory (pages it shares
stay on the device, held and shared); recomputing drops them and prefills
again later, finding in the prefix cache whatever other sequences still hold.
The cost model picks the cheaper, within a host budget: the swap space as a
whole and each tenant's share of it are bounded, and a victim that would not
fit is recomputed.
"""

from __future__ import annotations

from kvd.kv.manager import KVManager
from kvd.kv.sequence import Sequence
from kvd.sched.costmodel import Rates

RECOMPUTE = "recompute"
SWAP = "swap"


class SwapSpace:
    """Host pages held by swapped-out sequences, per tenant."""

    def __init__(self, total: int | None = None) -> None:
        self.total = total  # None: unbounded
        self.used: dict[str, int] = {}
        self.held = 0

    def fits(self, tenant: str, pages: int, tenant_limit: int | None) -> bool:
        if self.total is not None and self.held + pages > self.total:
            return False
        return tenant_limit is None or self.used.get(tenant, 0) + pages <= tenant_limit

    def take(self, tenant: str, pages: int) -> None:
        self.used[tenant] = self.used.get(tenant, 0) + pages
        self.held += pages

    def give(self, tenant: str, pages: int) -> None:
        left = self.used.get(tenant, 0) - pages
        if left < 0 or self.held < pages:
            raise RuntimeError(f"swap space: {tenant!r} gives back more pages than it holds")
        if left:
            self.used[tenant] = left
        else:
            self.used.pop(tenant, None)
        self.held -= pages


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
