"""Tiny random-weight Gemma models, in transformers (the oracle) and in kvd."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvd.engine.config import ModelConfig, from_hf_config  # noqa: E402
from kvd.engine.weights import params_from_hf  # noqa: E402

S, G = "sliding_attention", "full_attention"


@dataclass
class TinyModel:
    hf: Any
    config: ModelConfig
    params: dict[str, Any]


def tiny_gemma3(seed: int = 0, window: int = 8, kv_heads: int = 2, head_dim: int = 32) -> TinyModel:
    hf_cfg = transformers.Gemma3TextConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=7,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        sliding_window=window,
        query_pre_attn_scalar=head_dim,
        layer_types=[S, S, G, S, S, S, G],
        rope_parameters={
            S: {"rope_type": "default", "rope_theta": 10_000.0},
            G: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
        },
        max_position_embeddings=256,
        attn_implementation="eager",
    )
    hf = transformers.Gemma3ForCausalLM(hf_cfg).eval()
    _randomise(hf, seed, norm_center=0.0)  # Gemma 3 norms scale by (1 + w)
    cfg = from_hf_config(hf_cfg.to_dict(), name="tiny-gemma3")
    state = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    return TinyModel(hf, cfg, params_from_hf(cfg, state, np.float32))


def _randomise(hf: Any, seed: int, norm_center: float) -> None:
    """Random weights, norms around ``norm_center`` (their init is constant, which
    would hide a wrong norm formula), layer scalars away from 1."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "norm" in name:
                param.copy_(norm_center + torch.randn_like(param) * 0.3)
            else:
                param.copy_(torch.randn_like(param) * 0.06)
        for name, buffer in hf.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.copy_(0.5 + torch.rand_like(buffer))


def tiny_gemma4(seed: int = 0, k_eq_v: bool = True) -> TinyModel:
    """Global layers with head_dim 32 (twice the sliding 16) and their own KV
    head count, partial RoPE, V norm, layer scalars, final soft-cap."""
    hf_cfg = transformers.Gemma4TextConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        num_global_key_value_heads=2 if k_eq_v else None,
        attention_k_eq_v=k_eq_v,
        sliding_window=8,
        layer_types=[S, S, G, S, S, G],
        final_logit_softcapping=30.0,
        hidden_size_per_layer_input=0,
        max_position_embeddings=256,
        attn_implementation="eager",
    )
    hf = transformers.Gemma4ForCausalLM(hf_cfg).eval()
    _randomise(hf, seed, norm_center=1.0)  # Gemma 4 norms scale by w
    cfg = from_hf_config(hf_cfg.to_dict(), name="tiny-gemma4")
    state = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    return TinyModel(hf, cfg, params_from_hf(cfg, state, np.float32))


@pytest.fixture(scope="session")
def tiny3() -> TinyModel:
    return tiny_gemma3()


@pytest.fixture(scope="session")
def tiny4() -> TinyModel:
    return tiny_gemma4(k_eq_v=True)


@pytest.fixture(scope="session")
def tiny4_separate_v() -> TinyModel:
    return tiny_gemma4(seed=1, k_eq_v=False)


def hf_logits(model: TinyModel, tokens: list[int]) -> np.ndarray[Any, Any]:
    with torch.no_grad():
        out = model.hf(torch.tensor([tokens]), use_cache=False)
    return out.logits[0].float().numpy()
