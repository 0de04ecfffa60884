"""Checkpoints into one parameter pytree: GGUF files and Hugging Face directories.

Layout of the pytree (numpy until placed on a device; x @ W convention):
    embed [V, D], final_norm [D],
    layers[i]: attn_norm, post_attn_norm, pre_ffn_norm, post_ffn_norm [D];
               q [D, N*H], k [D, K*H], v [D, K*H], o [N*H, D], q_norm, k_norm [H];
               gate, up [D, F], down [F, D]
Norm weights are stored as the direct multiplier: Gemma 3's checkpoints hold
``w`` for ``x * (1 + w)`` (GGUF files already hold ``1 + w``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from kvd.engine.config import ModelConfig, ModelConfigError, from_hf_config
from kvd.engine.gguf import GGUFError, GGUFFile
from kvd.engine.wquant import (
    HF_BLOCK,
    QUANTISED_TYPES,
    QUANTIZATIONS,
    QuantWeight,
    common_form,
    from_gguf,
    quantize_absmax,
    regrouped,
    relative_error,
    transposed,
)
from kvd.kv.geometry import AttentionKind, interleaved_kinds


class WeightsError(ValueError):
    """A checkpoint that does not fit its model; the message names the tensor."""


_LAYER_FIELDS: dict[str, tuple[str, str | None, bool, bool]] = {
    # kvd name: (HF suffix, GGUF suffix, transpose, is_norm)
    "attn_norm": ("input_layernorm.weight", "attn_norm.weight", False, True),
    "post_attn_norm": (
        "post_attention_layernorm.weight",
        "post_attention_norm.weight",
        False,
        True,
    ),
    "pre_ffn_norm": ("pre_feedforward_layernorm.weight", "ffn_norm.weight", False, True),
    "post_ffn_norm": ("post_feedforward_layernorm.weight", "post_ffw_norm.weight", False, True),
    "q": ("self_attn.q_proj.weight", "attn_q.weight", True, False),
    "k": ("self_attn.k_proj.weight", "attn_k.weight", True, False),
    "v": ("self_attn.v_proj.weight", "attn_v.weight", True, False),
    "o": ("self_attn.o_proj.weight", "attn_output.weight", True, False),
    "q_norm": ("self_attn.q_norm.weight", "attn_q_norm.weight", False, True),
    "k_norm": ("self_attn.k_norm.weight", "attn_k_norm.weight", False, True),
    "gate": ("mlp.gate_proj.weight", "ffn_gate.weight", True, False),
    "up": ("mlp.up_proj.weight", "ffn_up.weight", True, False),
    "down": ("mlp.down_proj.weight", "ffn_down.weight", True, False),
    "layer_scalar": ("layer_scalar", None, False, False),  # no GGUF spelling: gemma3 GGUFs only
}


_HF, _GGUF = 0, 1  # spelling styles: index into _LAYER_FIELDS and _TOP_FIELDS
_TOP_FIELDS = {
    "embed": ("embed_tokens.weight", "token_embd.weight"),
    "final_norm": ("norm.weight", "output_norm.weight"),
}


def checkpoint_name(path: str, style: int) -> str | None:
    """The checkpoint's name for a pytree path ("embed", "layers.3.q", ...) in a
    spelling style; None where that format has no such tensor."""
    if path in _TOP_FIELDS:
        return _TOP_FIELDS[path][style]
    _, index, field = path.split(".")
    suffix = _LAYER_FIELDS[field][style]
    if suffix is None:
        return None
    return f"{'layers' if style == _HF else 'blk'}.{index}.{suffix}"


def expected_shapes(cfg: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """The tensors layer ``layer`` needs; Gemma 4's k_eq_v global layers have no V
    projection (K's projection feeds both), and Gemma 4 layers carry a scalar."""
    kind = cfg.layer_kinds[layer]
    d, f = cfg.hidden_size, cfg.intermediate_size
    h, kv = cfg.head_dim_of(kind), cfg.kv_heads_of(kind)
    shapes = {
        "attn_norm": (d,),
        "post_attn_norm": (d,),
        "pre_ffn_norm": (d,),
        "post_ffn_norm": (d,),
        "q": (d, cfg.num_heads * h),
        "k": (d, kv * h),
        "v": (d, kv * h),
        "o": (cfg.num_heads * h, d),
        "q_norm": (h,),
        "k_norm": (h,),
        "gate": (d, f),
        "up": (d, f),
        "down": (f, d),
    }
    if cfg.k_eq_v_global and kind is AttentionKind.GLOBAL:
        del shapes["v"]
    if cfg.layer_scalar:
        shapes["layer_scalar"] = (1,)
    return shapes


def random_params(cfg: ModelConfig, seed: int = 0) -> dict[str, Any]:
    """Random weights of the right shapes (f32): for tests and benchmarks of
    everything around the model, where any deterministic model will do."""
    rng = np.random.default_rng(seed)
    layers = []
    for layer in range(cfg.num_layers):
        params = {}
        for name, shape in expected_shapes(cfg, layer).items():
            if "norm" in name or name == "layer_scalar":
                params[name] = (1.0 + rng.standard_normal(shape) * 0.3).astype(np.float32)
            else:
                params[name] = (rng.standard_normal(shape) * 0.3 / np.sqrt(shape[0])).astype(
                    np.float32
                )
        layers.append(params)
    embed = rng.standard_normal((cfg.vocab_size, cfg.hidden_size)).astype(np.float32)
    return {"embed": embed, "final_norm": np.ones(cfg.hidden_size, np.float32), "layers": layers}


def quantised_params(
    params: dict[str, Any], errors: dict[str, float] | None = None
) -> dict[str, Any]:
    """A float pytree (``_build``'s layout) with its matrices as int8, absmax
    per block along the contracting axis (for the random model, and tests)."""
    layers = []
    for i, layer in enumerate(params["layers"]):
        out = {}
        for field, array in layer.items():
            _, _, transpose, is_norm = _LAYER_FIELDS[field]
            if is_norm or np.ndim(array) != 2:
                out[field] = array
                continue
            stored = np.asarray(array).T if transpose else np.asarray(array)
            weight = _quantised(f"layers.{i}.{field}", stored, errors)
            out[field] = transposed(weight) if transpose else weight
        layers.append(out)
    embed = _quantised("embed", np.asarray(params["embed"]), errors)
    return {**params, "embed": embed, "layers": layers}


def _check(name: str, array: np.ndarray[Any, Any], shape: tuple[int, ...]) -> None:
    if array.shape != shape:
        raise WeightsError(f"tensor {name} has shape {array.shape}, the model needs {shape}")


def _build(
    cfg: ModelConfig,
    fetch: Callable[[str, bool], np.ndarray[Any, Any]],
    norm_offset: float,
    dtype: Any,
    fetch_quantised: Callable[[str], QuantWeight] | None = None,
) -> dict[str, Any]:
    """Assemble the pytree; ``fetch(kvd_path, is_hf_norm)`` returns float32
    arrays. With ``fetch_quantised`` (int8 weights), the embedding and every
    layer matrix come from it instead, as stored (``[out, in]``, blocks along
    ``in``); norms stay floats."""

    def cast(array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        return np.ascontiguousarray(array, dtype=dtype)

    def matrix(path: str, transpose: bool, shape: tuple[int, ...]) -> Any:
        if fetch_quantised is None:
            array = fetch(path, False)
            array = array.T if transpose else array
            _check(path, array, shape)
            return cast(array)
        weight = fetch_quantised(path)
        weight = transposed(weight) if transpose else weight
        _check(path, weight.values, shape)
        return weight

    embed = matrix("embed", False, (cfg.vocab_size, cfg.hidden_size))
    final_norm = fetch("final_norm", True) + norm_offset
    _check("final_norm", final_norm, (cfg.hidden_size,))
    layers = []
    for i in range(cfg.num_layers):
        shapes = expected_shapes(cfg, i)
        layer = {}
        for field in shapes:
            _, _, transpose, is_norm = _LAYER_FIELDS[field]
            path = f"layers.{i}.{field}"
            if not is_norm and len(shapes[field]) == 2:
                layer[field] = matrix(path, transpose, shapes[field])
                continue
            array = fetch(path, is_norm)
            if is_norm:
                array = array + norm_offset
            _check(path, array, shapes[field])
            layer[field] = cast(array)
        layers.append(layer)
    if fetch_quantised is not None:
        _one_form_per_field(layers)
    return {"embed": embed, "final_norm": cast(final_norm), "layers": layers}


def _one_form_per_field(layers: list[dict[str, Any]]) -> None:
    """Give each field one block size and offset choice in every layer (exactly:
    finer blocks repeat the scales, a zero offset subtracts nothing), so that
    stacked layers are one array; a GGUF may store a field in two formats
    across layers (the 270M's ``down``: Q6_K in some, Q4_K in others)."""
    for field in layers[0]:
        weights = [layer[field] for layer in layers if isinstance(layer.get(field), QuantWeight)]
        if not weights:
            continue
        size, with_offset = common_form(weights)
        for layer in layers:
            if isinstance(layer.get(field), QuantWeight):
                layer[field] = regrouped(layer[field], size, with_offset)


# -- Hugging Face layout ----------------------------------------------------------

_HF_PREFIXES = ("model.language_model.", "language_model.model.", "model.")


def params_from_hf(
    cfg: ModelConfig,
    tensors: Mapping[str, Any],
    dtype: Any,
    quantization: str = "none",
    errors: dict[str, float] | None = None,
) -> dict[str, Any]:
    """Parameters from Hugging Face tensor names (Gemma 3 text); ``tensors`` maps
    names to numpy arrays (or anything ``np.asarray`` accepts). ``"int8"``
    quantises each matrix as it is read (never the whole model in f32 at
    once), its relative error put in ``errors``."""
    stripped: dict[str, str] = {}  # a name without its prefix: the name (looked up when fetched)
    for name in tensors:
        for prefix in _HF_PREFIXES:
            if name.startswith(prefix):
                stripped[name[len(prefix) :]] = name
                break

    def fetch(path: str, _norm: bool) -> np.ndarray[Any, Any]:
        hf = checkpoint_name(path, _HF)
        if hf is None or hf not in stripped:
            raise WeightsError(f"checkpoint has no tensor for {hf or path!r}")
        return np.asarray(tensors[stripped[hf]], dtype=np.float32)

    def fetch_quantised(path: str) -> QuantWeight:
        return _quantised(path, fetch(path, False), errors)

    # Gemma 3 checkpoints hold w for x * (1 + w); Gemma 4 multiplies by w itself.
    offset = 1.0 if cfg.family == "gemma3" else 0.0
    return _build(cfg, fetch, offset, dtype, fetch_quantised if _wants_int8(quantization) else None)


def load_hf_directory(
    path: Path, dtype: Any, quantization: str = "none", errors: dict[str, float] | None = None
) -> tuple[ModelConfig, dict[str, Any]]:
    """A checkpoint directory: config.json and one or more *.safetensors files."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise WeightsError(f"{path}: no config.json")
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise WeightsError(f"{config_file}: not valid JSON ({exc})") from None
    cfg = from_hf_config(raw, name=path.name)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"{path}: no *.safetensors files")
    tensors: Mapping[str, Any] = _merged([read_safetensors(file) for file in files])
    return cfg, params_from_hf(cfg, tensors, dtype, quantization, errors)


_SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


def _merged(files: list[Mapping[str, Any]]) -> Mapping[str, Any]:
    """One mapping over several files' tensors, none of them read yet."""
    owner = {name: tensors for tensors in files for name in tensors}
    return {name: _Deferred(tensors, name) for name, tensors in owner.items()}


class _Deferred:
    """One tensor of a file, read when ``np.asarray`` asks for it."""

    def __init__(self, tensors: Mapping[str, Any], name: str) -> None:
        self._tensors, self._name = tensors, name

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray[Any, Any]:
        return np.asarray(self._tensors[self._name], dtype=dtype)


class _Tensors(Mapping[str, np.ndarray[Any, Any]]):
    """A file's tensors by name, each a float array when looked up (bf16
    widened to f32 then): a whole bf16 checkpoint is never held in f32 at once."""

    def __init__(self, stored: dict[str, np.ndarray[Any, Any]], bf16: set[str]) -> None:
        self._stored, self._bf16 = stored, bf16

    def __getitem__(self, name: str) -> np.ndarray[Any, Any]:
        array = self._stored[name]
        if name in self._bf16:
            return (array.astype(np.uint32) << 16).view(np.float32)
        return array

    def __iter__(self) -> Iterator[str]:
        return iter(self._stored)

    def __len__(self) -> int:
        return len(self._stored)


def read_safetensors(file: Path) -> Mapping[str, np.ndarray[Any, Any]]:
    """Tensors of one .safetensors file as float arrays (bf16 widened to f32
    when a tensor is looked up).

    The format is an 8-byte header length, a JSON header, then raw data; it is
    read over mmap so only the tensors used are paged in.
    """
    import mmap
    import struct

    try:
        with open(file, "rb") as handle:
            data = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as exc:
        raise WeightsError(f"{file}: cannot read ({exc})") from None
    try:
        (header_len,) = struct.unpack_from("<Q", data, 0)
        header = json.loads(data[8 : 8 + header_len])
    except (struct.error, json.JSONDecodeError, UnicodeDecodeError):
        raise WeightsError(f"{file}: not a safetensors file (bad header)") from None
    base = 8 + header_len
    out: dict[str, np.ndarray[Any, Any]] = {}
    bf16: set[str] = set()
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _SAFETENSORS_DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise WeightsError(f"{file}: tensor {name} has unsupported dtype {info.get('dtype')}")
        start, end = info["data_offsets"]
        if base + end > len(data):
            raise WeightsError(f"{file}: truncated: tensor {name} runs past the end of the file")
        array = np.frombuffer(data, dtype, (end - start) // np.dtype(dtype).itemsize, base + start)
        if info["dtype"] == "BF16":
            bf16.add(name)
        out[name] = array.reshape(info["shape"])
    return _Tensors(out, bf16)


# -- GGUF --------------------------------------------------------------------------


def config_from_gguf(gguf: GGUFFile, name: str) -> ModelConfig:
    """A Gemma 3 config from GGUF metadata; what the file lacks (the local RoPE
    base, the layer pattern, the query scale) comes from Gemma 3's definition."""
    meta = gguf.metadata
    arch = meta.get("general.architecture")
    if arch != "gemma3":
        raise ModelConfigError(f"{gguf.path}: architecture {arch!r} is not supported (gemma3 is)")
    try:
        layers = int(meta["gemma3.block_count"])
        head_dim = int(meta["gemma3.attention.key_length"])
        vocab = len(meta["tokenizer.ggml.tokens"])
        return ModelConfig(
            name=name,
            family="gemma3",
            vocab_size=vocab,
            hidden_size=int(meta["gemma3.embedding_length"]),
            intermediate_size=int(meta["gemma3.feed_forward_length"]),
            num_heads=int(meta["gemma3.attention.head_count"]),
            num_kv_heads=int(meta["gemma3.attention.head_count_kv"]),
            head_dim=head_dim,
            layer_kinds=interleaved_kinds(layers, 6),
            sliding_window=int(meta["gemma3.attention.sliding_window"]),
            max_position=int(meta.get("gemma3.context_length", 32_768)),
            rope_global_theta=float(meta.get("gemma3.rope.freq_base", 1e6)),
            rope_global_scale=float(meta.get("gemma3.rope.scaling.factor", 1.0)),
            query_pre_attn_scalar=float(head_dim),
            rms_eps=float(meta.get("gemma3.attention.layer_norm_rms_epsilon", 1e-6)),
            bos_id=int(meta.get("tokenizer.ggml.bos_token_id", 2)),
            eos_id=int(meta.get("tokenizer.ggml.eos_token_id", 1)),
            pad_id=int(meta.get("tokenizer.ggml.padding_token_id", 0)),
        )
    except KeyError as exc:
        raise ModelConfigError(f"{gguf.path}: metadata lacks {exc.args[0]!r}") from None


def params_from_gguf(
    cfg: ModelConfig,
    gguf: GGUFFile,
    dtype: Any,
    quantization: str = "none",
    errors: dict[str, float] | None = None,
) -> dict[str, Any]:
    """Parameters from a GGUF file. ``quantization="int8"``: matrices stored
    in a block format keep their blocks (exactly, ``kvd.engine.wquant``);
    float matrices are quantised, their relative error put in ``errors``."""

    def tensor_name(path: str) -> str:
        name = checkpoint_name(path, _GGUF)
        if name is None:
            raise WeightsError(f"GGUF files have no tensor for {path}")
        return name

    def fetch(path: str, _norm: bool) -> np.ndarray[Any, Any]:
        try:
            return gguf.load(tensor_name(path), np.float32)
        except GGUFError as exc:
            raise WeightsError(str(exc)) from None

    def fetch_quantised(path: str) -> QuantWeight:
        name = tensor_name(path)
        try:
            info = gguf.tensor(name)
            if info.type_id in QUANTISED_TYPES and len(info.shape) == 2:
                return from_gguf(gguf.raw(name), info.type_id, (info.shape[0], info.shape[1]))
            return _quantised(path, gguf.load(name, np.float32), errors)
        except GGUFError as exc:
            raise WeightsError(str(exc)) from None

    return _build(cfg, fetch, 0.0, dtype, fetch_quantised if _wants_int8(quantization) else None)


def _wants_int8(quantization: str) -> bool:
    if quantization not in QUANTIZATIONS or quantization == "auto":
        raise WeightsError(f"quantization {quantization!r}: use none or int8")
    return quantization == "int8"


def gguf_quantization(gguf: GGUFFile, quantization: str, backend: str = "cpu") -> str:
    """``quantization`` with "auto" resolved for JAX's ``backend``: on the CPU,
    int8 when every matrix of the file is stored in a block format
    (re-encoded exactly), else none. On an accelerator, none: there the
    weights' bytes are not what a step waits on, and int8 measured slower
    than bf16 weights (an H200, ``kvd bench weights --dtype bfloat16``: 0.78x
    to 0.97x from one token to a 512-token prefill), so int8 is a choice made
    for the pool's room, not the default."""
    if quantization != "auto":
        return quantization
    if backend != "cpu":
        return "none"
    matrices = [info for info in gguf.tensors.values() if len(info.shape) == 2]
    exact = bool(matrices) and all(info.type_id in QUANTISED_TYPES for info in matrices)
    return "int8" if exact else "none"


def _quantised(
    path: str, matrix: np.ndarray[Any, Any], errors: dict[str, float] | None
) -> QuantWeight:
    """A float matrix (``[out, in]``) quantised per block along ``in``."""
    if matrix.ndim != 2 or matrix.shape[1] % HF_BLOCK:
        raise WeightsError(
            f"tensor {path} has shape {matrix.shape}: int8 weights need rows of a "
            f"multiple of {HF_BLOCK} values"
        )
    weight = quantize_absmax(matrix)
    if errors is not None:
        errors[path] = relative_error(matrix, weight)
    return weight
