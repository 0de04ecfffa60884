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
    torch.manual_seed(seed)
    hf = transformers.Gemma3ForCausalLM(hf_cfg).eval()
    with torch.no_grad():  # norms start at zero: make (1 + w) matter
        for name, param in hf.named_parameters():
            if "norm" in name:
                param.copy_(torch.randn_like(param) * 0.3)
            else:
                param.copy_(torch.randn_like(param) * 0.08)
    cfg = from_hf_config(hf_cfg.to_dict(), name="tiny-gemma3")
    state = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    return TinyModel(hf, cfg, params_from_hf(cfg, state, np.float32))


@pytest.fixture(scope="session")
def tiny3() -> TinyModel:
    return tiny_gemma3()


def hf_logits(model: TinyModel, tokens: list[int]) -> np.ndarray[Any, Any]:
    with torch.no_grad():
        out = model.hf(torch.tensor([tokens]), use_cache=False)
    return out.logits[0].float().numpy()
