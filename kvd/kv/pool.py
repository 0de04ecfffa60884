"""Pages of the one KV pool: free, cached-and-idle, or referenced.

Invariants (checked by ``check_invariants`` in tests):
- every allocatable page is in exactly one state: *free* (in ``free``, no
  cache key), *cached* (ref 0, a cache key, in ``lru``), or *referenced*
  (ref > 0, in neither list, with or without a cache key);
- ``ref[p]`` equals the sum of ``holders[p]``;
- the charge of every referenced page sits on exactly one ledger account.

Page 0 is the null page: never allocated, it fills block-table slots whose
block was released (sliding windows) or does not exist (padding), so the
device always gathers a valid page.

Idle pages are handed out free ones first, then cached ones from the LRU
head, which forgets their cache key: cached pages survive as long as possible.

The full-attention groups' index is a tree, as the routers that follow the
KV events keep it: a block is findable only while its parent is (on the
device or in the host cache). A block whose parent is not findable is not
registered, and a block that stops being findable takes its registered
descendants with it, since no lookup could reach them (lookups walk a chain
from its first block). A page holding a block another page already holds
(two requests computed it at once) is kept as that key's *spare*: when the
indexed page goes, the spare takes the key over, so the block and its
descendants stay findable while any page still holds it.
"""

from __future__ import annotations

from collections import OrderedDict

from kvd.kv.events import GPU, KVEventLog
from kvd.kv.hostcache import CacheKey, HostCache
from kvd.kv.ledger import SHARED_ACCOUNT, Ledger

NULL_PAGE = 0

__all__ = ["NULL_PAGE", "CacheKey", "PagePool", "PoolExhausted"]


class PoolExhausted(RuntimeError):
    """More idle pages were taken than exist: the caller skipped its check."""


class PagePool:
    def __init__(self, num_pages: int, ledger: Ledger) -> None:
        if num_pages < 2:
            raise ValueError("a pool needs the null page and at least one more")
        self.num_pages = num_pages
        self.ledger = ledger
        self.ref = [0] * num_pages
        self.holders: list[dict[str, int] | None] = [None] * num_pages
        self.key: list[CacheKey | None] = [None] * num_pages
        # Registration ids of the public prefixes each public page lies in; None: not public.
        self.public: list[frozenset[int] | None] = [None] * num_pages
        self.free: list[int] = list(range(num_pages - 1, 0, -1))  # pop() yields low ids first
        self.lru: OrderedDict[int, None] = OrderedDict()  # head = least recently used
        self.index: dict[CacheKey, int] = {}
        # The tree of the full-attention groups: each registered key's parent
        # key, and its registered children.
        self.parent: dict[CacheKey, CacheKey] = {}
        self.children: dict[CacheKey, set[CacheKey]] = {}
        # Referenced pages holding the content of a registered key that
        # another page is indexed under (private blocks only).
        self.spares: dict[CacheKey, set[int]] = {}
        self.spare_of: list[CacheKey | None] = [None] * num_pages
        self.evictions = 0  # cached pages whose key was dropped; stales prefix hits
        # Who a cached page's content is charged to on the host cache: the
        # account that paid for it when it was registered.
        self.owner: list[str | None] = [None] * num_pages
        self.host: HostCache | None = None  # where evicted cached pages go, if anywhere
        self.events: KVEventLog | None = None  # told what the cache holds, if anyone listens
        self._taking: int | None = None  # the page ``take`` is handing out while it offers it

    @property
    def capacity(self) -> int:
        return self.num_pages - 1

    def num_idle(self) -> int:
        return len(self.free) + len(self.lru)

    def num_referenced(self) -> int:
        return self.capacity - self.num_idle()

    def account_of(self, page: int) -> str:
        holders = self.holders[page]
        assert holders, f"page {page} is not referenced"
        return SHARED_ACCOUNT if self.public[page] is not None else next(iter(holders))

    # -- taking and dropping references -------------------------------------

    def take(self, account: str, count: int) -> list[int]:
        """Reference ``count`` idle pages for ``account`` (free ones first)."""
        if count > self.num_idle():
            raise PoolExhausted(f"asked for {count} pages, {self.num_idle()} idle")
        free, lru = self.free, self.lru
        ref, holders = self.ref, self.holders
        # The free pages there are, by one slice (as that many pops would give
        # them); then one at a time: an eviction can free pages (a dropped
        # ancestor's descendants), taken before the next cached one.
        fresh = min(count, len(free))
        pages = free[len(free) - fresh :]
        del free[len(free) - fresh :]
        pages.reverse()
        for page in pages:
            ref[page] = 1
            holders[page] = {account: 1}
        for _ in range(count - fresh):
            if free:
                page = free.pop()
            else:
                page, _ = lru.popitem(last=False)
                key = self.key[page]
                if self.host is not None and key is not None and not self.spares.get(key):
                    self._offer_to_host(page, key)
                self._forget(page)
            ref[page] = 1
            holders[page] = {account: 1}
            pages.append(page)
        self.ledger.accounts[account].used += count
        return pages

    def _offer_to_host(self, page: int, key: CacheKey) -> None:
        """The host cache may keep a copy of ``page``, which ``take`` is handing
        out. Making room there can drop the block's own ancestor, and with it
        (findable nowhere now) the block itself from the device index: the
        page is then not idle (``_drop_descendants`` must not free it), and
        its copy, which no lookup could reach, is dropped again."""
        assert self.host is not None
        owner = self.owner[page]
        assert owner is not None
        self._taking = page
        try:
            kept = self.host.offer(key, page, owner, self.public[page])
        finally:
            self._taking = None
        if kept and self.events is not None:
            self.events.offloaded(key)
        if kept and self.key[page] is None:
            self.host.discard(key)

    def touch(self, page: int, account: str) -> None:
        """Add a reference from ``account`` to a cached page (a prefix hit)."""
        holders = self.holders[page]
        if holders is None:
            del self.lru[page]
            self.holders[page] = {account: 1}
            self.ledger.accounts[self.account_of(page)].used += 1
        else:
            holders[account] = holders.get(account, 0) + 1
        self.ref[page] += 1

    def drop(self, page: int, account: str) -> None:
        """Remove one reference of ``account``; an unreferenced page becomes idle."""
        holders = self.holders[page]
        assert holders is not None and holders.get(account), (page, account)
        if len(holders) == 1 and holders[account] == 1:  # the last reference (most drops)
            self.holders[page] = None
            self.ref[page] = 0
            public = self.public[page] is not None
            self.ledger.accounts[SHARED_ACCOUNT if public else account].used -= 1
            if self.key[page] is None:
                self._release_spare(page)
                self.free.append(page)
            else:
                self.lru[page] = None
            return
        payer = self.account_of(page)
        left = holders[account] - 1
        if left:
            holders[account] = left
        else:
            del holders[account]
        self.ref[page] -= 1
        if not holders:
            self.holders[page] = None
            self.ledger.accounts[payer].used -= 1
            if self.key[page] is None:
                self._release_spare(page)
                self.free.append(page)
            else:
                self.lru[page] = None
            return
        new_payer = self.account_of(page)
        if new_payer != payer:
            self.ledger.accounts[payer].used -= 1
            self.ledger.accounts[new_payer].used += 1

    # -- the prefix cache ----------------------------------------------------

    def lookup(self, key: CacheKey) -> int | None:
        return self.index.get(key)

    def register(
        self,
        page: int,
        key: CacheKey,
        public: frozenset[int] | None,
        parent: CacheKey | None = None,
    ) -> bool:
        """Make a full, referenced page findable by ``key``.

        ``public`` names the registered public prefixes the block lies in; such
        a page is charged to the shared account. ``parent``: the key of the
        block before it in a full-attention group (None: the first block, or
        a sliding group, whose blocks need no chain). Returns False (and
        leaves the page private) when another page already holds that
        content, the page then a spare of that key if both are private, or
        when the parent is findable nowhere.
        """
        if self.key[page] is not None:
            return False
        held = self.index.get(key)
        if held is not None:
            if public is None and self.public[held] is None and self.spare_of[page] is None:
                self.spares.setdefault(key, set()).add(page)
                self.spare_of[page] = key
            return False
        if parent is not None and not self._findable(parent):
            return False
        if parent is not None:
            self.parent[key] = parent
            self.children.setdefault(parent, set()).add(key)
        self.index[key] = page
        self.key[page] = key
        self.owner[page] = SHARED_ACCOUNT if public else self.account_of(page)
        if self.host is not None:
            self.host.discard(key)  # computed again on the device: one copy is enough
        if public:
            payer = self.account_of(page)
            self.public[page] = public
            self.ledger.accounts[payer].used -= 1
            self.ledger.accounts[SHARED_ACCOUNT].used += 1
        return True

    def unpublish(self, prefix_id: int) -> int:
        """A public prefix was removed: its pages stop being public.

        A page no remaining prefix covers is taken out of the cache (so the
        shared account never holds more than the registered prefixes can
        pin): idle, it becomes free; referenced, it stays with its holders as
        a private page charged to the first of them. Returns pages affected.
        """
        affected = 0
        for page, names in enumerate(self.public):
            if names is None or prefix_id not in names:
                continue
            affected += 1
            remaining = names - {prefix_id}
            if remaining:
                self.public[page] = remaining
                continue
            if self.holders[page] is None:
                del self.lru[page]
                self._forget(page)
                self.free.append(page)
                continue
            self._make_private(page)
            self._forget(page)
        return affected

    def lost(self, key: CacheKey) -> None:
        """``key`` stopped being findable somewhere (the host cache dropped it,
        a reload could not register it): if it is findable nowhere now, its
        descendants on the device go."""
        if not self._findable(key):
            self._drop_descendants(key)

    def _findable(self, key: CacheKey) -> bool:
        return key in self.index or (self.host is not None and key in self.host)

    def _forget(self, page: int) -> None:
        """``page`` stops holding its key: a spare takes the key over, or the
        key leaves the device, with its descendants if it is findable
        nowhere now. The caller frees or keeps the page."""
        key = self.key[page]
        if key is None:
            return
        self.key[page] = None
        self.public[page] = None
        spares = self.spares.get(key)
        if spares:
            spare = spares.pop()
            if not spares:
                del self.spares[key]
            self.spare_of[spare] = None
            self.index[key] = spare
            self.key[spare] = key
            self.owner[spare] = self.account_of(spare)
            return
        self._unindex(key)
        if not self._findable(key):
            self._drop_descendants(key)

    def _unindex(self, key: CacheKey) -> None:
        del self.index[key]
        parent = self.parent.pop(key, None)
        if parent is not None:
            siblings = self.children.get(parent)
            if siblings is not None:
                siblings.discard(key)
                if not siblings:
                    del self.children[parent]
        self.evictions += 1
        if self.events is not None:
            self.events.removed(key, GPU)

    def _drop_descendants(self, key: CacheKey) -> None:
        """Unregister every registered descendant of ``key`` (no lookup can
        reach them): idle pages become free, referenced ones stay with their
        holders as private pages, spares stay spare no more."""
        stack = list(self.children.pop(key, ()))
        while stack:
            child = stack.pop()
            page = self.index.get(child)
            if page is None:
                continue
            for spare in self.spares.pop(child, ()):
                self.spare_of[spare] = None
            self.key[page] = None
            if page == self._taking:  # out of the LRU already, and not to be freed
                self.public[page] = None
            elif self.holders[page] is None:
                del self.lru[page]
                self.public[page] = None
                self.free.append(page)
            elif self.public[page] is not None:
                self._make_private(page)
            self._unindex(child)
            stack.extend(self.children.pop(child, ()))

    def _make_private(self, page: int) -> None:
        """A referenced public page stops being public: its charge moves from
        the shared account to its first holder."""
        self.public[page] = None
        self.ledger.accounts[SHARED_ACCOUNT].used -= 1
        self.ledger.accounts[self.account_of(page)].used += 1

    def _release_spare(self, page: int) -> None:
        key = self.spare_of[page]
        if key is None:
            return
        self.spare_of[page] = None
        spares = self.spares[key]
        spares.discard(page)
        if not spares:
            del self.spares[key]

    def flush(self) -> int:
        """Forget every cached page nobody references; returns how many
        pages that freed."""
        before = len(self.free)
        while self.lru:
            page, _ = self.lru.popitem(last=False)
            self._forget(page)  # may free other cached pages: its descendants
            self.free.append(page)
        return len(self.free) - before

    # -- checking ------------------------------------------------------------

    def check_invariants(self) -> None:
        free, lru = set(self.free), set(self.lru)
        assert len(free) == len(self.free), "a page is twice in the free list"
        assert not free & lru, "a page is both free and cached"
        assert NULL_PAGE not in free | lru and self.ref[NULL_PAGE] == 0, "null page in use"
        charges: dict[str, int] = {name: 0 for name in self.ledger.accounts}
        for page in range(1, self.num_pages):
            holders = self.holders[page]
            ref = self.ref[page]
            if page in free:
                assert ref == 0 and holders is None and self.key[page] is None, page
            elif page in lru:
                assert ref == 0 and holders is None and self.key[page] is not None, page
            else:
                assert ref > 0 and holders and sum(holders.values()) == ref, page
                charges[self.account_of(page)] += 1
            key = self.key[page]
            if key is not None:
                assert self.index[key] == page, page
            assert self.public[page] is None or self.key[page] is not None, page
            spare = self.spare_of[page]
            if spare is not None:
                assert ref > 0 and key is None and page in self.spares[spare], page
                assert spare in self.index and self.public[self.index[spare]] is None, page
        assert len(self.index) == sum(1 for k in self.key if k is not None)
        assert sum(len(s) for s in self.spares.values()) == sum(
            1 for k in self.spare_of if k is not None
        )
        for key, parent in self.parent.items():  # the tree: every chain reaches a root
            assert key in self.index and key in self.children[parent], key
            assert self._findable(parent), (key, parent)
        for name, account in self.ledger.accounts.items():
            assert account.used == charges[name], (name, account.used, charges[name])
