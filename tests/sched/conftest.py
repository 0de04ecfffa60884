"""A tiny random-weight Gemma 3 behind the real engine: fast to compile, and
deterministic, which is all the scheduler tests need from a model."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from collections.abc import Callable

import pytest

from kvd.engine.config import ModelConfig
from kvd.engine.engine import Engine, EngineConfig
from kvd.engine.loader import LoadedModel
from kvd.engine.weights import random_params
from kvd.kv.geometry import interleaved_kinds

TINY = ModelConfig(
    name="tiny-sched",
    family="gemma3",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
    layer_kinds=interleaved_kinds(6, 3),
    sliding_window=16,
    max_position=256,
    query_pre_attn_scalar=16.0,
)


def tiny_model(seed: int = 0) -> LoadedModel:
    return LoadedModel(TINY, random_params(TINY, seed), None, "random", 0.0)  # type: ignore[arg-type]


ENGINE = EngineConfig(
    block_size=4,
    max_model_len=128,
    max_num_seqs=8,
    max_num_batched_tokens=32,
    pool_tokens=256,
)

MakeEngine = Callable[..., Engine]


@pytest.fixture(scope="session")
def make_engine() -> MakeEngine:
    """Engines on one model share compiled programs through the persistent cache."""
    model = tiny_model()

    def make(**overrides: object) -> Engine:
        import msgspec

        engine = Engine(model, msgspec.structs.replace(ENGINE, **overrides))
        engine.warm_up()
        return engine

    return make
