"""Per-sequence counters as columns: one contiguous array per field, a slot per
live sequence.

Every engine step reads and advances a few counters of every running sequence.
Kept as attributes of hundreds of separate Python objects, that costs a cache
miss per object per step, and on a CPU host the model call has just flushed
the caches. As columns, a step reads a few contiguous arrays, and the KV
manager, the engine and the scheduler work on a whole step with numpy (as
vLLM keeps its per-request batch state in arrays). ``Sequence`` shows its
slot's values as plain attributes, so code about one sequence reads as before.

Each column is an ``array.array`` (one Python int per access: fast for one
sequence) with a numpy view over the same memory (for a whole step).
"""

from __future__ import annotations

from array import array
from typing import Any

import numpy as np

FIELDS = (
    "computed",  # tokens whose K/V are written
    "allocated",  # tokens with a slot: computed + allocated for the next step
    "blocks",  # blocks in each of the sequence's tables
    "sliding_start",  # sliding groups hold no page below this block
    "table_version",  # a fresh stamp on every change of the tables (device-side caches)
    "length",  # tokens known: the prompt and what was sampled
    "last_token",  # the last of them
    "resident",  # 1 while the sequence holds pages on the device
    "serial",  # unique per sequence (a slot's next holder gets another)
)


class Vectors:
    """Numpy views of the columns (re-fetch after a slot is taken: growth moves them)."""

    __slots__ = FIELDS

    computed: np.ndarray[Any, Any]
    allocated: np.ndarray[Any, Any]
    blocks: np.ndarray[Any, Any]
    sliding_start: np.ndarray[Any, Any]
    table_version: np.ndarray[Any, Any]
    length: np.ndarray[Any, Any]
    last_token: np.ndarray[Any, Any]
    resident: np.ndarray[Any, Any]
    serial: np.ndarray[Any, Any]


class SequenceColumns:
    computed: array[int]
    allocated: array[int]
    blocks: array[int]
    sliding_start: array[int]
    table_version: array[int]
    length: array[int]
    last_token: array[int]
    resident: array[int]
    serial: array[int]

    def __init__(self, capacity: int = 64) -> None:
        self.capacity = 0
        self.owner: list[object | None] = []  # slot -> the sequence holding it
        self._free: list[int] = []
        self.vectors = Vectors()
        self._grow(max(1, capacity))

    def take(self, owner: object) -> int:
        """A slot for a new sequence, its counters zero."""
        if not self._free:
            self._grow(self.capacity * 2)
        slot = self._free.pop()
        self.owner[slot] = owner
        for name in FIELDS:
            self.__dict__[name][slot] = 0
        return slot

    def release(self, slot: int) -> None:
        self.owner[slot] = None
        self._free.append(slot)

    def live(self) -> int:
        return self.capacity - len(self._free)

    def _grow(self, capacity: int) -> None:
        old = self.capacity
        for name in FIELDS:
            column = array("q", bytes(8 * capacity))
            previous = self.__dict__.get(name)
            if previous is not None:
                column[:old] = previous
            self.__dict__[name] = column
            setattr(self.vectors, name, np.frombuffer(column, np.int64))
        self.owner.extend([None] * (capacity - old))
        self._free.extend(range(capacity - 1, old - 1, -1))  # pop() takes low slots first
        self.capacity = capacity


class DetachedColumns(SequenceColumns):
    """A finished sequence's own single slot: its final counters stay readable
    after its slot in the manager's columns goes to another sequence."""

    def __init__(self, source: SequenceColumns, slot: int, owner: object) -> None:
        super().__init__(1)
        self.take(owner)
        for name in FIELDS:
            self.__dict__[name][0] = source.__dict__[name][slot]
