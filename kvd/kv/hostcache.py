"""The host cache: the prefix cache's cached blocks kept in host memory.

When the pool evicts a cached, unreferenced page to reuse it, the host cache (if
its account's quota and the host budget allow) keeps the page's content
under the same cache key, so a later request with that prefix copies it
back instead of recomputing it. The key is the block's scoped hash (group,
hash of tenant or public scope, salt and tokens), so the sharing policies
hold on the host cache exactly as on the device: a lookup can only name keys of
its own scope.

Accounting (pages of the pool's page size, on the host):
- one host budget, ``total``, shared with swapped-out sequences
  (``kvd.sched.swapspace``): swap holds live sequences' K/V and comes first, the
  host cache fills what swap leaves and gives blocks back (least recently used
  first) when swap needs them;
- each block is charged to one account: the tenant whose private page it
  was, or the shared account for a public page;
- each account may hold at most its ``quota`` pages (None: the whole host cache);
  a block past its account's quota evicts that account's own least recently
  used block, never another tenant's, and a quota lowered live drops the
  excess at once.

The host cache is pure bookkeeping: a block's bytes live with whoever copies them
(the scheduler's host store), found by the block's ``row``. Offloads and
reloads are queued here, in the order they were decided, and drained by the
caller before the engine step (``take_copies``): a page evicted in this step
is copied out before the step overwrites it, a reloaded block copied in
before the step reads it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import msgspec

from kvd.kv.events import CPU, CacheKey, KVEventLog


class HostBlock(msgspec.Struct):
    row: int  # row in the caller's host store
    account: str  # the tenant charged, or the shared account
    public: frozenset[int] | None  # the public prefixes it lies in, if public


OUT, IN, FREE = "out", "in", "free"


class HostCopy(msgspec.Struct, frozen=True, array_like=True):
    """One queued move: ``out`` copies device ``page`` to host ``row``, ``in``
    copies ``row`` into ``page``, ``free`` lets the data of ``row`` go."""

    kind: str
    page: int
    row: int


class HostCache:
    def __init__(self, total: int) -> None:
        if total < 0:
            raise ValueError("a host cache cannot hold fewer than 0 pages")
        self.total = total  # the host budget in pages, swap included
        self.swap_held = 0  # pages swapped-out sequences hold (kept by SwapSpace)
        self.blocks: OrderedDict[CacheKey, HostBlock] = OrderedDict()  # head: LRU
        self.used: dict[str, int] = {}
        self._by_account: dict[str, OrderedDict[CacheKey, None]] = {}  # each LRU first
        self.quotas: dict[str, int | None] = {}
        self._free_rows: list[int] = []
        self._next_row = 0
        self.evictions = 0  # blocks dropped: stales prefix hits that named them
        self.offloaded = 0  # blocks stored, ever
        self.reloaded = 0  # blocks copied back, ever
        # In the order they were decided: a page reloaded and then evicted
        # again in one step must be copied in before it is copied out.
        self._copies: list[HostCopy] = []
        self.events: KVEventLog | None = None  # told of the blocks dropped
        # Called with each key dropped (the pool: device blocks chained on it may go).
        self.on_drop: Callable[[CacheKey], None] | None = None

    @property
    def enabled(self) -> bool:
        return self.total > 0

    def __len__(self) -> int:
        return len(self.blocks)

    def room(self) -> int:
        """Pages of the host budget neither swap nor the host cache holds."""
        return self.total - self.swap_held - len(self.blocks)

    def __contains__(self, key: CacheKey) -> bool:
        return key in self.blocks

    # -- storing -------------------------------------------------------------

    def offer(self, key: CacheKey, page: int, account: str, public: frozenset[int] | None) -> bool:
        """The pool evicts ``page`` (cached under ``key``): keep a copy if the
        account's quota and the budget allow. Queues the copy out."""
        if not self.enabled or key in self.blocks or account not in self.quotas:
            return False  # (an account not in quotas: a tenant since removed)
        quota = self.quotas[account]
        if quota is not None and quota <= 0:
            return False
        if quota is not None and self.used.get(account, 0) >= quota:
            self._drop(self._oldest_of(account))
        elif self.room() <= 0:
            if not self.blocks:
                return False  # swap holds the whole budget
            self._drop(next(iter(self.blocks)))
        row = self._free_rows.pop() if self._free_rows else self._take_row()
        self.blocks[key] = HostBlock(row, account, public)
        self.used[account] = self.used.get(account, 0) + 1
        self._by_account.setdefault(account, OrderedDict())[key] = None
        self._copies.append(HostCopy(OUT, page, row))
        self.offloaded += 1
        return True

    def _take_row(self) -> int:
        row = self._next_row
        self._next_row += 1
        return row

    def _oldest_of(self, account: str) -> CacheKey:
        return next(iter(self._by_account[account]))

    def claim(self, key: CacheKey) -> HostBlock:
        """A prefix hit takes ``key``'s block back to the device: it leaves the
        host cache now (so nothing evicts it), its row stays until ``copy_in``'s
        copy is taken."""
        block = self.blocks.pop(key)
        self._uncharge(block, key)
        self.reloaded += 1
        return block

    def copy_in(self, block: HostBlock, page: int) -> None:
        self._copies.append(HostCopy(IN, page, block.row))

    # -- dropping ------------------------------------------------------------

    def _uncharge(self, block: HostBlock, key: CacheKey) -> None:
        left = self.used[block.account] - 1
        order = self._by_account[block.account]
        del order[key]
        if left:
            self.used[block.account] = left
        else:
            del self.used[block.account]
            del self._by_account[block.account]

    def _drop(self, key: CacheKey) -> None:
        block = self.blocks.pop(key)
        self._uncharge(block, key)
        self._free_row(block.row)
        self.evictions += 1
        if self.events is not None:
            self.events.removed(key, CPU)
        if self.on_drop is not None:
            self.on_drop(key)

    def _free_row(self, row: int) -> None:
        # Its data goes (in order: a copy out queued earlier becomes moot, one
        # queued later for the row's next block lands after the free).
        self._free_rows.append(row)
        self._copies.append(HostCopy(FREE, 0, row))

    def discard(self, key: CacheKey) -> None:
        """Drop ``key``'s block if held (the device holds that content again)."""
        if key in self.blocks:
            self._drop(key)

    def lose(self, rows: set[int]) -> int:
        """The copies out to ``rows`` failed: drop the blocks stored there
        (their content is recomputed when next needed); returns how many."""
        doomed = [key for key, block in self.blocks.items() if block.row in rows]
        for key in doomed:
            self._drop(key)
        return len(doomed)

    def make_room(self, pages: int) -> bool:
        """Free ``pages`` of the budget for swap, least recently used blocks
        first; False (nothing dropped) if even an empty host cache is too small."""
        if self.total - self.swap_held < pages:
            return False
        while self.room() < pages:
            self._drop(next(iter(self.blocks)))
        return True

    def drop_where(self, account: str | None = None, public_id: int | None = None) -> int:
        """Drop every block of ``account``, or every public block in the
        public prefix ``public_id``, or (neither) every block; returns how many."""
        if account is not None and public_id is None:
            doomed = list(self._by_account.get(account, ()))
            for key in doomed:
                self._drop(key)
            return len(doomed)
        doomed = [
            key
            for key, block in self.blocks.items()
            if (account is None or block.account == account)
            and (public_id is None or (block.public is not None and public_id in block.public))
        ]
        for key in doomed:
            self._drop(key)
        return len(doomed)

    def add_account(self, account: str) -> None:
        self.quotas.setdefault(account, None)

    def set_quota(self, account: str, pages: int | None) -> int:
        """Set an account's quota; blocks past it go at once (oldest first).
        Returns how many were dropped."""
        self.quotas[account] = pages
        if pages is None:
            return 0
        dropped = 0
        while self.used.get(account, 0) > max(pages, 0):
            self._drop(self._oldest_of(account))
            dropped += 1
        return dropped

    def remove_account(self, account: str) -> int:
        self.quotas.pop(account, None)
        return self.drop_where(account=account)

    def resize(self, total: int) -> None:
        """A new host budget; blocks past it go, least recently used first."""
        self.total = total
        while self.blocks and self.room() < 0:
            self._drop(next(iter(self.blocks)))

    # -- the caller's side ---------------------------------------------------

    def take_copies(self) -> list[HostCopy]:
        """The copies queued since the last call, in order (the caller
        performs them before the next engine step, in that order)."""
        copies, self._copies = self._copies, []
        for copy in copies:
            if copy.kind == IN:  # the row's data is copied in now: reusable after
                self._free_rows.append(copy.row)
        return copies

    def check_invariants(self) -> None:
        charges: dict[str, int] = {}
        rows = set()
        for block in self.blocks.values():
            charges[block.account] = charges.get(block.account, 0) + 1
            rows.add(block.row)
        assert charges == self.used, (charges, self.used)
        assert {a: len(o) for a, o in self._by_account.items()} == self.used
        assert len(rows) == len(self.blocks), "two blocks share a host row"
        assert not rows & set(self._free_rows), "a held row is free"
        assert self.swap_held + len(self.blocks) <= max(self.total, self.swap_held)
        for account, quota in self.quotas.items():
            if quota is not None:
                assert self.used.get(account, 0) <= max(quota, 0), account
