"""Tensor parallelism over the chips of one host, with jax.sharding.

A 1-D mesh with one axis, ``model``. Megatron-style splits, expressed as
shardings of the weights and left to XLA's SPMD partitioner:
- attention: Q columns split by head, O rows split the same way (one
  all-reduce after O); K and V split by KV head when the KV heads divide
  evenly over the devices, otherwise replicated (every device computes the
  few KV heads it needs; Gemma 3 270M has one);
- MLP: gate and up split by column, down by row (one all-reduce);
- embeddings, norms and the (tied) LM head replicated.

The KV pool follows the K/V split: when the KV heads divide evenly (and all
page groups share one head shape), the pool is stored ``[pages, rest, K*H]``
and split on its last axis, so every device keeps its own KV heads of every
page and the pool's memory is divided by the device count. Otherwise (fewer
KV heads than devices: Gemma 3 270M has one; or Gemma 4's mixed head
shapes) it is replicated and every device writes the same K/V. Page ids,
tables and swaps are the single-device engine's either way.

Several hosts: ``jax.distributed.initialize()`` on every host of a slice
makes ``jax.devices()`` span all chips, and the same mesh shards across
hosts. Host 0 owns the HTTP API, the scheduler and the KV manager, and sends
each step's host inputs to the other hosts (``kvd.engine.lockstep``), which
run the same compiled programs; sampled tokens are read from the replicated
output on host 0. Admission, budgets and the pool bookkeeping stay on host
0, so the KV core needs no distribution of its own.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kvd.engine.config import ModelConfig
from kvd.engine.wquant import QuantWeight, block_size

AXIS = "model"


class ShardingError(ValueError):
    pass


def check_processes(devices: int) -> None:
    """Under several processes (``jax.distributed``) the model spans every
    device of every process: a mesh over some of them would leave a process
    with nothing to run, or split one process's devices between meshes."""
    processes = jax.process_count()
    if processes > 1 and devices != jax.device_count():
        raise ShardingError(
            f"tensor_parallel {devices} must equal the {jax.device_count()} devices of the "
            f"{processes} processes ({jax.local_device_count()} each)"
        )


def make_mesh(devices: int) -> Mesh:
    available = jax.devices()
    if devices > len(available):
        raise ShardingError(
            f"tensor_parallel {devices} needs {devices} devices; this host has {len(available)}"
        )
    return Mesh(np.array(available[:devices]), (AXIS,))


def check_divisible(config: ModelConfig, devices: int) -> None:
    if config.num_heads % devices:
        raise ShardingError(
            f"{config.num_heads} attention heads do not split over {devices} devices"
        )
    if config.intermediate_size % devices:
        raise ShardingError(
            f"MLP width {config.intermediate_size} does not split over {devices} devices"
        )


def check_weight_blocks(params: dict[str, Any], devices: int) -> None:
    """int8 weights split along their blocks (``o`` and ``down``, by rows)
    must split on block boundaries: each device dequantises its own rows."""
    layers = params.get("layers") or [params.get("stack", {})]
    for layer in layers:
        for name in ("o", "down"):
            weight = layer.get(name)
            if isinstance(weight, QuantWeight):
                rows, size = weight.values.shape[-2], block_size(weight)
                if rows % devices or (rows // devices) % size:
                    raise ShardingError(
                        f"int8 weight {name} ({rows} rows in blocks of {size}) does not "
                        f"split over {devices} devices on block boundaries"
                    )


def _layer_spec(name: str, kv_heads: int, devices: int) -> P:
    if name in ("q", "gate", "up"):
        return P(None, AXIS)
    if name in ("o", "down"):
        return P(AXIS, None)
    if name in ("k", "v"):
        return P(None, AXIS) if kv_heads % devices == 0 else P()
    return P()  # norms and scalars


def param_shardings(config: ModelConfig, params: dict[str, Any], mesh: Mesh) -> Any:
    """A NamedSharding per leaf of the parameter pytree: per-layer dicts under
    "layers", or the layer-stacked form of ``prepare_params`` under "stack".
    An int8 weight's values, scales and offsets share its sharding (a prefix
    of its subtree): the scales' axes are the values' axes, in blocks."""
    devices = mesh.devices.size
    out: dict[str, Any] = {
        key: NamedSharding(mesh, P()) for key in params if key not in ("layers", "stack")
    }
    if "layers" in params:
        out["layers"] = [
            {
                name: NamedSharding(
                    mesh,
                    _layer_spec(name, config.kv_heads_of(config.layer_kinds[i]), devices),
                )
                for name in layer
            }
            for i, layer in enumerate(params["layers"])
        ]
    if "stack" in params:  # uniform models: every layer has the same shapes
        kv = config.kv_heads_of(config.layer_kinds[0])
        out["stack"] = {
            name: NamedSharding(mesh, P(None, *_layer_spec(name, kv, devices)))
            for name in params["stack"]
        }
    return out


def pool_layout(
    config: ModelConfig,
    shape: tuple[int, ...],
    devices: int,
    mesh: Mesh,
    scale_elements: int = 0,
) -> tuple[tuple[int, ...], NamedSharding]:
    """The pool's array shape and sharding. A page holds ``[places, 2, L, K, H]``
    per layer group; when every group has the same (K, H) and the KV heads
    split evenly, the pool is stored ``[P, rest, K*H]`` and split on its last
    axis, so each device holds its own KV heads of every page (the K/V
    projections are split the same way: the writes stay local). Otherwise
    it is replicated. ``scale_elements``: what each (token, KV head) row
    stores after its head_dim values (an int8 pool's scale), split with it."""
    kinds = set(config.layer_kinds)
    heads = {(config.kv_heads_of(k), config.head_dim_of(k)) for k in kinds}
    if len(heads) == 1:
        ((kv, head_dim),) = heads
        if kv % devices == 0:
            pages, elements = shape
            lane = kv * (head_dim + scale_elements)
            return (pages, elements // lane, lane), NamedSharding(mesh, P(None, None, AXIS))
    return shape, NamedSharding(mesh, P())


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())
