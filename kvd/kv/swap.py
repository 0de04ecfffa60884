"""Swapping a sequence out to host memory and back: its private pages are
copied and freed; pages others share (or public ones) stay held on the device,
so they stay shared and charged as they were."""

from __future__ import annotations

from kvd.kv.pool import NULL_PAGE
from kvd.kv.prefix import PrefixCache
from kvd.kv.records import Demand, KVError, PageCopy
from kvd.kv.registry import SequenceRegistry
from kvd.kv.sequence import Residency, Sequence


class Swapper:
    """Changes: a swapping sequence's residency, tables, ``swapped_blocks`` and
    ``kept``; pages dropped to the pool and taken back from it."""

    def __init__(self, registry: SequenceRegistry, prefix: PrefixCache) -> None:
        self.registry = registry
        self.prefix = prefix

    def _shared(self, page: int) -> bool:
        """Held by someone else too, or public: copying it out frees nothing."""
        holders = self.registry.pool.holders[page]
        return self.registry.pool.public[page] is not None or (
            holders is not None and sum(holders.values()) > 1
        )

    def shared_prefix_tokens(self, seq: Sequence) -> int:
        """Computed tokens at the start of ``seq`` whose pages others also hold
        (or that are public): a recompute would find them in the prefix cache."""
        blocks = 0
        tables = [seq.tables[g] for g in self.registry.global_groups]
        for block in range(seq.num_computed // self.registry.block_size):
            if not all(table[block] and self._shared(table[block]) for table in tables):
                break
            blocks += 1
        return blocks * self.registry.block_size

    def swap_out_pages(self, seq: Sequence) -> int:
        """Pages a swap-out of a resident ``seq`` would copy (and free)."""
        return sum(1 for page in seq.held_pages() if not self._shared(page))

    def begin_swap_out(self, seq: Sequence) -> list[PageCopy]:
        """The pages to copy to host: the sequence's private pages. They stay
        held until ``finish_swap_out``; shared and public pages are not copied
        and stay held through the swap, so they stay shared (and charged as
        they were)."""
        self.registry.own(seq)
        if seq.residency is not Residency.RESIDENT:
            raise KVError(f"sequence {seq.seq_id} is {seq.residency.value}, not resident")
        seq.residency = Residency.SWAPPING_OUT
        return [
            PageCopy(g, block, page)
            for g, table in enumerate(seq.tables)
            for block, page in enumerate(table)
            if page and not self._shared(page)
        ]

    def abort_swap_out(self, seq: Sequence) -> None:
        """The copies ``begin_swap_out`` listed failed: ``seq`` is resident
        again, its pages as they were (its caller drops them instead)."""
        self.registry.own(seq)
        if seq.residency is not Residency.SWAPPING_OUT:
            raise KVError(f"sequence {seq.seq_id} is {seq.residency.value}, not swapping out")
        seq.residency = Residency.RESIDENT

    def finish_swap_out(self, seq: Sequence) -> None:
        """The copies ``begin_swap_out`` listed are on the host: free those
        pages, remember which blocks they were; the pages not copied stay held."""
        self.registry.own(seq)
        if seq.residency is not Residency.SWAPPING_OUT:
            raise KVError(f"sequence {seq.seq_id} is {seq.residency.value}, not swapping out")
        # Decided before registering pending blocks, which can make a page public.
        copied = {
            (g, block)
            for g, table in enumerate(seq.tables)
            for block, page in enumerate(table)
            if page and not self._shared(page)
        }
        self.prefix.register_pending(seq)
        swapped: list[list[int]] = [[] for _ in seq.tables]
        kept: list[dict[int, int]] = [{} for _ in seq.tables]
        drop, tenant = self.registry.pool.drop, seq.tenant
        for g, table in enumerate(seq.tables):
            for block in range(len(table) - 1, -1, -1):
                page = table[block]
                if not page:
                    continue
                if (g, block) in copied:
                    swapped[g].append(block)
                    drop(page, tenant)
                else:
                    kept[g][block] = page
            swapped[g].reverse()
            table.clear()
        seq.table_version = self.registry.stamp()
        seq.swapped_blocks = swapped
        seq.kept = kept
        seq.residency = Residency.SWAPPED

    def swap_in_demand(self, seq: Sequence) -> Demand:
        self.registry.own(seq)
        if seq.residency is not Residency.SWAPPED or seq.swapped_blocks is None:
            raise KVError(f"sequence {seq.seq_id} is {seq.residency.value}, not swapped")
        pages = sum(len(blocks) for blocks in seq.swapped_blocks)
        return Demand(pages, 0, pages)

    def can_swap_in(self, seq: Sequence) -> bool:
        return self.registry.fits(seq.tenant, self.swap_in_demand(seq))

    def swap_in(self, seq: Sequence) -> list[PageCopy]:
        """New pages for a swapped sequence; the caller copies host data into them
        before the next engine step. Full blocks re-enter the prefix cache."""
        demand = self.swap_in_demand(seq)
        if not self.registry.fits(seq.tenant, demand):
            raise KVError(f"cannot swap in sequence {seq.seq_id}: not enough pages or budget")
        assert seq.swapped_blocks is not None and seq.kept is not None
        pages = iter(self.registry.pool.take(seq.tenant, demand.fresh_pages))
        copies: list[PageCopy] = []
        for g, (blocks, kept) in enumerate(zip(seq.swapped_blocks, seq.kept, strict=True)):
            table = [NULL_PAGE] * seq.num_blocks
            for block in blocks:
                table[block] = page = next(pages)
                copies.append(PageCopy(g, block, page))
            for block, page in kept.items():
                table[block] = page
            seq.tables[g] = table
        seq.table_version = self.registry.stamp()
        seq.swapped_blocks = None
        seq.kept = None
        seq.residency = Residency.RESIDENT
        seq.num_allocated = seq.num_computed
        self.prefix.register_blocks(seq, 0, seq.num_computed // self.registry.block_size)
        return copies
