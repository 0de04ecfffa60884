"""The prefix cache's side of the KV manager: a sequence's scope and chained
block hashes, the lookup of the longest resident prefix (every page group must
hold it; sliding groups only the blocks the first uncomputed token sees), and
offering computed full blocks to the cache."""

from __future__ import annotations

from kvd.kv.core import KVCore
from kvd.kv.records import KVError, PrefixHit
from kvd.kv.scope import Scope, chain_hashes, resolve_scope
from kvd.kv.sequence import KVState, Sequence


class PrefixCache(KVCore):
    def _ensure_scope(self, seq: Sequence) -> Scope:
        scope = resolve_scope(
            self.policy, seq.tenant, seq.cache_salt, seq.tokens, self.block_size, self.public
        )
        if scope != seq.scope:
            seq.scope = scope
            seq.hashes = []
        return scope

    def _extend_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        hashes = seq.hashes
        if len(hashes) < num_blocks:
            assert seq.scope is not None
            parent = hashes[-1] if hashes else None
            hashes += chain_hashes(
                seq.tokens, self.block_size, seq.scope, len(hashes), num_blocks, parent
            )
        return hashes

    def lookup(self, seq: Sequence) -> PrefixHit:
        """The longest prefix of a waiting sequence whose KV is resident.

        Only full blocks count, and at least one token is left to compute (its
        logits are needed). Global groups need every block of the hit; sliding
        groups only the blocks the first uncomputed token can see. The hit is
        the longest length that satisfies every group (as vLLM intersects
        full-attention and sliding-window hits).
        """
        self._own(seq)
        if seq.state is not KVState.WAITING:
            raise KVError(f"sequence {seq.seq_id} is {seq.state.value}, not waiting")
        scope = self._ensure_scope(seq)
        max_blocks = (len(seq.tokens) - 1) // self.block_size
        hashes = self._extend_hashes(seq, max_blocks)
        index = self.pool.index
        hit = 0
        for block in range(max_blocks):
            h = hashes[block]
            if not all((g, h) in index for g in self.global_groups):
                break
            hit += 1
        sliding_start = 0
        if self.sliding_groups:
            hit = self._sliding_hit(hashes, hit)
            sliding_start = self.first_needed_block(hit * self.block_size)
        pages = tuple(
            tuple(
                index[(g, hashes[b])] if (b >= sliding_start or g in self.global_groups) else 0
                for b in range(hit)
            )
            for g in range(self.num_groups)
        )
        return PrefixHit(
            seq.seq_id,
            hit,
            hit * self.block_size,
            sliding_start,
            pages,
            self.pool.evictions,
            self.generation,
            scope,
        )

    def _sliding_hit(self, hashes: list[bytes], limit: int) -> int:
        """Longest hit <= limit whose in-window blocks are cached in every sliding group."""
        index = self.pool.index
        hit = limit
        while hit > 0:
            first = self.first_needed_block(hit * self.block_size)
            missing = None
            for block in range(hit - 1, first - 1, -1):
                h = hashes[block]
                if not all((g, h) in index for g in self.sliding_groups):
                    missing = block
                    break
            if missing is None:
                return hit
            hit = missing  # any longer hit would need the missing block too
        return 0

    def _register_pending(self, seq: Sequence) -> None:
        """Offer the cache every full computed block not offered yet."""
        computed_blocks = seq.num_computed // self.block_size
        if computed_blocks > seq.registered and seq.tables[0]:
            self._register_blocks(seq, seq.registered, computed_blocks)

    def _register_blocks(self, seq: Sequence, start: int, stop: int) -> None:
        seq.registered = max(seq.registered, stop)
        scope = seq.scope if seq.scope is not None else self._ensure_scope(seq)
        hashes = self._extend_hashes(seq, stop)
        register = self.pool.register
        if not scope.public_matches:  # no public prefix in this chain: every page stays private
            for block in range(start, stop):
                key_hash = hashes[block]
                for g, table in enumerate(seq.tables):
                    page = table[block]
                    if page:
                        register(page, (g, key_hash), None)
            return
        live = self.public.live_ids() if scope.public_blocks > start else frozenset()
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
                if page:
                    register(page, (g, key_hash), public)
