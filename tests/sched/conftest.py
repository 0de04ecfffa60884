"""A tiny random-weight Gemma 3 behind the real engine: fast to compile, and
deterministic, which is all the scheduler tests need from a model."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from collections.abc import Callable

import pytest

from kvd.engine.engine import Engine, EngineConfig
from kvd.engine.loader import LoadedModel, random_model


def tiny_model(seed: int = 0) -> LoadedModel:
    return random_model(vocab_size=64, sliding_window=16, seed=seed)


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
