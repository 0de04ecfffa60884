"""nano-vllm's scheduler as the host-overhead anchor, timed in the same run.

nano-vllm (github GeeeekExplorer/nano-vllm) keeps its scheduler and block
manager in pure Python, with nothing kvd has to account for: no tenants, no
layer groups, 256-token blocks. What it spends per decode step is therefore
the floor a Python scheduler can reach. Its engine pulls in torch and
transformers at import; the three modules timed here need neither (their
``Config`` is only read for five numbers), so they are loaded from a checkout
by path, with ``xxhash`` (which nano-vllm's block hashes use) installed.

The workload (``../shared/notes/PERF.md``): R sequences in steady decode, each
a 256-token shared prefix and 256 unique tokens, 128 new tokens, finished ones
replaced; a step is ``schedule()`` + ``postprocess()``.
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

PREFIX_TOKENS = 256
UNIQUE_TOKENS = 256
NEW_TOKENS = 128
BLOCK_SIZE = 256
EOS = -1  # no sampled token ends a sequence early: each runs its 128 tokens


class AnchorUnavailable(Exception):
    """The checkout or its one dependency is missing: said in one line."""


@dataclass(slots=True)
class _Config:  # what nano-vllm's Scheduler reads of its Config
    max_num_seqs: int
    max_num_batched_tokens: int
    eos: int
    kvcache_block_size: int
    num_kvcache_blocks: int


def load(checkout: Path) -> types.SimpleNamespace:
    """nano-vllm's sequence, block manager and scheduler modules, from a
    checkout (the directory holding ``nanovllm/``)."""
    engine = checkout / "nanovllm" / "engine"
    if not (engine / "scheduler.py").is_file():
        raise AnchorUnavailable(f"{checkout} holds no nanovllm/engine/scheduler.py")
    if importlib.util.find_spec("xxhash") is None:
        raise AnchorUnavailable("nano-vllm's block manager needs xxhash: pip install xxhash")
    # Its package __init__ imports the model runner (torch); the timed modules
    # import only each other, its sampling params and the Config class.
    package = types.ModuleType("nanovllm")
    package.__path__ = [str(checkout / "nanovllm")]
    sys.modules.setdefault("nanovllm", package)
    sub = types.ModuleType("nanovllm.engine")
    sub.__path__ = [str(engine)]
    sys.modules.setdefault("nanovllm.engine", sub)
    config = types.ModuleType("nanovllm.config")
    config.Config = _Config  # type: ignore[attr-defined]
    sys.modules.setdefault("nanovllm.config", config)
    modules = {}
    for name, path in (
        ("nanovllm.sampling_params", checkout / "nanovllm" / "sampling_params.py"),
        ("nanovllm.engine.sequence", engine / "sequence.py"),
        ("nanovllm.engine.block_manager", engine / "block_manager.py"),
        ("nanovllm.engine.scheduler", engine / "scheduler.py"),
    ):
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        modules[name.rsplit(".", 1)[-1]] = module
    return types.SimpleNamespace(**modules)


def overhead_ms(
    nano: types.SimpleNamespace,
    running: int,
    steps: int,
    between: Callable[[], object] | None = None,
) -> tuple[float, float]:
    """(p50, mean) milliseconds of nano-vllm's host work per decode step with
    ``running`` sequences (``nano``: its modules, from ``load``). ``between``,
    if given, runs before each timed step, untimed: a device step, so that
    nano-vllm's scheduler meets the caches as a real step loop leaves them
    (a model step streams its weights and KV through them)."""
    nano.sequence.Sequence.block_size = BLOCK_SIZE
    per_seq = -(-(PREFIX_TOKENS + UNIQUE_TOKENS + NEW_TOKENS) // BLOCK_SIZE)
    scheduler = nano.scheduler.Scheduler(
        _Config(running, 16384, EOS, BLOCK_SIZE, running * per_seq + 16)
    )
    rng = np.random.default_rng(running)
    prefix = rng.integers(0, 32000, PREFIX_TOKENS).tolist()
    params = nano.sampling_params.SamplingParams(
        temperature=1.0, max_tokens=NEW_TOKENS, ignore_eos=True
    )

    def submit() -> None:
        unique = rng.integers(0, 32000, UNIQUE_TOKENS).tolist()
        scheduler.add(nano.sequence.Sequence(prefix + unique, params))

    def step() -> bool:
        seqs, is_prefill = scheduler.schedule()
        token_ids = rng.integers(0, 32000, len(seqs)).tolist()  # what a model would sample
        scheduler.postprocess(seqs, token_ids, is_prefill)
        for _ in range(sum(seq.is_finished for seq in seqs)):
            submit()
        return bool(is_prefill)

    for _ in range(running):
        submit()
    while scheduler.waiting:  # their prefills; only decode steps are timed
        step()
    times: list[float] = []
    while len(times) < steps:
        if between is not None:
            between()
        start = time.perf_counter()
        prefill = step()
        elapsed = time.perf_counter() - start
        if not prefill:
            times.append(elapsed)
    return statistics.median(times) * 1e3, statistics.fmean(times) * 1e3
