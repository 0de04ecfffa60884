"""One pool of equal pages for layers of different shapes.

Sliding and global layers must draw on ONE byte budget (a fixed split wastes
whichever side the workload does not need). Pages therefore have one size,
and layers are gathered into *page groups* so that a page of any group holds
the same number of bytes: ``block_size`` tokens x the group's layers x the
per-layer K/V bytes of one token. Gemma 4 12B's global layers cost twice a
sliding layer per token, so its groups hold 4 global or 8 sliding layers; a
page of either is 1 MiB at block 16 in bf16, and any free page serves both.

Every group has its own block table per sequence (the device gathers a page
and views it with that group's shape); groups of the same kind allocate in
lock-step. The grouping picks, among layer counts that make page bytes equal,
the least padding (padded places are bytes nobody can use) among groupings of at
most MAX_GROUPS groups (each group costs host bookkeeping per block), then
the fewest groups.
"""

from __future__ import annotations

import functools
import math

import msgspec

from kvd.kv.geometry import AttentionKind, KVGeometry


class PageGroup(msgspec.Struct, frozen=True):
    """Layers of one kind that share a block table and a page."""

    index: int
    kind: AttentionKind
    layers: tuple[int, ...]  # model layer indices stored in this group's pages
    places: int  # layer places per page, >= len(layers); the rest is padding
    window: int | None  # sliding window in tokens, None for global groups


class PageLayout(msgspec.Struct, frozen=True):
    geometry: KVGeometry
    block_size: int
    groups: tuple[PageGroup, ...]
    page_bytes: int

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def groups_of(self, kind: AttentionKind) -> tuple[PageGroup, ...]:
        return tuple(g for g in self.groups if g.kind is kind)

    def padded_layer_places(self) -> int:
        return sum(g.places - len(g.layers) for g in self.groups)

    def num_pages(self, pool_bytes: int) -> int:
        return pool_bytes // self.page_bytes

    def pool_tokens(self, pool_bytes: int) -> int:
        """Tokens per page group that a pool of ``pool_bytes`` holds (whole
        blocks, one page per group each)."""
        return self.num_pages(pool_bytes) // self.num_groups * self.block_size

    def pages_for_tokens(self, tokens: int, chunk: int = 1) -> int:
        """Most pages one sequence of ``tokens`` tokens holds at once, when it
        is computed ``chunk`` tokens per step (its prefill chunks; decodes are
        chunks of 1).

        A sliding group slides only after a step, so while a chunk of c tokens
        is computed from position p it holds every block from the first one
        position p still sees, ``(p - window + 1) // block``, to the one the
        chunk ends in: about (window + c) / block pages, not window / block.
        """
        blocks = -(-tokens // self.block_size)
        total = 0
        for group in self.groups:
            if group.window is None:
                total += blocks
            else:
                total += min(blocks, _sliding_peak(group.window, self.block_size, chunk))
        return total

    def group_of_layer(self, layer: int) -> tuple[int, int]:
        """(group index, place within the page) where a model layer's KV lives."""
        for group in self.groups:
            if layer in group.layers:
                return group.index, group.layers.index(layer)
        raise KeyError(layer)


# Padded layer places are pool bytes nobody can use, so an exact fit wins unless
# it needs more groups than this (Gemma 3 4B: 7 groups with 1 padded place, not 34).
MAX_GROUPS = 16


class LayoutError(ValueError):
    pass


def build_layout(geometry: KVGeometry, block_size: int) -> PageLayout:
    """Group a geometry's layers into equal-byte page groups."""
    if block_size < 1:
        raise LayoutError("block size must be at least one token")
    kinds = geometry.kinds()
    per_layer = {k: geometry.bytes_per_token_per_layer(k) for k in kinds}
    counts = {k: len(geometry.layers_of(k)) for k in kinds}
    places = _choose_places(per_layer, counts)
    groups: list[PageGroup] = []
    for kind in kinds:
        layer_ids = geometry.layers_of(kind)
        window = geometry.layer_type(kind).window
        for start in range(0, len(layer_ids), places[kind]):
            chunk = layer_ids[start : start + places[kind]]
            groups.append(PageGroup(len(groups), kind, chunk, places[kind], window))
    page_bytes = block_size * places[kinds[0]] * per_layer[kinds[0]]
    return PageLayout(geometry, block_size, tuple(groups), page_bytes)


def _choose_places(
    per_layer: dict[AttentionKind, int], counts: dict[AttentionKind, int]
) -> dict[AttentionKind, int]:
    unit = math.lcm(*per_layer.values())
    candidates: list[tuple[tuple[bool, int, int], dict[AttentionKind, int]]] = []
    multiple = 1
    while True:
        places = {k: unit * multiple // b for k, b in per_layer.items()}
        padding = sum(_ceil_div(counts[k], s) * s - counts[k] for k, s in places.items())
        num_groups = sum(_ceil_div(counts[k], s) for k, s in places.items())
        candidates.append(((num_groups > MAX_GROUPS, padding, num_groups), places))
        if all(s >= counts[k] for k, s in places.items()):
            return min(candidates, key=lambda c: c[0])[1]
        multiple += 1


@functools.lru_cache(maxsize=64)
def _sliding_peak(window: int, block_size: int, chunk: int) -> int:
    """Most blocks a sliding group holds while a chunk of ``chunk`` tokens is
    computed from any position (the pattern repeats every block, so the
    positions of one block, far enough from the start, cover every case)."""
    base = (window + chunk) // block_size * block_size + block_size
    return max(
        -(-(p + chunk) // block_size) - max(0, p - window + 1) // block_size
        for p in range(base, base + block_size)
    )


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)
