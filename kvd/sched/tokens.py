"""Turning a step's sampled tokens into outcomes, as array operations over the
batch: which rows sampled a token (not a prefill chunk), which finished and why.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvd.kv.columns import COMPUTED, LENGTH

Array = np.ndarray[Any, Any]


class SlotInfo:
    """Per KV slot, what token handling needs of the request whose sequence holds
    it: a step reads these for all its sequences as arrays, not from 256
    request objects."""

    def __init__(self) -> None:
        self.last_token_at = np.full(0, np.nan)  # NaN: no token yet
        self.stop_length = np.zeros(0, np.int64)  # the sequence ends at this length
        self.tenant = np.zeros(0, np.int64)  # index into Scheduler.tenant_names

    def start(self, slot: int, capacity: int, stop_length: int, tenant: int) -> None:
        """A new sequence holds ``slot`` (of a KV manager with ``capacity`` slots)."""
        if len(self.stop_length) < capacity:
            self._grow(capacity)
        self.last_token_at[slot] = np.nan
        self.stop_length[slot] = stop_length
        self.tenant[slot] = tenant

    def _grow(self, capacity: int) -> None:
        old = len(self.stop_length)
        for name, fill in (("last_token_at", np.nan), ("stop_length", 0), ("tenant", 0)):
            column = getattr(self, name)
            grown = np.full(capacity, fill, column.dtype)
            grown[:old] = column
            setattr(self, name, grown)


class Outcome:
    """One step's sampled rows: ``keep`` indexes the step's work; the other
    arrays are per kept row."""

    __slots__ = ("keep", "slots", "length", "tokens", "logprobs", "finished", "by_stop")

    def __init__(
        self,
        keep: Array | None,
        slots: Array,
        length: Array,
        tokens: Array,
        logprobs: Array,
        finished: Array,
        by_stop: Array,
    ) -> None:
        self.keep = keep  # None: every row
        self.slots = slots
        self.length = length
        self.tokens = tokens
        self.logprobs = logprobs
        self.finished = finished
        self.by_stop = by_stop


def outcome(
    counts: list[int],
    slots: Array,
    block: Array,
    tokens: Array,
    logprobs: Array,
    stopped: Array,
    is_stop: Array,
    stop_length: Array,
) -> Outcome:
    """``block``: the step's sequences' columns before it; ``is_stop`` by token
    id; ``stop_length`` by slot (the length at which a sequence ends)."""
    length = block[LENGTH]
    sampled = block[COMPUTED] + np.asarray(counts) == length  # not a prefill chunk
    keep = None
    if not sampled.all():
        keep = np.flatnonzero(sampled)
        slots, length = slots[keep], length[keep]
        tokens, logprobs, stopped = tokens[keep], logprobs[keep], stopped[keep]
    by_stop = stopped | is_stop[tokens]
    finished = by_stop | (length >= stop_length[slots] - 1)  # with this token
    return Outcome(keep, slots, length, tokens, logprobs, finished, by_stop)
