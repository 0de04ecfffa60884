"""The KV state of one request: its tokens and where their K/V live."""

from __future__ import annotations

import enum

from kvd.kv.scope import Scope


class KVState(enum.Enum):
    WAITING = "waiting"  # no pages: never started, finished prefill-less, or preempted by release
    RESIDENT = "resident"  # holds pages on the device
    SWAPPING_OUT = "swapping-out"  # pages still held while the caller copies them to host
    SWAPPED = "swapped"  # KV lives in host memory; no pages held
    RELEASED = "released"  # removed from the manager


class Sequence:
    """Per-request KV bookkeeping, owned and mutated by the KV manager only.

    ``tables[g][b]`` is the page holding block ``b`` of page group ``g``, or the
    null page where a sliding group released it. All tables have ``num_blocks``
    entries: groups allocate in lock-step. ``hashes[b]`` is the chained hash of
    full block ``b``, filled as blocks fill.
    """

    # What a decode step reads first: every step touches every running sequence.
    __slots__ = (
        "seq_id",
        "state",
        "num_computed",
        "num_allocated",
        "num_blocks",
        "tokens",
        "table_version",
        "sliding_start",
        "tenant",
        "tier",
        "arrival",
        "cache_salt",
        "tables",
        "hashes",
        "scope",
        "swapped_blocks",
        "cached_tokens",
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
    ) -> None:
        self.seq_id = seq_id
        self.tenant = tenant
        self.tier = tier  # 0 is the most important tier; larger is evicted first
        self.arrival = arrival  # admission order; larger is newer, evicted first
        self.cache_salt = cache_salt
        self.tokens = tokens
        self.num_computed = 0  # tokens whose K/V are written
        self.num_allocated = 0  # tokens with a slot: computed + allocated for the next step
        self.tables: list[list[int]] = [[] for _ in range(num_groups)]
        self.table_version = 0  # bumped on every change of ``tables`` (for device-side caches)
        self.num_blocks = 0
        self.sliding_start = 0  # sliding groups hold no page below this block
        self.hashes: list[bytes] = []
        self.scope: Scope | None = None
        self.state = KVState.WAITING
        self.swapped_blocks: list[list[int]] | None = None  # per group, blocks copied out
        self.cached_tokens = 0  # tokens served from the prefix cache at the last start

    def __repr__(self) -> str:
        return (
            f"Sequence({self.seq_id}, tenant={self.tenant!r}, tokens={len(self.tokens)}, "
            f"computed={self.num_computed}, blocks={self.num_blocks}, {self.state.value})"
        )

    def held_pages(self) -> list[int]:
        """Every page this sequence references (each once)."""
        return [page for table in self.tables for page in table if page]
