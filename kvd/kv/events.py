"""KV-cache events: what the prefix cache holds, told to an inference
gateway in vLLM's event format (``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``), so a cache-aware router can send a request to the
replica that already holds its prefix.

The pool and the host cache report every block that becomes findable in
the device or the host cache and every block that stops being findable; this log turns those
reports into events, in the order they happened, for the caller (the
daemon's publisher) to take once per step. Nothing here does I/O.

Tenancy: a block's key is scoped by tenant and ``cache_salt``
(``kvd.kv.scope``), so two tenants' blocks with the same tokens are two
blocks. A router that matched on token ids alone would believe bob can hit
alice's blocks; so each stored block carries its scope as the routers spell a
cache salt: a namespace (``tenant:NAME``, ``tenant:NAME:SALT``, ``shared`` or
``shared:SALT``) tagged ``dynamo-cache-salt:`` in its ``extra_keys`` entry (and,
in the map form, a top-level ``cache_salt``), so Dynamo indexes it in that
namespace and llm-d folds it into its keys, as vLLM folds ``cache_salt``. A
block of an operator-declared public prefix, which every tenant may hit,
carries none. One event never mixes namespaces: a consumer reads an event's
namespace once, from its first block. How much a private block's event
reveals is the operator's choice (``PrivateBlocks``).

Two wire forms (``EventEncoding``): arrays in vLLM's field order (what
llm-d decodes, and Dynamo) or maps tagged by ``"type"`` (newer vLLM;
Dynamo). The batch is ``[ts, events, data_parallel_rank]`` either way.

Block hashes go out as *published* hashes: a chain of 62-bit BLAKE2b hashes
over the parent's published hash, the block's scope and its tokens, under a
fixed public key, with bit 62 set (every one at least 2**32, so it travels
as a 64-bit msgpack integer, which llm-d's decoder requires; below 2**63, so
int64 and uint64 decoders alike hold it). The same block has the same
published hash on every replica and after a restart, as Dynamo's indexer
needs: it shares one radix tree across workers, and loses track of a
worker's blocks when another worker removes the same content under other
hashes. kvd's own keyed hashes (whose secret keeps a tenant from
precomputing a collision) never leave the process; a published hash is only
a router's hint.
"""

from __future__ import annotations

import enum
import hashlib
import os
import time
from array import array
from collections.abc import Sequence
from typing import Any

import msgspec

from kvd.kv.scope import PUBLIC_SCOPE

# (page group, block hash): the prefix cache's key, on the device and in the host cache
CacheKey = tuple[int, bytes]

GPU, CPU = "GPU", "CPU"  # vLLM's medium names: the device pool, the host cache
FULL_ATTENTION, SLIDING_WINDOW = "full_attention", "sliding_window"
# How a cache salt is tagged in extra_keys (Dynamo's convention: a bare string
# there could be a LoRA name or a multimodal hash).
SALT_TAG = "dynamo-cache-salt:"


class PrivateBlocks(enum.StrEnum):
    """What a private block's event tells the gateway.

    - ``token_ids``: everything (tokens, hashes, scope): a router can index the
      block by content and route a request of the same tenant to it;
    - ``hashes``: the hashes and scope without tokens: a router learns how
      much this replica holds for whom, not what;
    - ``none``: no event at all: only public-prefix blocks are told.
    """

    TOKEN_IDS = "token_ids"
    HASHES = "hashes"
    NONE = "none"


class EventEncoding(enum.StrEnum):
    """How each event goes on the wire.

    - ``array``: ``[tag, field, ...]`` in vLLM's field order (vLLM's
      ``array_like`` form, which llm-d decodes; Dynamo too);
    - ``map``: a map tagged by ``"type"`` (vLLM's newer form; Dynamo), with a
      scoped block's namespace also as a top-level ``cache_salt``.
    """

    ARRAY = "array"
    MAP = "map"


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """vLLM's event base: each encodes as a map tagged by ``"type"``."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    # The namespace of every block of the event, None for public ones (map
    # form only: vLLM's arrays have no slot for it).
    cache_salt: str | None = None


# vLLM's field order for the array form, after the tag.
STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
)
REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, gc=False):
    """One published message: ``[ts, events, data_parallel_rank]``."""

    ts: float
    events: list[Any]  # Events, or their arrays (``on_wire``)
    data_parallel_rank: int | None = 0


def on_wire(batch: EventBatch, encoding: EventEncoding) -> EventBatch:
    """``batch`` as ``encoding`` sends it (the events, taken, never change)."""
    if encoding is EventEncoding.MAP:
        return batch
    return EventBatch(batch.ts, [as_array(e) for e in batch.events], batch.data_parallel_rank)


def as_array(event: Event) -> list[Any]:
    """vLLM's ``array_like`` form of an event: its tag, then its fields."""
    if isinstance(event, BlockStored):
        return ["BlockStored", *(getattr(event, name) for name in STORED_FIELDS)]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", *(getattr(event, name) for name in REMOVED_FIELDS)]
    return ["AllBlocksCleared"]


_PUBLISHED = hashlib.blake2b(key=b"kvd kv events v1", digest_size=8)
# A private block told without its tokens (``PrivateBlocks.HASHES``) goes out
# under its published hash keyed again with this process's secret: anyone can
# compute a published hash, so an observer could otherwise test a guess of a
# tenant's text against it. Routers match such a block to nothing anyway.
_CONCEALED = hashlib.blake2b(key=os.urandom(32), digest_size=8)


def _conceal(published: int) -> int:
    digest = _CONCEALED.copy()
    digest.update(published.to_bytes(8, "little"))
    return int.from_bytes(digest.digest(), "big") >> 2 | 1 << 62


def published_hash(parent: int | None, scope: bytes, tokens: Sequence[int]) -> int:
    """A full block's published hash, chained on its parent's: 62 bits with
    bit 62 set (at least 2**32: a 64-bit msgpack integer; below 2**63)."""
    digest = _PUBLISHED.copy()
    digest.update((parent or 0).to_bytes(8, "little"))
    digest.update(len(scope).to_bytes(4, "little"))
    digest.update(scope)
    digest.update(array("I", tokens).tobytes())
    return int.from_bytes(digest.digest(), "big") >> 2 | 1 << 62


def published_chain(
    tokens: Sequence[int],
    block_size: int,
    scopes: Sequence[bytes],
    start: int,
    parent: int | None,
) -> list[int]:
    """Published hashes of full blocks ``start`` on, one per entry of
    ``scopes`` (each block's scope), continuing from ``parent``."""
    chain = []
    for offset, scope in enumerate(scopes):
        block = start + offset
        span = tokens[block * block_size : (block + 1) * block_size]
        parent = published_hash(parent, scope, span)
        chain.append(parent)
    return chain


class GroupSpec(msgspec.Struct, frozen=True):
    """A page group as the events describe it."""

    kind: str  # FULL_ATTENTION or SLIDING_WINDOW
    sliding_window: int | None = None


class _Meta(msgspec.Struct, gc=False):
    """What a stored block's event said, kept while the device or the host cache holds it (a
    block moving to the host cache, or a resync, tells it again)."""

    published: int
    parent: int | None  # the parent's published hash
    tokens: tuple[int, ...]
    namespace: str | None  # None: a public block
    media: int = 0  # bit 1: on the device, bit 2: on the host cache

    @property
    def private(self) -> bool:
        return self.namespace is not None


_MEDIUM_BIT = {GPU: 1, CPU: 2}


def scope_namespace(scope: bytes) -> str | None:
    """A block's scope as a router's cache-salt namespace, None if public:
    ``tenant:NAME`` or ``shared``, then ``:SALT`` for a request's
    ``cache_salt`` (tenant names hold no ``:``, so the first two parts are
    unambiguous)."""
    if scope == PUBLIC_SCOPE:
        return None
    kind, *rest = msgspec.msgpack.decode(scope)
    *owner, salt = rest
    return ":".join([kind, *owner] + ([] if salt is None else [salt]))


def extra_keys_entry(namespace: str | None) -> list[str] | None:
    """A block's ``extra_keys`` entry: its namespace, tagged; None if public."""
    return None if namespace is None else [SALT_TAG + namespace]


class KVEventLog:
    """Collects the cache's changes as events until the caller takes them."""

    def __init__(
        self,
        block_size: int,
        groups: Sequence[GroupSpec],
        private_blocks: PrivateBlocks = PrivateBlocks.TOKEN_IDS,
    ) -> None:
        self.block_size = block_size
        self.groups = tuple(groups)
        self.private_blocks = PrivateBlocks(private_blocks)
        self._meta: dict[CacheKey, _Meta] = {}
        self._events: list[Event] = [AllBlocksCleared()]  # a subscriber starts from nothing
        # Per (group, medium), the pending BlockStored a continuing block may join.
        self._open: dict[tuple[int, str], BlockStored] = {}
        self.stored_blocks = 0  # ever, both media (the metrics' counters)
        self.removed_blocks = 0

    # -- the cache's reports ---------------------------------------------------------

    def stored(
        self,
        key: CacheKey,
        published: int,
        parent: int | None,
        tokens: Sequence[int],
        scope: bytes,
        parent_private: bool = False,
    ) -> None:
        """A computed block became findable on the device; ``published``: its
        published hash, ``parent``: its parent's (``published_chain``), which
        is a private block's if ``parent_private``."""
        meta = self._meta.get(key)
        if meta is None:
            namespace = scope_namespace(scope)
            if namespace is not None and self.private_blocks is PrivateBlocks.HASHES:
                published = _conceal(published)
                if parent is not None and parent_private:
                    parent = _conceal(parent)
            meta = _Meta(published, parent, tuple(tokens), namespace)
            self._meta[key] = meta
        self._add(key, meta, GPU)

    def offloaded(self, key: CacheKey) -> None:
        """The host cache kept a copy of a block the device evicted."""
        meta = self._meta.get(key)
        if meta is not None:
            self._add(key, meta, CPU)

    def reloaded(self, key: CacheKey) -> None:
        """A block of the host cache was copied back and is findable on the
        device again (and no longer on the host)."""
        meta = self._meta.get(key)
        if meta is not None:
            self._add(key, meta, GPU)
            self.removed(key, CPU)

    def removed(self, key: CacheKey, medium: str) -> None:
        """A block stopped being findable in ``medium``."""
        meta = self._meta.get(key)
        if meta is None:
            return
        bit = _MEDIUM_BIT[medium]
        if not meta.media & bit:
            return
        meta.media &= ~bit
        if not meta.media:
            del self._meta[key]
        if self._untold(meta):
            return
        self.removed_blocks += 1
        group = key[0]
        # A store after this removal must come after it: that group's open event closes.
        self._open.pop((group, medium), None)
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved) and last.medium == medium and last.group_idx == group:
            last.block_hashes.append(meta.published)
            return
        self._events.append(BlockRemoved([meta.published], medium, group))

    def _add(self, key: CacheKey, meta: _Meta, medium: str) -> None:
        bit = _MEDIUM_BIT[medium]
        if meta.media & bit:
            return
        meta.media |= bit
        if self._untold(meta):
            return
        self.stored_blocks += 1
        self._tell_stored(key, meta, medium)

    def _untold(self, meta: _Meta) -> bool:
        """A block the operator keeps from the gateway: nothing is sent of it."""
        return meta.private and self.private_blocks is PrivateBlocks.NONE

    def _tell_stored(self, key: CacheKey, meta: _Meta, medium: str) -> None:
        """A ``BlockStored`` for the block, or the block added to its group's
        open event if it continues that event's chain in the same namespace:
        one event per group, run of blocks and namespace (a consumer reads
        an event's namespace from its first block). Groups are indexed
        apart, so a block joining an event ahead of another group's is in
        order."""
        group = key[0]
        with_tokens = not meta.private or self.private_blocks is PrivateBlocks.TOKEN_IDS
        parent, told = meta.parent, meta.published
        open_event = self._open.get((group, medium))
        if (
            open_event is not None
            and open_event.block_hashes[-1] == parent
            and open_event.cache_salt == meta.namespace
            and bool(open_event.token_ids) == (with_tokens and bool(meta.tokens))
        ):
            open_event.block_hashes.append(told)
            if with_tokens:
                open_event.token_ids.extend(meta.tokens)
            assert open_event.extra_keys is not None
            open_event.extra_keys.append(extra_keys_entry(meta.namespace))
            return
        spec = self.groups[group] if group < len(self.groups) else GroupSpec(FULL_ATTENTION)
        event = BlockStored(
            block_hashes=[told],
            parent_block_hash=parent,
            token_ids=list(meta.tokens) if with_tokens else [],
            block_size=self.block_size,
            lora_id=None,
            medium=medium,
            lora_name=None,
            extra_keys=[extra_keys_entry(meta.namespace)],
            group_idx=group,
            kv_cache_spec_kind=spec.kind,
            kv_cache_spec_sliding_window=spec.sliding_window,
            cache_salt=meta.namespace,
        )
        self._events.append(event)
        self._open[(group, medium)] = event

    # -- the caller's side -----------------------------------------------------------

    def take(self) -> list[Event]:
        """The events since the last call, in order."""
        events, self._events = self._events, []
        self._open = {}  # taken events are never changed again
        return events

    def pending(self) -> bool:
        return bool(self._events)

    def resync(self) -> list[Event]:
        """Everything held now, from scratch: ``AllBlocksCleared`` then every
        block of the device or the host cache (for a subscriber that lost events). Replaces
        whatever was pending, which it includes."""
        self._events = [AllBlocksCleared()]
        self._open = {}
        for key, meta in self._meta.items():
            for medium, bit in _MEDIUM_BIT.items():
                if meta.media & bit and not self._untold(meta):
                    self._tell_stored(key, meta, medium)
        return self.take()

    def held(self, medium: str) -> set[CacheKey]:
        """Keys this log believes ``medium`` holds (checked against the pool
        and the host cache)."""
        bit = _MEDIUM_BIT[medium]
        return {key for key, meta in self._meta.items() if meta.media & bit}

    def published(self, key: CacheKey) -> int:
        """The hash ``key``'s block was published under (it is held)."""
        return self._meta[key].published


def batch(events: list[Event], rank: int = 0) -> EventBatch:
    return EventBatch(time.time(), events, rank)
