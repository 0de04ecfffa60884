from __future__ import annotations

from typing import Any

import msgspec
import pytest

from kvd.kv import BudgetMode, KVManager, PageLayout, SharingPolicy, TenantBudget, build_layout
from kvd.kv.events import (
    REMOVED_FIELDS,
    SALT_TAG,
    STORED_FIELDS,
    Event,
    EventBatch,
    EventEncoding,
    on_wire,
)
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
    they arrive on the wire (each batch msgpack-encoded in ``encoding`` and
    decoded as a foreign subscriber decodes it). It checks what the routers
    that read these events require (their decoders, see docs/howto/scale-out.md):
    a batch of exactly three, an array event's fields in vLLM's order, hashes
    that travel as 64-bit integers, no null inside an ``extra_keys`` entry,
    and an event's namespace read once from its first block (Dynamo's rule),
    which a map's top-level ``cache_salt`` repeats."""

    def __init__(self, encoding: EventEncoding = EventEncoding.ARRAY) -> None:
        self.encoding = encoding
        self.blocks: dict[str, set[tuple[int, int]]] = {"GPU": set(), "CPU": set()}
        self.tokens: dict[tuple[int, int], list[int]] = {}
        # Each block's namespace as a router reads it (None: public).
        self.namespace: dict[tuple[int, int], str | None] = {}
        self.parents: dict[tuple[int, int], int | None] = {}

    def apply(self, events: list[Event]) -> None:
        wire = msgspec.msgpack.encode(on_wire(EventBatch(1.0, events, 0), self.encoding))
        decoded = msgspec.msgpack.decode(wire)
        assert isinstance(decoded, list) and len(decoded) == 3, decoded
        ts, events_decoded, rank = decoded
        assert rank == 0 and ts == 1.0
        self.apply_decoded(events_decoded)

    def apply_decoded(self, decoded: list[Any]) -> None:
        for raw in decoded:
            event = as_fields(raw)
            kind = event["type"]
            if kind == "AllBlocksCleared":
                for held in self.blocks.values():
                    held.clear()
            elif kind == "BlockStored":
                self._stored(event, isinstance(raw, dict))
            else:
                assert kind == "BlockRemoved", event
                held = self.blocks[event["medium"]]
                for block_hash in event["block_hashes"]:
                    held.remove((event["group_idx"], block_hash))  # only what it was told of

    def _stored(self, event: dict[str, Any], as_map: bool) -> None:
        group, size = event["group_idx"], event["block_size"]
        hashes, tokens, extra = event["block_hashes"], event["token_ids"], event["extra_keys"]
        assert len(extra) == len(hashes)
        assert not tokens or len(tokens) == size * len(hashes)
        assert all(2**32 <= h < 2**63 for h in hashes)
        assert all(entry is None or None not in entry for entry in extra)
        first = extra[0] or []
        tagged = [
            k.removeprefix(SALT_TAG) for k in first if isinstance(k, str) and k.startswith(SALT_TAG)
        ]
        namespace = tagged[0] if tagged else None
        # One namespace per event: every block says the event's own.
        assert all((entry or [None])[0] == (first or [None])[0] for entry in extra)
        if as_map:
            assert event.get("cache_salt") == namespace
        parent = event["parent_block_hash"]
        for i, block_hash in enumerate(hashes):
            key = (group, block_hash)
            self.blocks[event["medium"]].add(key)
            self.tokens[key] = tokens[i * size : (i + 1) * size]
            self.namespace[key] = namespace
            self.parents[key] = parent
            parent = block_hash

    def held(self, medium: str) -> set[tuple[int, int]]:
        return self.blocks[medium]


def as_fields(raw: Any) -> dict[str, Any]:
    """An event decoded from either form, as a map of vLLM's field names (an
    array's fields by position, as llm-d reads them)."""
    if isinstance(raw, dict):
        return raw
    assert isinstance(raw, list) and isinstance(raw[0], str), raw
    names = {"BlockStored": STORED_FIELDS, "BlockRemoved": REMOVED_FIELDS}.get(raw[0], ())
    assert len(raw) == 1 + len(names), raw
    return {"type": raw[0], **dict(zip(names, raw[1:], strict=True))}
