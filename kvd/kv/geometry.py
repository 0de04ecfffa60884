"""A model's KV-cache geometry as data, and the seed's formula applied to it.

    bytes per token = 2 x layers x kv_heads x (head_dim x bytes_per_element + scale)

The 2 is K and V. ``scale`` is 0 for float dtypes; an int8 cache stores each
token's K (and V) of each KV head with an f32 scale per ``quant_group``
values (4 bytes per 256 int8 values for Gemma; see kvd/engine/kvquant.py for
why per token), and those bytes are real pool bytes, so every capacity figure
counts them. Gemma interleaves sliding-window and global layers whose
shapes differ (Gemma 4's global layers have head_dim 512), so the formula is
applied once per layer type and never to the model as a whole.
"""

from __future__ import annotations

import enum
import math

import msgspec

ELEMENT_SIZES: dict[str, int] = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "int8": 1,
    "fp8": 1,
}

# What the engine's pool can store (fp8 has no XLA:CPU support to test it
# against); the others are for capacity arithmetic.
POOL_DTYPES = ("float32", "bfloat16", "int8")

# Bytes of dequantisation scale per quantisation group of a K or V row.
SCALE_BYTES: dict[str, int] = {"int8": 4}
MAX_QUANT_GROUP = 256

_DTYPE_ALIASES: dict[str, str] = {
    "f32": "float32",
    "fp32": "float32",
    "bf16": "bfloat16",
    "f16": "float16",
    "fp16": "float16",
    "i8": "int8",
    "float8": "fp8",
    "f8": "fp8",
}


class GeometryError(ValueError):
    """A geometry is inconsistent or names something unknown."""


class AttentionKind(enum.StrEnum):
    SLIDING = "sliding"
    GLOBAL = "global"


def canonical_dtype(name: str) -> str:
    """Map a dtype spelling (bf16, float32, fp8, ...) to its canonical name."""
    key = name.strip().lower()
    key = _DTYPE_ALIASES.get(key, key)
    if key not in ELEMENT_SIZES:
        known = ", ".join(sorted(ELEMENT_SIZES))
        raise GeometryError(f"unknown KV dtype {name!r} (known: {known})")
    return key


class LayerType(msgspec.Struct, frozen=True):
    """The KV shape shared by every layer of one attention kind."""

    kind: AttentionKind
    kv_heads: int
    head_dim: int
    window: int | None = None  # tokens a query sees, itself included; sliding only

    def __post_init__(self) -> None:
        if self.kv_heads < 1 or self.head_dim < 1:
            raise GeometryError(f"{self.kind} layers need kv_heads >= 1 and head_dim >= 1")
        if self.kind is AttentionKind.SLIDING and (self.window is None or self.window < 1):
            raise GeometryError("sliding layers need a window of at least one token")
        if self.kind is AttentionKind.GLOBAL and self.window is not None:
            raise GeometryError("global layers have no window")


class KVGeometry(msgspec.Struct, frozen=True):
    """Which attention kind each layer has, and the KV shape of each kind."""

    name: str
    layer_kinds: tuple[AttentionKind, ...]
    layer_types: tuple[LayerType, ...]
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        canonical_dtype(self.dtype)
        kinds = [t.kind for t in self.layer_types]
        if len(set(kinds)) != len(kinds):
            raise GeometryError("each attention kind may be described only once")
        missing = set(self.layer_kinds) - set(kinds)
        if missing:
            raise GeometryError(f"layers of kind {sorted(missing)} have no layer type")
        if not self.layer_kinds:
            raise GeometryError("a model needs at least one layer")

    @property
    def element_size(self) -> int:
        return ELEMENT_SIZES[canonical_dtype(self.dtype)]

    @property
    def quant_group(self) -> int:
        """Values of one row that share a scale: the largest common divisor of
        every kind's head_dim, at most MAX_QUANT_GROUP. Equal groups keep a
        row's scale bytes proportional to its head_dim, so sliding and global
        pages still divide one page size evenly (Gemma 4: 256 and 512 values
        carry 1 and 2 scales)."""
        group = math.gcd(*(t.head_dim for t in self.layer_types))
        while group > MAX_QUANT_GROUP and group % 2 == 0:
            group //= 2
        return group

    def scale_bytes(self, kind: AttentionKind) -> int:
        """Bytes of scale per (token, KV head) row of K or of V."""
        per_group = SCALE_BYTES.get(canonical_dtype(self.dtype), 0)
        return per_group * (self.layer_type(kind).head_dim // self.quant_group)

    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    def layer_type(self, kind: AttentionKind) -> LayerType:
        for layer_type in self.layer_types:
            if layer_type.kind is kind:
                return layer_type
        raise GeometryError(f"{self.name} has no {kind} layers")

    def layers_of(self, kind: AttentionKind) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k is kind)

    def kinds(self) -> tuple[AttentionKind, ...]:
        """Attention kinds present, global first (the order groups are built in)."""
        present = set(self.layer_kinds)
        return tuple(k for k in (AttentionKind.GLOBAL, AttentionKind.SLIDING) if k in present)

    def bytes_per_token_per_layer(self, kind: AttentionKind) -> int:
        t = self.layer_type(kind)
        return 2 * t.kv_heads * (t.head_dim * self.element_size + self.scale_bytes(kind))

    def bytes_per_token(self, kind: AttentionKind) -> int:
        """The seed's formula over every layer of one kind."""
        return len(self.layers_of(kind)) * self.bytes_per_token_per_layer(kind)

    def bytes_per_token_total(self) -> int:
        return sum(self.bytes_per_token(k) for k in self.kinds())

    @property
    def window(self) -> int | None:
        if AttentionKind.SLIDING not in self.layer_kinds:
            return None
        return self.layer_type(AttentionKind.SLIDING).window

    def with_dtype(self, dtype: str) -> KVGeometry:
        return msgspec.structs.replace(self, dtype=canonical_dtype(dtype))


def interleaved_kinds(num_layers: int, global_every: int) -> tuple[AttentionKind, ...]:
    """Gemma's pattern: (global_every - 1) sliding layers, then one global layer."""
    return tuple(
        AttentionKind.GLOBAL if (i + 1) % global_every == 0 else AttentionKind.SLIDING
        for i in range(num_layers)
    )


def uniform_geometry(
    name: str,
    *,
    layers: int,
    kv_heads: int,
    head_dim: int,
    dtype: str = "bfloat16",
    sliding_layers: int = 0,
    sliding_window: int | None = None,
    sliding_kv_heads: int | None = None,
    sliding_head_dim: int | None = None,
) -> KVGeometry:
    """A geometry from flat numbers (kvctl capacity's flags).

    ``layers`` counts every layer; ``sliding_layers`` of them use a window and
    take the sliding shape (defaulting to the global one). Sliding layers are
    spread Gemma-style, with the global ones last in each run.
    """
    if layers < 1:
        raise GeometryError("layers must be at least 1")
    if not 0 <= sliding_layers <= layers:
        raise GeometryError("sliding layers must be between 0 and the number of layers")
    global_layers = layers - sliding_layers
    types: list[LayerType] = []
    if global_layers:
        types.append(LayerType(AttentionKind.GLOBAL, kv_heads, head_dim))
    if sliding_layers:
        if sliding_window is None:
            raise GeometryError("sliding layers need --sliding-window")
        types.append(
            LayerType(
                AttentionKind.SLIDING,
                sliding_kv_heads or kv_heads,
                sliding_head_dim or head_dim,
                sliding_window,
            )
        )
    kinds = _spread(layers, global_layers)
    return KVGeometry(name, kinds, tuple(types), canonical_dtype(dtype))


def _spread(layers: int, global_layers: int) -> tuple[AttentionKind, ...]:
    if global_layers == 0:
        return (AttentionKind.SLIDING,) * layers
    # Place global layer j at the end of the j-th of `global_layers` equal runs.
    global_at = {((j + 1) * layers) // global_layers - 1 for j in range(global_layers)}
    return tuple(
        AttentionKind.GLOBAL if i in global_at else AttentionKind.SLIDING for i in range(layers)
    )


def _gemma3(name: str, layers: int, kv_heads: int, head_dim: int, window: int) -> KVGeometry:
    return KVGeometry(
        name,
        interleaved_kinds(layers, 6),
        (
            LayerType(AttentionKind.GLOBAL, kv_heads, head_dim),
            LayerType(AttentionKind.SLIDING, kv_heads, head_dim, window),
        ),
    )


PRESETS: dict[str, KVGeometry] = {
    "gemma3-270m": _gemma3("gemma3-270m", 18, 1, 256, 512),
    "gemma3-1b": _gemma3("gemma3-1b", 26, 1, 256, 512),
    "gemma3-4b": _gemma3("gemma3-4b", 34, 4, 256, 1024),
    "gemma3-12b": _gemma3("gemma3-12b", 48, 8, 256, 1024),
    "gemma3-27b": _gemma3("gemma3-27b", 62, 16, 128, 1024),
    # The seed's figures: 8 global layers at head_dim 512 cost 128 KiB/token,
    # 40 sliding layers at head_dim 256 cost 320 KiB/token (bf16, 8 KV heads).
    "gemma4-12b": KVGeometry(
        "gemma4-12b",
        interleaved_kinds(48, 6),
        (
            LayerType(AttentionKind.GLOBAL, 8, 512),
            LayerType(AttentionKind.SLIDING, 8, 256, 1024),
        ),
    ),
    # Its config.json's text part: 60 layers, every sixth global; global
    # layers 4 KV heads of 512 (K and V from one projection, both cached),
    # sliding layers 16 of 256 with a 1,024-token window.
    "gemma4-31b": KVGeometry(
        "gemma4-31b",
        interleaved_kinds(60, 6),
        (
            LayerType(AttentionKind.GLOBAL, 4, 512),
            LayerType(AttentionKind.SLIDING, 16, 256, 1024),
        ),
    ),
}


def preset(name: str) -> KVGeometry:
    """Look a preset up by name; the error lists the known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        known = ", ".join(sorted(PRESETS))
        raise GeometryError(f"unknown model preset {name!r} (known: {known})") from None
