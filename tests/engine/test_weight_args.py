"""Compiled programs are handed only the weights they read (weight_args):
the dispatch of a call checks every leaf it is given."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from kvd.engine.engine import Engine, EngineConfig  # noqa: E402
from kvd.engine.loader import random_model  # noqa: E402
from kvd.engine.weight_args import WeightsJit  # noqa: E402


@jax.jit
def _layer(layer: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    # A nested call given the whole layer, of which it reads one weight.
    return x * layer["used"]


def _model_fn(params: dict[str, object], x: jax.Array, *, twice: bool) -> jax.Array:
    for layer in params["layers"]:  # type: ignore[attr-defined]
        x = _layer(layer, x)
    y = x + params["bias"]  # type: ignore[operator]
    return y * 2 if twice else y


def _params(scale: float) -> dict[str, object]:
    layers = [
        {"used": jnp.full(3, scale * (i + 1)), "unused": jnp.full((4, 4), 7.0)} for i in range(3)
    ]
    return {"layers": layers, "bias": jnp.arange(3.0), "spare": jnp.ones(5)}


def test_a_program_takes_only_the_leaves_its_result_depends_on() -> None:
    params = _params(1.0)
    x = jnp.ones(3)
    program = WeightsJit(_model_fn, static_argnames=("twice",)).compile(params, x, twice=True)
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    read = {jax.tree_util.keystr(leaves[i][0]) for i in program.reads}
    assert read == {"['bias']", *(f"['layers'][{i}]['used']" for i in range(3))}
    expected = jax.jit(_model_fn, static_argnames=("twice",))(params, x, twice=True)
    np.testing.assert_allclose(program(params, x), expected)


def test_a_new_weight_tree_is_read_anew() -> None:
    x = jnp.ones(3)
    program = WeightsJit(_model_fn, static_argnames=("twice",)).compile(
        _params(1.0), x, twice=False
    )
    np.testing.assert_allclose(program(_params(1.0), x), [6.0, 7.0, 8.0])
    np.testing.assert_allclose(program(_params(2.0), x), [48.0, 49.0, 50.0])


def test_the_engines_head_is_handed_the_embedding_alone() -> None:
    """The head reads the tied embedding (the final norm runs in the decoder
    step); the decoder reads the layers."""
    model = random_model(vocab_size=96, sliding_window=12, seed=5)
    config = EngineConfig(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16)
    engine = Engine(model, config)
    leaves = jax.tree_util.tree_flatten_with_path(engine.params)[0]
    paths = [jax.tree_util.keystr(path) for path, _ in leaves]
    head = engine._head_program(1)
    body = engine._body_program(1, engine.block_buckets[-1])
    assert head.reads and all(paths[i].startswith("['embed']") for i in head.reads)
    assert any(paths[i].startswith("['layers']") for i in body.reads)
    assert not any(paths[i].startswith("['layers']") for i in head.reads)
