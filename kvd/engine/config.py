"""Gemma text model configurations: presets, and the checkpoint's own config.

One frozen, hashable struct describes every architectural choice the forward
pass makes, so the jitted step can take it as a static argument. Gemma 3 and
Gemma 4 differ in the fields documented below (see shared/notes/MODELS.md).
"""

from __future__ import annotations

import math
from typing import Any, Literal

import msgspec

from kvd.kv.geometry import AttentionKind, KVGeometry, LayerType, canonical_dtype, interleaved_kinds

# The attention implementations an engine may ask for (kvd/engine/attention.py).
ATTENTION_CHOICES = ("auto", "reference", "pallas", "pallas-interpret")
# The matrix products (model.matmul; kvd/engine/onednn.py).
MATMUL_CHOICES = ("auto", "xla", "onednn")


class EngineDefaults:
    """The engine's defaults, defined once: ``EngineConfig`` and the daemon's
    ``[model]`` and ``[pool]`` sections both take them (this module imports
    no JAX, so the daemon's configuration can)."""

    DTYPE = "float32"
    BLOCK_SIZE = 16
    MAX_MODEL_LEN = 4096
    MAX_NUM_SEQS = 32
    MAX_NUM_BATCHED_TOKENS = 512
    TENSOR_PARALLEL = 1
    ATTENTION = "auto"


class ModelConfigError(ValueError):
    """A model configuration that kvd cannot run; the message names the field."""


class ModelConfig(msgspec.Struct, frozen=True):
    name: str
    family: Literal["gemma3", "gemma4"]
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int  # sliding layers (and all layers of Gemma 3)
    head_dim: int
    layer_kinds: tuple[AttentionKind, ...]
    sliding_window: int
    max_position: int
    global_num_kv_heads: int | None = None  # Gemma 4 global layers; None = num_kv_heads
    global_head_dim: int | None = None  # Gemma 4 global layers: 512; None = head_dim
    rope_local_theta: float = 10_000.0
    rope_global_theta: float = 1_000_000.0
    rope_global_scale: float = 1.0  # linear position scaling on global layers (4B/12B/27B: 8)
    rope_global_partial: float = 1.0  # Gemma 4: fraction of rotary pairs that rotate
    query_pre_attn_scalar: float | None = None  # softmax scale 1/sqrt(this); None = scale 1.0
    rms_eps: float = 1e-6
    final_logit_softcap: float | None = None
    attn_logit_softcap: float | None = None
    k_eq_v_global: bool = False  # Gemma 4: one projection feeds K and V on global layers
    value_norm: bool = False  # Gemma 4: scale-free RMS norm on V
    layer_scalar: bool = False  # Gemma 4: block output times a learned scalar
    bos_id: int = 2
    eos_id: int = 1
    pad_id: int = 0

    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    def kv_heads_of(self, kind: AttentionKind) -> int:
        if kind is AttentionKind.GLOBAL and self.global_num_kv_heads is not None:
            return self.global_num_kv_heads
        return self.num_kv_heads

    def head_dim_of(self, kind: AttentionKind) -> int:
        if kind is AttentionKind.GLOBAL and self.global_head_dim is not None:
            return self.global_head_dim
        return self.head_dim

    @property
    def query_scale(self) -> float:
        if self.query_pre_attn_scalar is None:
            return 1.0
        return 1.0 / math.sqrt(self.query_pre_attn_scalar)

    def kv_geometry(self, dtype: str) -> KVGeometry:
        kinds = sorted(set(self.layer_kinds), key=lambda k: k is AttentionKind.SLIDING)
        types = tuple(
            LayerType(
                kind,
                self.kv_heads_of(kind),
                self.head_dim_of(kind),
                self.sliding_window if kind is AttentionKind.SLIDING else None,
            )
            for kind in kinds
        )
        return KVGeometry(self.name, self.layer_kinds, types, canonical_dtype(dtype))


def _gemma3(
    name: str,
    *,
    layers: int,
    hidden: int,
    ffn: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    window: int,
    scalar: float,
    rope_scale: float,
    max_position: int,
) -> ModelConfig:
    return ModelConfig(
        name=name,
        family="gemma3",
        vocab_size=262_144,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        layer_kinds=interleaved_kinds(layers, 6),
        sliding_window=window,
        max_position=max_position,
        rope_global_scale=rope_scale,
        query_pre_attn_scalar=scalar,
    )


PRESETS: dict[str, ModelConfig] = {
    "gemma3-270m": _gemma3(
        "gemma3-270m", layers=18, hidden=640, ffn=2048, heads=4, kv_heads=1, head_dim=256,
        window=512, scalar=256, rope_scale=1.0, max_position=32_768,
    ),
    "gemma3-1b": _gemma3(
        "gemma3-1b", layers=26, hidden=1152, ffn=6912, heads=4, kv_heads=1, head_dim=256,
        window=512, scalar=256, rope_scale=1.0, max_position=32_768,
    ),
    "gemma3-4b": _gemma3(
        "gemma3-4b", layers=34, hidden=2560, ffn=10240, heads=8, kv_heads=4, head_dim=256,
        window=1024, scalar=256, rope_scale=8.0, max_position=131_072,
    ),
    "gemma3-12b": _gemma3(
        "gemma3-12b", layers=48, hidden=3840, ffn=15360, heads=16, kv_heads=8, head_dim=256,
        window=1024, scalar=256, rope_scale=8.0, max_position=131_072,
    ),
    "gemma3-27b": _gemma3(
        "gemma3-27b", layers=62, hidden=5376, ffn=21504, heads=32, kv_heads=16, head_dim=128,
        window=1024, scalar=168, rope_scale=8.0, max_position=131_072,
    ),
}  # fmt: skip


def from_hf_config(raw: dict[str, Any], name: str = "checkpoint") -> ModelConfig:
    """A ModelConfig from a Hugging Face ``config.json`` (Gemma 3 or Gemma 4 text)."""
    text = raw.get("text_config", raw)
    model_type = text.get("model_type", "")
    try:
        if model_type in ("gemma3_text", "gemma3"):
            return _gemma3_from_hf(text, name)
        if model_type in ("gemma4_text", "gemma4"):
            return _gemma4_from_hf(text, name)
    except KeyError as exc:
        raise ModelConfigError(f"config.json lacks {exc.args[0]!r}") from None
    raise ModelConfigError(
        f"unsupported model_type {model_type!r} (kvd runs gemma3_text, gemma4_text)"
    )


def _layer_kinds(text: dict[str, Any]) -> tuple[AttentionKind, ...]:
    layers = int(text["num_hidden_layers"])
    layer_types = text.get("layer_types") or [
        "sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(layers)
    ]
    return tuple(
        AttentionKind.SLIDING if t == "sliding_attention" else AttentionKind.GLOBAL
        for t in layer_types
    )


def _common(text: dict[str, Any], name: str) -> dict[str, Any]:
    return {
        "name": name,
        "vocab_size": int(text["vocab_size"]),
        "hidden_size": int(text["hidden_size"]),
        "intermediate_size": int(text["intermediate_size"]),
        "num_heads": int(text["num_attention_heads"]),
        "num_kv_heads": int(text["num_key_value_heads"]),
        "head_dim": int(text["head_dim"]),
        "layer_kinds": _layer_kinds(text),
        "sliding_window": int(text["sliding_window"]),
        "max_position": int(text.get("max_position_embeddings", 131_072)),
        "rms_eps": float(text.get("rms_norm_eps", 1e-6)),
        "final_logit_softcap": text.get("final_logit_softcapping"),
        "bos_id": int(text.get("bos_token_id", 2) or 2),
        "eos_id": _first(text.get("eos_token_id", 1)),
        "pad_id": int(text.get("pad_token_id", 0) or 0),
    }


def _gemma3_from_hf(text: dict[str, Any], name: str) -> ModelConfig:
    rope = text.get("rope_parameters") or {}
    full_rope = rope.get("full_attention", {})
    local_rope = rope.get("sliding_attention", {})
    scaling = text.get("rope_scaling") or {}
    return ModelConfig(
        family="gemma3",
        rope_local_theta=float(
            local_rope.get("rope_theta", text.get("rope_local_base_freq", 10_000.0))
        ),
        rope_global_theta=float(full_rope.get("rope_theta", text.get("rope_theta", 1e6))),
        rope_global_scale=float(full_rope.get("factor", scaling.get("factor", 1.0)) or 1.0),
        query_pre_attn_scalar=float(text.get("query_pre_attn_scalar", text["head_dim"])),
        attn_logit_softcap=text.get("attn_logit_softcapping"),
        **_common(text, name),
    )


_GEMMA4_UNSUPPORTED = {
    "hidden_size_per_layer_input": "per-layer embeddings",
    "num_kv_shared_layers": "KV sharing between layers",
    "enable_moe_block": "mixture-of-experts blocks",
    "use_double_wide_mlp": "double-wide MLPs",
    "use_bidirectional_attention": "bidirectional attention",
}


def _gemma4_from_hf(text: dict[str, Any], name: str) -> ModelConfig:
    for key, what in _GEMMA4_UNSUPPORTED.items():
        if text.get(key):
            raise ModelConfigError(
                f"this Gemma 4 checkpoint uses {what} ({key}), which kvd does not run"
            )
    rope = text.get("rope_parameters") or {}
    full_rope = rope.get("full_attention", {})
    local_rope = rope.get("sliding_attention", {})
    common = _common(text, name)
    overrides = [
        dict(v)
        for k, v in (text.get("per_layer_config") or {}).items()
        if common["layer_kinds"][int(k)] is AttentionKind.GLOBAL
    ]
    global_head_dim = int(text.get("global_head_dim", 512))
    global_kv = None
    if overrides:
        global_head_dim = int(overrides[0].get("head_dim", global_head_dim))
        if "num_key_value_heads" in overrides[0]:
            global_kv = int(overrides[0]["num_key_value_heads"])
    return ModelConfig(
        family="gemma4",
        global_head_dim=global_head_dim,
        global_num_kv_heads=global_kv,
        rope_local_theta=float(local_rope.get("rope_theta", 10_000.0)),
        rope_global_theta=float(full_rope.get("rope_theta", 1_000_000.0)),
        rope_global_scale=float(full_rope.get("factor", 1.0) or 1.0),
        rope_global_partial=float(full_rope.get("partial_rotary_factor", 1.0)),
        query_pre_attn_scalar=None,
        k_eq_v_global=bool(text.get("attention_k_eq_v", False)),
        value_norm=True,
        layer_scalar=True,
        **common,
    )


def _first(value: int | list[int]) -> int:
    return int(value[0] if isinstance(value, list) else value)
