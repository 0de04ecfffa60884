"""The copies the host cache queues, done through the executor in order.

The KV manager's host cache (``kvd/kv/hostcache.py``) keeps the bookkeeping of
which cached blocks live in host memory; this part moves their data: device
pages out to host rows when the host cache takes a block, host rows back into
device pages when a prefix hit reloads one, and rows dropped when the host cache
lets a block go.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import numpy as np

from kvd.kv.hostcache import FREE, OUT
from kvd.kv.manager import KVError, KVManager
from kvd.sched.executor import Executor


class HostCopies:
    """Owns ``store``: host-cache block contents by host row, as (the rows of
    one copy, the index in them); None where that copy failed."""

    def __init__(
        self, kv: KVManager, executor: Executor, failed: Callable[[str, str], None]
    ) -> None:
        self.kv = kv
        self.executor = executor
        self.failed = failed  # told (what, cause) of each copy failed and recovered from
        self.store: dict[int, tuple[Any, int] | None] = {}

    def sync(self) -> None:
        """Do the copies the host cache queued, in the order it queued them:
        pages it took in are copied out before anything overwrites them (a
        step, a swap-in), blocks a hit brought back are copied in before a
        step reads them, rows it let go of are dropped. Consecutive copies
        of one kind go as one executor call. Called before every engine step
        and device write."""
        copies = self.kv.take_host_copies()
        store = self.store
        # Without waiting where the executor can (the engine's gather is
        # ordered before the step that reuses the pages): a row is read on
        # the host when a reload first needs it.
        copy_out = getattr(self.executor, "copy_out_later", self.executor.copy_out)
        for kind, run in itertools.groupby(copies, key=lambda copy: copy.kind):
            batch = list(run)
            if kind == FREE:
                for copy in batch:
                    store.pop(copy.row, None)
            elif kind == OUT:
                try:
                    rows = copy_out([copy.page for copy in batch])
                except Exception as exc:  # noqa: BLE001  # recovered from: the blocks go
                    lost = {copy.row for copy in batch}
                    self.kv.lose_host_copies(lost)
                    for row in lost:
                        store[row] = None
                    self.failed("offload", f"{type(exc).__name__}: {exc}")
                    continue
                for i, copy in enumerate(batch):
                    store[copy.row] = (rows, i)
            else:
                entries = [store.pop(copy.row) for copy in batch]
                if any(entry is None for entry in entries):
                    # Claimed by a hit in the step its copy out failed: the
                    # device would read pages nobody wrote.
                    raise KVError("a host-cache block a prefix hit claimed was never stored")
                data = np.stack([_row(entry) for entry in entries if entry is not None])
                self.executor.copy_in([copy.page for copy in batch], data)


def _row(entry: tuple[Any, int]) -> np.ndarray[Any, Any]:
    rows, index = entry
    return np.asarray(rows[index])
