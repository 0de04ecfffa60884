"""The KV manager's invariants, checked whole (tests, and after faults):
refcounts equal block-table references, tables consistent, columns true."""

from __future__ import annotations

from kvd.kv.columns import LAST_TOKEN, LENGTH, RESIDENT
from kvd.kv.registry import SequenceRegistry
from kvd.kv.sequence import Residency


def check_invariants(kv: SequenceRegistry) -> None:
    """Refcounts equal block-table references; tables are consistent."""
    kv.pool.check_invariants()
    refs: dict[int, dict[str, int]] = {}
    for seq in kv.sequences.values():
        if seq.residency in (Residency.RESIDENT, Residency.SWAPPING_OUT):
            assert all(len(t) == seq.num_blocks for t in seq.tables), seq
            assert seq.num_computed <= seq.num_blocks * kv.block_size, seq
            # No block beyond what the known tokens need: waste is at most
            # one partly-filled block per group.
            assert seq.num_blocks <= -(-len(seq.tokens) // kv.block_size), seq
        else:
            assert not any(seq.tables), seq
        for g in kv.sliding_groups:
            assert not any(seq.tables[g][: seq.sliding_start]), seq
        for page in seq.held_pages():
            per = refs.setdefault(page, {})
            per[seq.tenant] = per.get(seq.tenant, 0) + 1
    for page in range(1, kv.pool.num_pages):
        assert (kv.pool.holders[page] or {}) == refs.get(page, {}), page
    columns = kv.columns
    assert columns.live() == len(kv.sequences)
    for seq in kv.sequences.values():
        assert columns.owner[seq.slot] is seq, seq
        assert columns.get(LENGTH, seq.slot) == len(seq.tokens), seq
        last = seq.tokens[-1] if seq.tokens else 0
        assert columns.get(LAST_TOKEN, seq.slot) == last, seq
        assert columns.get(RESIDENT, seq.slot) == (seq.residency is Residency.RESIDENT), seq
