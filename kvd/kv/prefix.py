"""The prefix cache's side of the KV manager: a sequence's scope and chained
block hashes, the lookup of the longest resident prefix (every page group must
hold it; sliding groups only the blocks the first uncomputed token sees), and
offering computed full blocks to the cache."""

from __future__ import annotations

from collections.abc import Container

from kvd.kv.events import CacheKey, KVEventLog, published_chain
from kvd.kv.records import KVError, PrefixHit
from kvd.kv.registry import SequenceRegistry
from kvd.kv.scope import PUBLIC_SCOPE, Scope, chain_hashes, resolve_scope
from kvd.kv.sequence import Residency, Sequence


class PrefixCache:
    """Changes, of the registry's sequences: ``scope``, ``hashes`` and
    ``registered``; of the pool: the cache index (``register``)."""

    def __init__(self, registry: SequenceRegistry) -> None:
        self.registry = registry

    def ensure_scope(self, seq: Sequence) -> Scope:
        scope = resolve_scope(
            self.registry.policy,
            seq.tenant,
            seq.cache_salt,
            seq.tokens,
            self.registry.block_size,
            self.registry.public,
        )
        if scope != seq.scope:
            seq.scope = scope
            seq.hashes = []
            seq.published = []
        return scope

    def parent_key(self, group: int, hashes: list[bytes], block: int) -> CacheKey | None:
        """The key a block of ``group`` chains on in the pool's tree: the
        block before it in a full-attention group; None for a first block, or
        in a sliding group (its blocks need no chain)."""
        if block and group in self.registry.global_groups:
            return group, hashes[block - 1]
        return None

    def extend_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        hashes = seq.hashes
        if len(hashes) < num_blocks:
            assert seq.scope is not None
            parent = hashes[-1] if hashes else None
            hashes += chain_hashes(
                seq.tokens, self.registry.block_size, seq.scope, len(hashes), num_blocks, parent
            )
        return hashes

    def lookup(self, seq: Sequence, *, host: bool = True, use_cache: bool = True) -> PrefixHit:
        """The longest prefix of a waiting sequence whose KV is cached, on the
        device or (``host``) on the host cache; none without ``use_cache`` (a
        sequence that must compute its whole prompt).

        Only full blocks count, and at least one token is left to compute (its
        logits are needed). Global groups need every block of the hit; sliding
        groups only the blocks the first uncomputed token can see. The hit is
        the longest length that satisfies every group (as vLLM intersects
        full-attention and sliding-window hits). Blocks found only in the host
        cache are listed in ``reloads``.
        """
        self.registry.own(seq)
        if seq.residency is not Residency.WAITING:
            raise KVError(f"sequence {seq.seq_id} is {seq.residency.value}, not waiting")
        scope = self.ensure_scope(seq)
        max_blocks = (len(seq.tokens) - 1) // self.registry.block_size if use_cache else 0
        hashes = self.extend_hashes(seq, max_blocks)
        index = self.registry.pool.index
        on_host = self.registry.host.blocks if host and self.registry.host.blocks else None
        cached = index if on_host is None else _Either(index, on_host)
        hit = 0
        for block in range(max_blocks):
            h = hashes[block]
            if not all((g, h) in cached for g in self.registry.global_groups):
                break
            hit += 1
        sliding_start = 0
        if self.registry.sliding_groups:
            hit = self._sliding_hit(hashes, hit, cached)
            sliding_start = self.registry.first_needed_block(hit * self.registry.block_size)
        reloads: list[tuple[int, int]] = []
        pages: list[tuple[int, ...]] = []
        for g in range(self.registry.num_groups):
            row = []
            for b in range(hit):
                page = 0
                if b >= sliding_start or g in self.registry.global_groups:
                    found = index.get((g, hashes[b]))
                    if found is None:
                        reloads.append((g, b))
                    else:
                        page = found
                row.append(page)
            pages.append(tuple(row))
        return PrefixHit(
            seq.seq_id,
            hit,
            hit * self.registry.block_size,
            sliding_start,
            tuple(pages),
            self.registry.cache_epoch(),
            self.registry.generation,
            scope,
            tuple(reloads),
        )

    def _sliding_hit(self, hashes: list[bytes], limit: int, cached: Container[object]) -> int:
        """Longest hit <= limit whose in-window blocks are cached in every sliding group."""
        hit = limit
        while hit > 0:
            first = self.registry.first_needed_block(hit * self.registry.block_size)
            missing = None
            for block in range(hit - 1, first - 1, -1):
                h = hashes[block]
                if not all((g, h) in cached for g in self.registry.sliding_groups):
                    missing = block
                    break
            if missing is None:
                return hit
            hit = missing  # any longer hit would need the missing block too
        return 0

    def register_pending(self, seq: Sequence) -> None:
        """Offer the cache every full computed block not offered yet."""
        computed_blocks = seq.num_computed // self.registry.block_size
        if computed_blocks > seq.registered and seq.tables[0]:
            self.register_blocks(seq, seq.registered, computed_blocks)

    def register_blocks(self, seq: Sequence, start: int, stop: int) -> None:
        # A block holding a token a step in flight sampled waits: its hash
        # would be of a placeholder (register_pending offers it later).
        stop = min(stop, seq.known_tokens // self.registry.block_size)
        if stop <= start:
            return
        seq.registered = max(seq.registered, stop)
        scope = seq.scope if seq.scope is not None else self.ensure_scope(seq)
        hashes = self.extend_hashes(seq, stop)
        register = self.registry.pool.register
        events = self.registry.pool.events
        parent_key = self.parent_key
        if not scope.public_matches:  # no public prefix in this chain: every page stays private
            for block in range(start, stop):
                key_hash = hashes[block]
                for g, table in enumerate(seq.tables):
                    page = table[block]
                    parent = parent_key(g, hashes, block)
                    registered = page and register(page, (g, key_hash), None, parent)
                    if registered and events is not None:
                        self._tell_stored(events, seq, hashes, block, g)
            return
        live = self.registry.public.live_ids() if scope.public_blocks > start else frozenset()
        for block in range(start, stop):
            public = None
            if block < scope.public_blocks:
                # Only registrations still live may make a page public; a block of
                # a prefix removed (or replaced) since the lookup stays uncached.
                public = scope.prefixes_covering(block) & live
                if not public:
                    continue
            key_hash = hashes[block]
            for g, table in enumerate(seq.tables):
                page = table[block]
                parent = parent_key(g, hashes, block)
                registered = page and register(page, (g, key_hash), public, parent)
                if registered and events is not None:
                    self._tell_stored(events, seq, hashes, block, g)

    def _tell_stored(
        self, events: KVEventLog, seq: Sequence, hashes: list[bytes], block: int, group: int
    ) -> None:
        scope = seq.scope
        assert scope is not None
        size = self.registry.block_size
        published = seq.published
        if len(published) <= block:  # the chain a router hashes, computed when first told
            start = len(published)
            published += published_chain(
                seq.tokens,
                size,
                [scope.of_block(b) for b in range(start, block + 1)],
                start,
                published[-1] if published else None,
            )
        events.stored(
            (group, hashes[block]),
            published[block],
            published[block - 1] if block else None,
            seq.tokens[block * size : (block + 1) * size],
            scope.of_block(block),
            parent_private=bool(block) and scope.of_block(block - 1) != PUBLIC_SCOPE,
        )


class _Either:
    """Membership in either of two mappings (the device index, the host cache)."""

    def __init__(self, first: Container[object], second: Container[object]) -> None:
        self.first, self.second = first, second

    def __contains__(self, key: object) -> bool:
        return key in self.first or key in self.second
