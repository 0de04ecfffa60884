"""Fair share between backlogged tenants: the virtual token counter (VTC).

Each tenant's counter grows with the service it receives: input tokens when a
request is admitted to run (weight 1) and output tokens as they are decoded
(weight 2), divided by the tenant's weight. The scheduler serves the
backlogged tenant with the smallest counter. A tenant that comes back from
idle is lifted to the smallest counter among the active ones, so idling does
not bank credit (Sheng et al., OSDI'24). A lifted counter ties with the
smallest one; ties go to the tenant served longest ago (one that just came
back counts as never served), so it is served before one served in the last step
(breaking them by name instead let a flood whose name sorts first take every
step's room first, one step each time its victim came back).
"""

from __future__ import annotations

import itertools

INPUT_WEIGHT = 1.0
OUTPUT_WEIGHT = 2.0


class VirtualCounters:
    def __init__(self) -> None:
        self.counters: dict[str, float] = {}
        self.weights: dict[str, float] = {}
        self.service: dict[str, float] = {}  # weighted tokens served, for reports
        self.last_charged: dict[str, int] = {}  # serial of each tenant's latest charge
        self._serials = itertools.count()

    def set_weight(self, tenant: str, weight: float) -> None:
        if weight <= 0:
            raise ValueError(f"weight must be positive, got {weight}")
        self.weights[tenant] = weight
        self.counters.setdefault(tenant, 0.0)
        self.service.setdefault(tenant, 0.0)

    def activate(self, tenant: str, active: set[str]) -> None:
        """``tenant`` became backlogged while ``active`` tenants already were."""
        others = [self.counters[t] for t in active if t != tenant and t in self.counters]
        if others:
            self.counters[tenant] = max(self.counters.get(tenant, 0.0), min(others))
        self.last_charged[tenant] = -1  # not served since it came back: it wins a tie

    def charge(self, tenant: str, input_tokens: int = 0, output_tokens: int = 0) -> None:
        cost = INPUT_WEIGHT * input_tokens + OUTPUT_WEIGHT * output_tokens
        self.service[tenant] = self.service.get(tenant, 0.0) + cost
        self.counters[tenant] = self.counters.get(tenant, 0.0) + cost / self.weights.get(
            tenant, 1.0
        )
        self.last_charged[tenant] = next(self._serials)

    def key(self, tenant: str) -> tuple[float, int]:
        """The order of service: the smallest counter, then the least recently charged."""
        return self.counters.get(tenant, 0.0), self.last_charged.get(tenant, -1)

    def order(self, tenants: list[str]) -> list[str]:
        """Tenants in the order of service (name breaks what is left, for determinism)."""
        return sorted(tenants, key=lambda t: (*self.key(t), t))

    def forget(self, tenant: str) -> None:
        for table in (self.counters, self.weights, self.service):
            table.pop(tenant, None)
        self.last_charged.pop(tenant, None)
