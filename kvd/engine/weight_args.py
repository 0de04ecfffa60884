"""Compiled programs that are given only the weights they read.

A jitted call checks and hands over every leaf of its arguments in C++, about
a microsecond each. The 270M's int8 weights with their one-row twins and
oneDNN handles are 814 leaves: a step's decoder program took 1.0-1.2 ms to
dispatch and its head 0.6 ms, though the head reads four of them and the
decoder at one row never reads the oneDNN forms (the dev config, batch 1,
2026-12-06). On this machine's two cores that dispatch runs beside the step
before it and slows it; on an accelerator it is host time per step.

So each program is traced once with the whole weight tree to find which
leaves it reads, then compiled taking those alone, as a flat list (a list
is also cheaper to check than nested dicts). Weights stay jit arguments.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def read_inputs(jaxpr: Any, count: int) -> tuple[int, ...]:
    """The indices among the first ``count`` inputs of ``jaxpr`` (a Jaxpr)
    that its outputs depend on: dead-code elimination through nested calls
    (a layer is its own jitted call, given the whole layer's weights). With a
    JAX whose elimination is not where this looks, the inputs any equation
    or output refers to at the top."""
    try:
        from jax._src.interpreters.partial_eval import dce_jaxpr

        _, used = dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))
        return tuple(i for i in range(count) if used[i])
    except (ImportError, TypeError, AttributeError):
        referred = {id(v) for eqn in jaxpr.eqns for v in eqn.invars}
        referred |= {id(v) for v in jaxpr.outvars}
        return tuple(i for i, var in enumerate(jaxpr.invars[:count]) if id(var) in referred)


class WeightProgram:
    """A compiled program called as ``program(params, *args)``: it passes on
    only the leaves of ``params`` it reads (gathered once per weight tree)."""

    __slots__ = ("compiled", "reads", "_params", "_weights")

    def __init__(self, compiled: Any, reads: tuple[int, ...]) -> None:
        self.compiled = compiled
        self.reads = reads  # indices into the weight tree's leaves
        self._params: Any = None
        self._weights: list[Any] = []

    def __call__(self, params: Any, *args: Any) -> Any:
        if params is not self._params:
            leaves = jax.tree_util.tree_leaves(params)
            self._weights = [leaves[i] for i in self.reads]
            self._params = params
        return self.compiled(self._weights, *args)

    def __getattr__(self, name: str) -> Any:  # as_text, memory_analysis, ...
        return getattr(self.compiled, name)


class WeightsJit:
    """``jax.jit(fn, **options)`` for a ``fn(params, *args, **static)`` whose
    programs take only the weights each reads (``compile``)."""

    def __init__(self, fn: Any, **options: Any) -> None:
        self._fn = fn
        self._options = options

    def compile(self, params: Any, *args: Any, **static: Any) -> WeightProgram:
        leaves, tree = jax.tree_util.tree_flatten(params)
        traced = jax.jit(self._fn, **self._options).trace(params, *args, **static)
        reads = read_inputs(traced.jaxpr.jaxpr, len(leaves))
        kept = set(reads)
        fn = self._fn

        def reading(weights: list[Any], *rest: Any, **statics: Any) -> Any:
            given = iter(weights)
            # A leaf the program never reads is a constant it never uses.
            whole = [
                next(given) if i in kept else jnp.zeros(jnp.shape(leaf), jnp.result_type(leaf))
                for i, leaf in enumerate(leaves)
            ]
            return fn(jax.tree_util.tree_unflatten(tree, whole), *rest, **statics)

        weights = [leaves[i] for i in reads]
        compiled = jax.jit(reading, **self._options).lower(weights, *args, **static).compile()
        return WeightProgram(compiled, reads)
