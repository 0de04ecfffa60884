"""Before serving: the model loaded, the pool sized, the scheduler built with
the configured (or persisted) tenants and prefixes (kvd/server/scheduling.py),
every shape compiled and the cost model calibrated. The daemon runs ``load``
in a worker thread."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import jax

from kvd.engine import compile_cache, onednn, qdense
from kvd.engine.engine import Engine, EngineConfig
from kvd.engine.loader import LoadedModel, load_model, random_model_with_tokenizer
from kvd.kv.layout import build_layout
from kvd.server import coordination
from kvd.server.config import Config, ConfigError
from kvd.server.scheduling import Loaded, build_scheduler, config_prefixes
from kvd.server.state import LiveState, from_config
from kvd.units import parse_size

# On a CPU the pool shares RAM with everything else on the host: "auto" takes
# at most this much there (vLLM's CPU backend defaults its KV space to 4 GiB).
CPU_AUTO_POOL_MAX = 4 << 30


def _auto_pool_bytes(weights: int, fraction: float) -> int:
    """The pool "auto" sizes once ``weights`` bytes of weights are placed:
    ``fraction`` of free device memory less the weights, or on CPU of the
    available RAM (where the loaded weights already are: placing them moves
    them), within the service's memory limit and ``CPU_AUTO_POOL_MAX``."""
    import jax

    device = jax.devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and "bytes_limit" in stats:
        free = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)) - weights
        return int(max(0, free) * fraction)
    free = min(_host_available(), _cgroup_room())
    return min(int(free * fraction), CPU_AUTO_POOL_MAX)


def _host_available() -> int:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    raise ConfigError("pool.size = 'auto' cannot find the free memory here: give a size")


def _cgroup_room() -> int:
    """Memory left under this process's cgroup limits (systemd's MemoryMax=),
    the tightest of its cgroup and their ancestors, v2 or v1; page cache
    that could be dropped (inactive files) does not count as used."""
    room = 1 << 62  # no limit found
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return room
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one unified hierarchy
            root, limit_file, usage_file = "/sys/fs/cgroup", "memory.max", "memory.current"
        elif "memory" in controllers.split(","):  # v1: the memory controller's own
            root = "/sys/fs/cgroup/memory"
            limit_file, usage_file = "memory.limit_in_bytes", "memory.usage_in_bytes"
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):
            directory = os.path.join(root, *parts[:depth])
            limit = _read_int(os.path.join(directory, limit_file))
            usage = _read_int(os.path.join(directory, usage_file))
            if limit is None or usage is None:
                continue
            usage -= _inactive_file(os.path.join(directory, "memory.stat"))
            room = min(room, max(0, limit - usage))
    return room


def _read_int(path: str) -> int | None:
    """An integer file of the cgroup tree; None if absent or "max"."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _inactive_file(stat_path: str) -> int:
    try:
        with open(stat_path) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key in ("inactive_file", "total_inactive_file"):
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _pool_tokens(config: Config, model: LoadedModel) -> tuple[int, int]:
    """(pool tokens per page group, page bytes) for the configured pool size."""
    kv_dtype = config.model.kv_dtype or config.model.dtype
    layout = build_layout(model.config.kv_geometry(kv_dtype), config.pool.block_size)
    if config.pool.size == "auto":
        weight_bytes = model.weight_bytes
        if _onednn_copies(config):  # the engine's bf16 copies of the matrices
            weight_bytes += onednn.copy_bytes(model.params)
        if _one_row_twins(config):  # and its one-token twins of the int8 ones
            weight_bytes += qdense.one_row_twin_bytes(model.params)
        budget = _auto_pool_bytes(weight_bytes, config.pool.auto_fraction)
    else:
        budget = parse_size(config.pool.size)
    tokens = layout.pool_tokens(budget)
    if tokens < 1:
        raise ConfigError(
            f"pool: {budget} bytes hold no block of {layout.num_groups} pages "
            f"of {layout.page_bytes} bytes"
        )
    return tokens, layout.page_bytes


def _onednn_copies(config: Config) -> bool:
    """Whether the engine will keep oneDNN copies of the weights (as
    ``Engine`` decides for ``model.matmul``)."""
    if config.model.matmul == "xla":
        return False
    single = config.model.tensor_parallel == 1 and config.distributed is None
    return onednn.unavailable_reason(jax.default_backend(), single) is None


def _one_row_twins(config: Config) -> bool:
    """Whether the engine will keep one-token twins of int8 matrices (as
    ``Engine`` decides)."""
    single = config.model.tensor_parallel == 1 and config.distributed is None
    return qdense.keeps_one_row_twins(jax.default_backend(), single, scan_layers=False)


def build_engine(
    config: Config, progress: Callable[[str, dict[str, Any]], None]
) -> tuple[Engine, LoadedModel, int]:
    """The model loaded and the engine built (not yet compiled): (engine,
    model, page bytes). Every process of a multi-host set builds the same
    one; the pool's size is the leader's (``kvd.server.coordination.agree``),
    since "auto" measures each host's own memory."""
    cfg = config.model
    progress("lifecycle.loading", {"source": cfg.source, "dtype": cfg.dtype})
    if cfg.source == "random":
        model = random_model_with_tokenizer(
            max_position=max(cfg.max_model_len, 256), quantization=cfg.quantization
        )
    else:
        source = cfg.source
        if "/" in source or source.endswith(".gguf"):
            source = str(config.path(source))
        model = load_model(source, cfg.dtype, cfg.quantization)
    pool_tokens, page_bytes = _pool_tokens(config, model)
    if config.distributed is not None:
        coordination.agree_on_config(config)
        pool_tokens = int(coordination.agree("pool_tokens", str(pool_tokens)))
    # Compiled programs kept on disk: a restart reads them instead of compiling.
    compile_cache.enable_default()
    engine = Engine(
        model,
        EngineConfig(
            dtype=cfg.dtype,
            kv_dtype=cfg.kv_dtype,
            block_size=config.pool.block_size,
            max_model_len=cfg.max_model_len,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            pool_tokens=pool_tokens,
            tensor_parallel=cfg.tensor_parallel,
            attention=cfg.attention,
            matmul=cfg.matmul,
        ),
    )
    progress(
        "lifecycle.pool",
        {
            "pages": engine.num_pages - 1,  # the null page holds nothing
            "page_bytes": page_bytes,
            "tokens_per_group": pool_tokens,
            "weight_bytes": model.weight_bytes,
            "quantization": model.quantization,
            "matmul": engine.matmul,
            "one_row_twin_bytes": engine.one_row_twin_bytes,
            "quantization_error": round(model.quantization_error, 6),
            **engine.bytes_here(),
        },
    )
    return engine, model, page_bytes


def warm_fields(engine: Engine, seconds: float) -> dict[str, Any]:
    """``lifecycle.warm``'s fields, a leader's and a follower's alike."""
    return {
        "seconds": round(seconds, 2),
        "programs": engine.compiled_shapes(),
        "huge_page_bytes": engine.huge_page_bytes,
    }


def load(
    config: Config,
    progress: Callable[[str, dict[str, Any]], None],
    saved: LiveState | None = None,
) -> Loaded:
    """Everything before serving; runs in a worker thread. ``saved`` (the
    persisted admin state) overrides the config's tenants, budget mode,
    sharing policy and public prefixes."""
    engine, model, page_bytes = build_engine(config, progress)
    pool_pages = engine.num_pages - 1
    live = saved or from_config(
        config, config_prefixes(config, model.tokenizer, model.config.vocab_size)
    )
    if saved is not None:
        progress("lifecycle.state_restored", {"tenants": [t.name for t in saved.tenants]})
    # Budgets and prefixes are checked against the real pool before the long
    # warm-up, so a configuration the pool cannot honour fails in seconds.
    scheduler = build_scheduler(config, engine, live, page_bytes)
    last = [0.0]

    def warm(done: int, total: int, what: str) -> None:
        now = time.monotonic()
        if done == total or now - last[0] >= 1.0:
            last[0] = now
            progress("lifecycle.warmup", {"done": done, "total": total, "compiling": what})

    seconds = engine.warm_up(warm)
    progress("lifecycle.warm", warm_fields(engine, seconds))
    # On a scratch KV manager of its own: the calibration's prompts are nobody's.
    progress("lifecycle.calibrating", {"what": "the prefill and copy rates"})
    rates = scheduler.calibrate()
    progress(
        "lifecycle.calibrated",
        {
            "prefill_tokens_per_s": round(rates.prefill_tokens_per_s, 1),
            "copy_bytes_per_s": round(rates.copy_bytes_per_s),
            "crossover_tokens": rates.crossover_tokens(),
        },
    )
    return Loaded(
        scheduler,
        model.tokenizer,
        model.config.vocab_size,
        pool_pages,
        page_bytes,
        live,
        model.weight_bytes,
        model.quantization,
        stop_followers=_stopper(engine) if engine.lockstep is not None else None,
        bytes_here=engine.bytes_here(),
    )


def _stopper(engine: Engine) -> Callable[[], None]:
    """The leader's last device call: every follower stops (and the watch no
    longer reports them as lost)."""

    def stop() -> None:
        coordination.ending()
        engine.stop_followers()

    return stop
