"""What a pool holds: the seed's arithmetic, next to what kvd's allocator achieves.

The *eager* figures are the seed's formulas: every sequence reserves its whole
sliding window up front (the "320 MiB floor" for Gemma 4 12B), global layers
grow per token. The *kvd* figures are not a second formula: they come from
running the real allocator (``KVManager``) on an empty pool of that size, with
lazy windows, page-group layout and block granularity, until it refuses.
"""

from __future__ import annotations

import msgspec

from kvd.kv.geometry import AttentionKind, KVGeometry
from kvd.kv.layout import build_layout
from kvd.kv.ledger import BudgetMode, TenantBudget
from kvd.kv.manager import KVManager

MAX_SIMULATED_PAGES = 4_000_000
GIB = 2**30

# Parameters per preset, the embedding counted once (tied to the output).
# Gemma 3: computed from kvd.engine.config.PRESETS (tests/kv/test_capacity.py
# keeps them equal). Gemma 4 12B has no engine preset: its model card's
# "11.95B", an approximation.
PARAMETERS: dict[str, int] = {
    "gemma3-270m": 268_098_176,
    "gemma3-1b": 999_885_952,
    "gemma3-4b": 3_880_099_328,
    "gemma3-12b": 11_765_788_416,
    "gemma3-27b": 27_009_002_240,
    "gemma4-12b": 11_950_000_000,
    # Its config: 60 layers of width 5,376, MLP 21,504, 32 heads; the
    # published "31B" (30.7B) as the count.
    "gemma4-31b": 30_700_000_000,
}
# Hidden width per preset: the tied embedding (VOCAB x width) is replicated
# on every device under tensor parallelism (kvd.engine.sharding), the rest split.
HIDDEN: dict[str, int] = {
    "gemma3-270m": 640,
    "gemma3-1b": 1152,
    "gemma3-4b": 2560,
    "gemma3-12b": 3840,
    "gemma3-27b": 5376,
    "gemma4-31b": 5376,
}
VOCAB = 262_144
# Bytes per parameter: int8 values with an f32 scale per 32 (a GGUF Q8_0
# block re-encoded; kvd.engine.wquant).
WEIGHT_FORMATS: dict[str, float] = {"float32": 4.0, "bfloat16": 2.0, "int8": 1.0 + 4 / 32}
# The seed's chip: 28.7 GiB of usable HBM, of which Gemma 4 12B's bf16
# weights and the ~3.8 GiB pool leave this much to the runtime and activations.
SEED_DEVICE_MEMORY = int(28.7 * GIB)
SEED_OVERHEAD = SEED_DEVICE_MEMORY - int(PARAMETERS["gemma4-12b"] * 2.0) - int(3.8 * GIB)


class WeightsFit(msgspec.Struct, frozen=True):
    """One weight format on ``devices`` devices of ``device_memory`` bytes
    each: what is left to the KV pool."""

    weights: str
    parameters: int
    weight_bytes: int  # all of them, once
    device_memory: int  # per device
    overhead_bytes: int  # the runtime and activations, per device
    pool_bytes: int  # the pool the allocator manages (over all devices when split)
    max_sequences_512: int  # concurrent 512-token sequences in that pool (kvd's allocator)
    devices: int = 1
    weight_bytes_per_device: int = 0  # the replicated embedding plus a share of the rest
    pool_bytes_per_device: int = 0
    pool_split: bool = False  # split by KV head over the devices, else one copy on each


def pool_splits(geometry: KVGeometry, devices: int) -> bool:
    """Whether the engine splits the pool over ``devices`` (by KV head:
    every layer kind with the same KV shape, the heads dividing evenly;
    kvd.engine.sharding.pool_layout) or keeps a whole copy on each."""
    shapes = {(t.kv_heads, t.head_dim) for t in geometry.layer_types}
    return devices > 1 and len(shapes) == 1 and next(iter(shapes))[0] % devices == 0


def weights_fits(
    geometry: KVGeometry,
    parameters: int,
    device_memory: int,
    overhead: int = SEED_OVERHEAD,
    block_size: int = 16,
    devices: int = 1,
    replicated_parameters: int = 0,
) -> list[WeightsFit]:
    """Every weight format's pool on ``devices`` devices of ``device_memory``
    bytes, the model split over them by tensor parallelism:
    ``replicated_parameters`` (the embedding) on every device, the rest
    divided. The pool is what a device has left, times the devices when the
    pool splits over them."""
    fits = []
    split = pool_splits(geometry, devices)
    for name, per_parameter in WEIGHT_FORMATS.items():
        weight_bytes = int(parameters * per_parameter)
        per_device = int(
            replicated_parameters * per_parameter
            + (parameters - replicated_parameters) * per_parameter / devices
        )
        pool_here = max(device_memory - per_device - overhead, 0)
        pool = pool_here * devices if split else pool_here
        sequences = max_sequences(geometry, pool, block_size, 512) if pool > 0 else 0
        fits.append(
            WeightsFit(
                name,
                parameters,
                weight_bytes,
                device_memory,
                overhead,
                pool,
                sequences,
                devices,
                per_device,
                pool_here,
                split,
            )
        )
    return fits


class BytesPerToken(msgspec.Struct, frozen=True):
    total: int
    global_: int = msgspec.field(name="global")
    sliding: int


class EagerCapacity(msgspec.Struct, frozen=True):
    sliding_floor_bytes: int  # the whole window, reserved by every sequence at once
    total_tokens: int  # tokens of KV in the whole pool, counting every layer per token
    longest_sequence_tokens: int | None  # floor + global bytes per token; None: unbounded
    max_sequences: int  # the floor alone, before any global-layer KV


class KvdCapacity(msgspec.Struct, frozen=True):
    block_size: int
    page_bytes: int
    num_pages: int  # allocatable pages (the null page excluded)
    groups: int
    global_groups: int
    sliding_groups: int
    padded_layer_places: int
    sliding_bytes_first_token: int  # what a 1-token sequence holds on sliding layers (lazy floor)
    total_tokens: int  # tokens resident when the pool is filled with one-block sequences
    max_sequences_512: int  # concurrent 512-token sequences
    longest_sequence_tokens: int | None  # one sequence grown a block at a time; None: unbounded
    max_waste_bytes_per_sequence: int  # one partly filled block per group
    max_sequences_at_context: int | None = None


class CapacityReport(msgspec.Struct, frozen=True):
    model: str
    dtype: str
    layers: int
    global_layers: int
    sliding_layers: int
    window: int | None
    bytes_per_token: BytesPerToken
    pool_bytes: int | None = None
    context: int | None = None
    sequence_bytes_at_context: int | None = (
        None  # global x context + sliding x min(context, window)
    )
    eager_sequence_bytes_at_context: int | None = None  # the window reserved in full
    eager: EagerCapacity | None = None
    kvd: KvdCapacity | None = None
    weights: list[WeightsFit] | None = None  # each format's pool, with --device-memory
    weights_format: str | None = None  # the format whose pool the report is for


def bytes_per_token(geometry: KVGeometry) -> BytesPerToken:
    kinds = geometry.kinds()
    per = {k: geometry.bytes_per_token(k) if k in kinds else 0 for k in AttentionKind}
    return BytesPerToken(
        total=sum(per.values()),
        global_=per[AttentionKind.GLOBAL],
        sliding=per[AttentionKind.SLIDING],
    )


def eager_capacity(geometry: KVGeometry, pool_bytes: int) -> EagerCapacity:
    bpt = bytes_per_token(geometry)
    floor = bpt.sliding * (geometry.window or 0)
    longest: int | None = None  # only sliding layers: a fitting floor allows any length
    if bpt.global_:
        longest = max(0, (pool_bytes - floor) // bpt.global_)
    return EagerCapacity(
        sliding_floor_bytes=floor,
        total_tokens=pool_bytes // bpt.total,
        longest_sequence_tokens=longest,
        max_sequences=pool_bytes // floor if floor else pool_bytes // bpt.total,
    )


def kvd_capacity(
    geometry: KVGeometry, pool_bytes: int, block_size: int, context: int | None = None
) -> KvdCapacity:
    layout = build_layout(geometry, block_size)
    pages = layout.num_pages(pool_bytes)
    if pages < 2:
        raise ValueError(
            f"a pool of {pool_bytes} bytes holds fewer than two {layout.page_bytes}-byte pages"
        )
    if pages > MAX_SIMULATED_PAGES:
        raise ValueError(
            f"{pages:,} pages of {layout.page_bytes} bytes are too many to simulate "
            f"(at most {MAX_SIMULATED_PAGES:,}); use a larger block size"
        )
    probe = _fresh(geometry, pool_bytes, block_size)
    seq = probe.add_sequence(0, "probe", [0])
    probe.allocate(seq, 1)
    first_token_sliding = len(probe.registry.sliding_groups) * layout.page_bytes
    probe.check_invariants()
    return KvdCapacity(
        block_size=block_size,
        page_bytes=layout.page_bytes,
        num_pages=probe.registry.pool.capacity,
        groups=layout.num_groups,
        global_groups=len(probe.registry.global_groups),
        sliding_groups=len(probe.registry.sliding_groups),
        padded_layer_places=layout.padded_layer_places(),
        sliding_bytes_first_token=first_token_sliding,
        total_tokens=block_size * max_sequences(geometry, pool_bytes, block_size, block_size),
        max_sequences_512=max_sequences(geometry, pool_bytes, block_size, 512),
        longest_sequence_tokens=_longest(geometry, pool_bytes, block_size),
        max_waste_bytes_per_sequence=(block_size - 1) * bytes_per_token(geometry).total,
        max_sequences_at_context=(
            None if context is None else max_sequences(geometry, pool_bytes, block_size, context)
        ),
    )


def _fresh(geometry: KVGeometry, pool_bytes: int, block_size: int) -> KVManager:
    kv = KVManager.for_pool_bytes(
        build_layout(geometry, block_size), pool_bytes, mode=BudgetMode.FREE
    )
    kv.set_tenant("probe", TenantBudget())
    return kv


def _grow(kv: KVManager, seq_id: int, length: int) -> bool:
    """Compute a ``length``-token sequence a block at a time; False once the pool refuses."""
    seq = kv.add_sequence(seq_id, "probe", [0] * length)
    step = kv.block_size
    while seq.num_computed < length:
        chunk = min(step, length - seq.num_computed)
        if not kv.can_allocate(seq, chunk):
            kv.finish(seq)
            return False
        kv.allocate(seq, chunk)
        kv.commit(seq, chunk)
    return True


def max_sequences(geometry: KVGeometry, pool_bytes: int, block_size: int, length: int) -> int:
    kv = _fresh(geometry, pool_bytes, block_size)
    count = 0
    while _grow(kv, count, length):
        count += 1
    kv.check_invariants()
    return count


def _longest(geometry: KVGeometry, pool_bytes: int, block_size: int) -> int | None:
    kv = _fresh(geometry, pool_bytes, block_size)
    if not kv.registry.global_groups:
        return None  # sliding layers release as they go: length is not bounded by the pool
    seq = kv.add_sequence(0, "probe", [0] * block_size)
    while kv.can_allocate(seq, block_size):
        kv.allocate(seq, block_size)
        kv.commit(seq, block_size)
        kv.append_tokens(seq, [0] * block_size)
    kv.check_invariants()
    return seq.num_computed


def capacity_report(
    geometry: KVGeometry,
    pool_bytes: int | None = None,
    *,
    block_size: int = 16,
    context: int | None = None,
) -> CapacityReport:
    bpt = bytes_per_token(geometry)
    window = geometry.window
    seq_bytes = eager_seq_bytes = None
    if context is not None:
        sliding_tokens = min(context, window) if window else context
        seq_bytes = bpt.global_ * context + bpt.sliding * sliding_tokens
        eager_seq_bytes = bpt.global_ * context + bpt.sliding * (window or context)
    return CapacityReport(
        model=geometry.name,
        dtype=geometry.dtype,
        layers=geometry.num_layers,
        global_layers=len(geometry.layers_of(AttentionKind.GLOBAL)),
        sliding_layers=len(geometry.layers_of(AttentionKind.SLIDING)),
        window=window,
        bytes_per_token=bpt,
        pool_bytes=pool_bytes,
        context=context,
        sequence_bytes_at_context=seq_bytes,
        eager_sequence_bytes_at_context=eager_seq_bytes,
        eager=None if pool_bytes is None else eager_capacity(geometry, pool_bytes),
        kvd=(
            None if pool_bytes is None else kvd_capacity(geometry, pool_bytes, block_size, context)
        ),
    )
