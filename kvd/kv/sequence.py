"""One request's sequence in the KV manager: its tokens and where their K/V
live (its residency)."""

from __future__ import annotations

import enum
from collections.abc import Iterable

from kvd.kv.columns import (
    ALLOCATED,
    BLOCKS,
    COMPUTED,
    LAST_TOKEN,
    LENGTH,
    PENDING,
    RESIDENT,
    SLIDING_START,
    TABLE_VERSION,
    DetachedColumns,
    SequenceColumns,
)
from kvd.kv.scope import Scope


class Residency(enum.Enum):
    WAITING = "waiting"  # no pages: never started, finished prefill-less, or preempted by release
    RESIDENT = "resident"  # holds pages on the device
    SWAPPING_OUT = "swapping-out"  # pages still held while the caller copies them to host
    SWAPPED = "swapped"  # KV lives in host memory; no pages held
    RELEASED = "released"  # removed from the manager


def _column(field: int, doc: str) -> property:
    """A Sequence attribute stored in its slot of the manager's columns."""

    def get(seq: Sequence) -> int:
        columns = seq._columns
        return columns.cells[field * columns.capacity + seq.slot]

    def put(seq: Sequence, value: int) -> None:
        columns = seq._columns
        columns.cells[field * columns.capacity + seq.slot] = value

    return property(get, put, doc=doc)


class Sequence:
    """Per-request KV bookkeeping, owned and mutated by the KV manager only.

    ``tables[g][b]`` is the page holding block ``b`` of page group ``g``, or the
    null page where a sliding group released it. All tables have ``num_blocks``
    entries: groups allocate in lock-step. ``hashes[b]`` is the chained hash of
    full block ``b``, filled as blocks fill.

    The fields a step advances live in the manager's ``SequenceColumns``, in
    this sequence's ``slot`` (kvd/kv/columns.py); they read as attributes.
    """

    __slots__ = (
        "seq_id",
        "_residency",
        "_columns",
        "slot",
        "tokens",
        "tenant",
        "tier",
        "arrival",
        "cache_salt",
        "tables",
        "hashes",
        "published",
        "registered",
        "scope",
        "swapped_blocks",
        "kept",
        "cached_tokens",
        "starts",
    )

    num_computed = _column(COMPUTED, "tokens whose K/V are written")
    num_allocated = _column(ALLOCATED, "tokens with a slot: computed + allocated for the next step")
    num_blocks = _column(BLOCKS, "entries in each of ``tables``")
    sliding_start = _column(SLIDING_START, "sliding groups hold no page below this block")
    table_version = _column(
        TABLE_VERSION, "a fresh stamp on every change of ``tables`` (for device-side caches)"
    )
    pending = _column(
        PENDING, "tokens at the end of ``tokens`` that a step in flight sampled: placeholders"
    )

    def __init__(
        self,
        seq_id: int,
        tenant: str,
        tokens: list[int],
        tier: int,
        arrival: int,
        cache_salt: str | None,
        num_groups: int,
        columns: SequenceColumns | None = None,
    ) -> None:
        self.seq_id = seq_id
        self.tenant = tenant
        self.tier = tier  # 0 is the most important tier; larger is evicted first
        self.arrival = arrival  # admission order; larger is newer, evicted first
        self.cache_salt = cache_salt
        self._columns = columns if columns is not None else SequenceColumns(1)
        # This sequence's index in the columns: unique among its manager's live sequences.
        self.slot = self._columns.take(self)
        self.tokens = tokens
        self._columns.set(LENGTH, self.slot, len(tokens))
        self._columns.set(LAST_TOKEN, self.slot, tokens[-1] if tokens else 0)
        self.tables: list[list[int]] = [[] for _ in range(num_groups)]
        self.hashes: list[bytes] = []
        self.published: list[int] = []  # the hashes KV events publish its blocks under
        self.registered = 0  # blocks [0, registered) were offered to the prefix cache
        self.scope: Scope | None = None
        self._residency = Residency.WAITING
        self.swapped_blocks: list[list[int]] | None = None  # per group, blocks copied out
        # Per group, block -> page still held on the device while swapped out:
        # pages others share (or public ones) are not copied, and stay shared.
        self.kept: list[dict[int, int]] | None = None
        self.cached_tokens = 0  # tokens served from the prefix cache at the last start
        self.starts = 0  # times it was given pages from nothing (first start, re-admissions)

    @property
    def residency(self) -> Residency:
        return self._residency

    @residency.setter
    def residency(self, value: Residency) -> None:
        self._residency = value
        self._columns.set(RESIDENT, self.slot, value is Residency.RESIDENT)

    def extend_tokens(self, tokens: Iterable[int]) -> None:
        """Known tokens grow (the manager's ``append_tokens``)."""
        self.tokens.extend(tokens)
        if self.tokens:
            self._columns.set(LENGTH, self.slot, len(self.tokens))
            self._columns.set(LAST_TOKEN, self.slot, self.tokens[-1])

    def detach(self) -> None:
        """Leave the manager's columns (the sequence is finished): keep the final
        fields in a slot of its own, and give the shared slot back."""
        shared, slot = self._columns, self.slot
        self._columns, self.slot = DetachedColumns(shared, slot, self), 0
        shared.release(slot)

    def __repr__(self) -> str:
        return (
            f"Sequence({self.seq_id}, tenant={self.tenant!r}, tokens={len(self.tokens)}, "
            f"computed={self.num_computed}, blocks={self.num_blocks}, {self.residency.value})"
        )

    @property
    def known_tokens(self) -> int:
        """Tokens whose values are known (placeholders for in-flight ones excluded)."""
        return len(self.tokens) - self.pending

    def held_pages(self) -> list[int]:
        """Every page this sequence references (each once)."""
        held = [page for table in self.tables for page in table if page]
        if self.kept:
            held += [page for group in self.kept for page in group.values()]
        return held
