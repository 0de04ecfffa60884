"""The pure-Python KV core: geometry, paged pool, prefix cache, tenant ledger.

Nothing here imports JAX, trio or a web framework: the engine, scheduler,
daemon and kvctl all build on it, and it is tested exhaustively on its own.
"""

from kvd.kv.eviction import EvictionPlan, Victim, plan_eviction
from kvd.kv.geometry import PRESETS, AttentionKind, KVGeometry, LayerType, preset
from kvd.kv.layout import PageGroup, PageLayout, build_layout
from kvd.kv.ledger import SHARED_ACCOUNT, BudgetError, BudgetMode, Ledger, TenantBudget
from kvd.kv.manager import Demand, KVError, KVManager, PageCopy, PrefixHit
from kvd.kv.pool import NULL_PAGE, PagePool
from kvd.kv.scope import SharingPolicy
from kvd.kv.sequence import Residency, Sequence

__all__ = [
    "PRESETS",
    "NULL_PAGE",
    "SHARED_ACCOUNT",
    "AttentionKind",
    "BudgetError",
    "BudgetMode",
    "Demand",
    "EvictionPlan",
    "KVError",
    "KVGeometry",
    "KVManager",
    "Residency",
    "LayerType",
    "Ledger",
    "PageCopy",
    "PageGroup",
    "PageLayout",
    "PagePool",
    "PrefixHit",
    "Sequence",
    "SharingPolicy",
    "TenantBudget",
    "Victim",
    "build_layout",
    "plan_eviction",
    "preset",
]
