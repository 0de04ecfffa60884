from __future__ import annotations

import pytest

from kvd.kv import BudgetMode, KVManager, PageLayout, SharingPolicy, TenantBudget, build_layout
from kvd.kv.geometry import AttentionKind, KVGeometry, LayerType

BLOCK = 4
WINDOW = 8


def tiny_geometry() -> KVGeometry:
    """1 global layer (head_dim 16) and 4 sliding ones (head_dim 8, window 8).

    A global layer costs twice a sliding one per token, so pages hold 1 global
    or 2 sliding layers: 3 page groups (1 global, 2 sliding).
    """
    g, s = AttentionKind.GLOBAL, AttentionKind.SLIDING
    return KVGeometry(
        "tiny",
        (s, s, g, s, s),
        (LayerType(g, 1, 16), LayerType(s, 1, 8, WINDOW)),
        "float32",
    )


def global_only_geometry() -> KVGeometry:
    g = AttentionKind.GLOBAL
    return KVGeometry("flat", (g, g), (LayerType(g, 1, 8),), "float32")


@pytest.fixture
def layout() -> PageLayout:
    return build_layout(tiny_geometry(), BLOCK)


def make_kv(
    layout: PageLayout,
    pages: int = 40,
    *,
    mode: BudgetMode = BudgetMode.RESERVE,
    policy: SharingPolicy = SharingPolicy.PUBLIC,
    tenants: dict[str, TenantBudget] | None = None,
) -> KVManager:
    kv = KVManager(layout, pages, mode=mode, policy=policy)
    for name, budget in (tenants or {"a": TenantBudget(), "b": TenantBudget()}).items():
        kv.set_tenant(name, budget)
    return kv
