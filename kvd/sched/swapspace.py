"""The host memory swapped-out sequences hold: bounded in all, and per tenant.

With a host cache (``KVManager.enable_host_cache``) the bound is the host cache's
one host budget: swap comes first, and taking pages drops cached host blocks
(least recently used first) to make room. Without one it is its own budget.
"""

from __future__ import annotations

from kvd.kv.manager import KVManager


class SwapSpace:
    """Host pages held by swapped-out sequences, per tenant."""

    def __init__(self, total: int | None = None, kv: KVManager | None = None) -> None:
        self.own_total = total  # None: unbounded (used only without a host cache)
        self.kv = kv  # whose host cache, when it has one, shares its budget
        self.used: dict[str, int] = {}
        self.held = 0

    @property
    def total(self) -> int | None:
        shared = self.kv.host_cache_pages() if self.kv is not None else 0
        return shared if shared else self.own_total

    def fits(self, tenant: str, pages: int, tenant_limit: int | None) -> bool:
        total = self.total
        if total is not None and self.held + pages > total:
            return False
        return tenant_limit is None or self.used.get(tenant, 0) + pages <= tenant_limit

    def take(self, tenant: str, pages: int) -> None:
        if self.kv is not None and self.kv.host_cache_pages():
            self.kv.make_host_room(pages)  # cached blocks give way to live sequences
        self.used[tenant] = self.used.get(tenant, 0) + pages
        self.held += pages
        self._publish()

    def give(self, tenant: str, pages: int) -> None:
        left = self.used.get(tenant, 0) - pages
        if left < 0 or self.held < pages:
            raise RuntimeError(f"swap space: {tenant!r} gives back more pages than it holds")
        if left:
            self.used[tenant] = left
        else:
            self.used.pop(tenant, None)
        self.held -= pages
        self._publish()

    def _publish(self) -> None:
        if self.kv is not None:
            self.kv.set_host_swap_held(self.held)
