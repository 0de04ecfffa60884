"""The host memory swapped-out sequences hold: bounded in all, and per tenant."""

from __future__ import annotations


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
