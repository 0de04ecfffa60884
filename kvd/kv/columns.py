"""Per-sequence fields as columns: one int64 matrix, a row per field and a
column (a slot) per live sequence.

Every engine step reads and advances a few fields of every running
sequence. As attributes of hundreds of Python objects, each pass over them is
a Python loop; as columns, the KV manager, the engine and the scheduler handle
a whole step with a few numpy operations, one gather fetching every counter of
the step's sequences (as vLLM keeps its per-request batch state in arrays).
``Sequence`` shows its slot's values as plain attributes, so code about one
sequence reads as before.

The matrix lives in an ``array.array`` (a Python int per access: fast for one
sequence), viewed by numpy (for a whole step).
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
    "pending",  # tokens at the end not known yet: sampled by a step still in flight
)


(
    COMPUTED,
    ALLOCATED,
    BLOCKS,
    SLIDING_START,
    TABLE_VERSION,
    LENGTH,
    LAST_TOKEN,
    RESIDENT,
    SERIAL,
    PENDING,
) = range(len(FIELDS))

# The value of a pending token until its step is read: never a token id.
PLACEHOLDER = -1


class SequenceColumns:
    """The columns of live sequences: ``matrix[field, slot]``, with ``FIELDS``
    as rows (one gather fetches every counter of a step's sequences)."""

    def __init__(self, capacity: int = 64) -> None:
        self.capacity = 0
        self.owner: list[object | None] = []  # slot -> the sequence holding it
        self._free: list[int] = []
        self.cells = array("q")  # field f of slot s at f * capacity + s
        self.matrix: np.ndarray[Any, Any] = np.zeros((len(FIELDS), 0), np.int64)
        self._grow(max(1, capacity))

    def get(self, field: int, slot: int) -> int:
        return self.cells[field * self.capacity + slot]

    def set(self, field: int, slot: int, value: int) -> None:
        self.cells[field * self.capacity + slot] = value

    def take(self, owner: object) -> int:
        """A slot for a new sequence, its fields zero."""
        if not self._free:
            self._grow(self.capacity * 2)
        slot = self._free.pop()
        self.owner[slot] = owner
        self.matrix[:, slot] = 0
        return slot

    def release(self, slot: int) -> None:
        self.owner[slot] = None
        self._free.append(slot)

    def live(self) -> int:
        return self.capacity - len(self._free)

    def _grow(self, capacity: int) -> None:
        old = self.capacity
        cells = array("q", bytes(8 * len(FIELDS) * capacity))
        matrix = np.frombuffer(cells, np.int64).reshape(len(FIELDS), capacity)
        matrix[:, :old] = self.matrix
        self.cells, self.matrix = cells, matrix
        self.owner.extend([None] * (capacity - old))
        self._free.extend(range(capacity - 1, old - 1, -1))  # pop() takes low slots first
        self.capacity = capacity


class DetachedColumns(SequenceColumns):
    """A finished sequence's own single slot: its final fields stay readable
    after its slot in the manager's columns goes to another sequence."""

    def __init__(self, source: SequenceColumns, slot: int, owner: object) -> None:
        super().__init__(1)
        self.take(owner)
        self.matrix[:, 0] = source.matrix[:, slot]


class StepColumns:
    """The fields of one step's sequences, gathered once from the columns
    (``matrix[field, row]``, a row per sequence of the step), read by name:
    what code outside the KV manager sees of its columns."""

    __slots__ = ("matrix",)

    def __init__(self, matrix: np.ndarray[Any, Any]) -> None:
        self.matrix = matrix

    def __len__(self) -> int:
        return int(self.matrix.shape[1])

    def rows(self, which: Any) -> StepColumns:
        """The same fields for some of the step's sequences (an index or mask)."""
        return StepColumns(self.matrix[:, which])

    @property
    def computed(self) -> np.ndarray[Any, Any]:
        """Tokens whose K/V are written."""
        return self.matrix[COMPUTED]

    @property
    def blocks(self) -> np.ndarray[Any, Any]:
        """Blocks in each of the sequence's tables."""
        return self.matrix[BLOCKS]

    @property
    def table_version(self) -> np.ndarray[Any, Any]:
        """A stamp that changes with the sequence's tables."""
        return self.matrix[TABLE_VERSION]

    @property
    def length(self) -> np.ndarray[Any, Any]:
        """Tokens known: the prompt and what was sampled (pending ones included)."""
        return self.matrix[LENGTH]

    @property
    def last_token(self) -> np.ndarray[Any, Any]:
        """The last known token (PLACEHOLDER while it is pending)."""
        return self.matrix[LAST_TOKEN]

    @property
    def serial(self) -> np.ndarray[Any, Any]:
        """Unique per sequence (a slot's next holder gets another)."""
        return self.matrix[SERIAL]

    @property
    def pending(self) -> np.ndarray[Any, Any]:
        """Tokens at the end sampled by a step still in flight."""
        return self.matrix[PENDING]
