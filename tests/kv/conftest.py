from __future__ import annotations

from typing import Any

import msgspec
import pytest

from kvd.kv import BudgetMode, KVManager, PageLayout, SharingPolicy, TenantBudget, build_layout
from kvd.kv.events import Event, EventBatch
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


class Subscriber:
    """A gateway's view of one replica, built only from its KV events as
    they arrive on the wire (each batch msgpack-encoded and decoded as a
    foreign subscriber decodes it, by the events' ``type`` tags)."""

    def __init__(self) -> None:
        self.blocks: dict[str, set[tuple[int, int]]] = {"GPU": set(), "CPU": set()}
        self.tokens: dict[tuple[int, int], list[int]] = {}
        self.extra: dict[tuple[int, int], object] = {}
        self.parents: dict[tuple[int, int], int | None] = {}

    def apply(self, events: list[Event]) -> None:
        wire = msgspec.msgpack.encode(EventBatch(1.0, events, 0))
        ts, decoded, rank = msgspec.msgpack.decode(wire)
        assert rank == 0 and ts == 1.0
        self.apply_decoded(decoded)

    def apply_decoded(self, decoded: list[dict[str, Any]]) -> None:
        for event in decoded:
            kind = event["type"]
            if kind == "AllBlocksCleared":
                for held in self.blocks.values():
                    held.clear()
            elif kind == "BlockStored":
                group, size = event["group_idx"], event["block_size"]
                hashes, tokens = event["block_hashes"], event["token_ids"]
                assert len(event["extra_keys"]) == len(hashes)
                assert not tokens or len(tokens) == size * len(hashes)
                parent = event["parent_block_hash"]
                for i, block_hash in enumerate(hashes):
                    key = (group, block_hash)
                    self.blocks[event["medium"]].add(key)
                    self.tokens[key] = tokens[i * size : (i + 1) * size]
                    extra = event["extra_keys"][i]
                    self.extra[key] = tuple(extra) if extra is not None else None
                    self.parents[key] = parent
                    parent = block_hash
            else:
                assert kind == "BlockRemoved", event
                held = self.blocks[event["medium"]]
                for block_hash in event["block_hashes"]:
                    held.remove((event["group_idx"], block_hash))  # only what it was told of

    def held(self, medium: str) -> set[tuple[int, int]]:
        return self.blocks[medium]
