"""``kvd serve``: one trio process that owns the device, the engine and the
scheduler, and serves tenants over HTTP.

Lifecycle:
1. Bind the listener at once (``/health`` answers, ``/ready`` says loading).
2. In a worker thread: load the weights, size the pool, compile every shape
   bucket (progress logged), measure the recompute and swap rates, apply
   tenants and public prefixes. Then the engine task starts and ``/ready``
   turns 200.
3. SIGTERM/SIGINT: drain. New requests get 503; in-flight ones have
   ``drain_timeout`` seconds to finish; what is left is aborted (its pages
   released), the listener closes and the process exits 0. A second signal
   exits at once (1). A hard deadline (``drain_timeout + hard_deadline``)
   exits even if a client that stopped reading holds a connection open:
   hypercorn's send cannot be cancelled, so only leaving the process ends it.
"""

from __future__ import annotations

import os
import signal
import socket
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve

from kvd import __version__
from kvd.engine.engine import Engine, EngineConfig
from kvd.engine.loader import LoadedModel, load_model, random_model_with_tokenizer
from kvd.kv.layout import build_layout
from kvd.kv.ledger import BudgetMode
from kvd.sched.costmodel import measure_rates
from kvd.sched.ratelimit import RateLimits
from kvd.sched.scheduler import Scheduler, SchedulerConfig, TenantConfig
from kvd.server import systemd
from kvd.server.admin import Admin, create_admin_app
from kvd.server.config import (
    Config,
    ConfigError,
    body_limit,
    pages_of,
    parse_listen,
    read_token_file,
    socket_mode,
)
from kvd.server.http import ServerState, TenantAccess, create_app, create_metrics_app
from kvd.server.metrics import Metrics
from kvd.server.runtime import Runtime
from kvd.server.state import (
    LiveState,
    PrefixTokens,
    StateError,
    StateStore,
    from_config,
    overridden,
)

log = structlog.get_logger("kvd")

TCP_USER_TIMEOUT_MS = 30_000  # unacknowledged data this long drops the connection


@dataclass
class Loaded:
    scheduler: Scheduler
    model: LoadedModel
    pool_pages: int
    page_bytes: int
    live: LiveState  # what the admin API changes, as applied


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
    from kvd.units import parse_size

    kv_dtype = config.model.kv_dtype or config.model.dtype
    layout = build_layout(model.config.kv_geometry(kv_dtype), config.pool.block_size)
    if config.pool.size == "auto":
        import jax

        weights = sum(int(leaf.nbytes) for leaf in jax.tree_util.tree_leaves(model.params))
        budget = _auto_pool_bytes(weights, config.pool.auto_fraction)
    else:
        budget = parse_size(config.pool.size)
    tokens = layout.pool_tokens(budget)
    if tokens < 1:
        raise ConfigError(
            f"pool: {budget} bytes hold no block of {layout.num_groups} pages "
            f"of {layout.page_bytes} bytes"
        )
    return tokens, layout.page_bytes


def load(
    config: Config,
    progress: Callable[[str, dict[str, Any]], None],
    saved: LiveState | None = None,
) -> Loaded:
    """Everything before serving; runs in a worker thread. ``saved`` (the
    persisted admin state) overrides the config's tenants, budget mode,
    sharing policy and public prefixes."""
    cfg = config.model
    progress("lifecycle.loading", {"source": cfg.source, "dtype": cfg.dtype})
    if cfg.source == "random":
        model = random_model_with_tokenizer(max_position=max(cfg.max_model_len, 256))
    else:
        source = cfg.source
        if "/" in source or source.endswith(".gguf"):
            source = str(config.path(source))
        model = load_model(source, cfg.dtype)
    pool_tokens, page_bytes = _pool_tokens(config, model)
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
        ),
    )
    pool_pages = engine.kv.pool.capacity
    progress(
        "lifecycle.pool",
        {"pages": pool_pages, "page_bytes": page_bytes, "tokens_per_group": pool_tokens},
    )
    live = saved or from_config(config, config_prefixes(config, model))
    if saved is not None:
        progress("lifecycle.state_restored", {"tenants": [t.name for t in saved.tenants]})
    scheduler = Scheduler(
        engine,
        SchedulerConfig(
            tiers=tuple(config.tiers),
            mode=live.mode,
            policy=live.policy,
            preemption=config.budget.preemption,
        ),
    )
    # Budgets and prefixes are checked against the real pool before the long
    # warm-up, so a configuration the pool cannot honour fails in seconds.
    for prefix in live.prefixes:
        try:
            scheduler.kv.add_public_prefix(prefix.name, prefix.tokens)
        except ValueError as exc:
            raise ConfigError(f"prefixes.{prefix.name}: {exc}") from None
    for entry in live.tenants:
        scheduler.set_tenant(tenant_config(config, entry, page_bytes, pool_pages))
    last = [0.0]

    def warm(done: int, total: int, what: str) -> None:
        now = time.monotonic()
        if done == total or now - last[0] >= 1.0:
            last[0] = now
            progress("lifecycle.warmup", {"done": done, "total": total, "compiling": what})

    seconds = engine.warm_up(warm)
    progress("lifecycle.warm", {"seconds": round(seconds, 2), "programs": engine.compiled_shapes()})
    # Calibrate as the engine's own tenant, outside every budget, before anyone's work.
    engine.kv.set_mode(BudgetMode.FREE)
    rates = measure_rates(engine)
    engine.kv.set_mode(live.mode)
    # The calibration's prompts are nobody's: forget their pages and counts.
    engine.kv.flush_cache()
    engine.kv.prefix_query_tokens = engine.kv.prefix_hit_tokens = 0
    engine.kv.remove_tenant(Engine.TENANT)
    scheduler.rates = rates
    progress(
        "lifecycle.calibrated",
        {
            "prefill_tokens_per_s": round(rates.prefill_tokens_per_s, 1),
            "copy_bytes_per_s": round(rates.copy_bytes_per_s),
            "crossover_tokens": rates.crossover_tokens(),
        },
    )
    return Loaded(scheduler, model, pool_pages, page_bytes, live)


def tenant_config(config: Config, entry: Any, page_bytes: int, pool_pages: int) -> TenantConfig:
    where = f"tenants.{entry.name}"
    reservation = pages_of(f"{where}.reservation", entry.reservation, page_bytes, pool_pages)
    cap = None
    if entry.burst_cap is not None:
        cap = pages_of(f"{where}.burst_cap", entry.burst_cap, page_bytes, pool_pages)
    return TenantConfig(
        name=entry.name,
        reservation_pages=reservation,
        cap_pages=cap,
        tier=entry.tier or config.tiers[0],
        weight=entry.weight,
        limits=RateLimits(entry.requests_per_minute, entry.tokens_per_minute),
        max_queue=entry.max_queue,
    )


def config_prefixes(config: Config, model: LoadedModel) -> list[PrefixTokens]:
    """The config's public prefixes as token ids (text is tokenized like a prompt)."""
    out = []
    for prefix in config.prefixes:
        if prefix.text is not None:
            tokens = model.tokenizer.encode(prefix.text)
        elif prefix.chat_system is not None:
            tokens = model.tokenizer.chat_system_prefix(prefix.chat_system)
        else:
            assert prefix.token_file is not None
            tokens = read_token_file(config.path(prefix.token_file))
        vocab = model.config.vocab_size
        if any(not 0 <= t < vocab for t in tokens):
            raise ConfigError(f"prefixes.{prefix.name}: token ids outside the vocabulary")
        out.append(PrefixTokens(prefix.name, tokens))
    return out


class _Hypercorn(HypercornConfig):
    """Listening sockets with TCP_USER_TIMEOUT (inherited by accepted
    connections), so a peer that vanished cannot pin a connection forever;
    a Unix socket gets its mode (bound under a umask, so it is never more
    open than asked) and its group."""

    socket_mode: int | None = None
    socket_group: str | None = None

    def create_sockets(self) -> Any:
        if self.socket_mode is not None:
            self.umask = 0o777 & ~self.socket_mode
        sockets = super().create_sockets()
        for sock in sockets.insecure_sockets:
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, TCP_USER_TIMEOUT_MS)
            elif sock.family == socket.AF_UNIX:
                path = sock.getsockname()
                if self.socket_group is not None:
                    os.chown(path, -1, _group_id(self.socket_group))
                if self.socket_mode is not None:
                    os.chmod(path, self.socket_mode)
        return sockets


def _group_id(name: str) -> int:
    import grp

    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise ConfigError(f"server.admin_group: no group {name!r}") from None


def prepare_socket_path(path: Path) -> None:
    """Make the socket's directory; remove a stale socket a dead daemon left,
    but never one a live daemon still answers on."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() and not path.is_symlink():
        return
    if not stat.S_ISSOCK(path.lstat().st_mode):
        raise ConfigError(f"{path}: exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except ConnectionRefusedError:
        path.unlink()  # nobody listens: left behind by a crash
        return
    except OSError:
        return
    finally:
        probe.close()
    raise ConfigError(f"{path}: another daemon is listening on this admin socket")


class Daemon:
    def __init__(self, config: Config, *, listen: str | None = None) -> None:
        self.config = config
        self.listen = listen or config.server.listen
        parse_listen(self.listen)
        self.runtime: Runtime | None = None
        self.state = ServerState(
            runtime=None,
            tokenizer=None,
            model_name=config.served_model,
            vocab_size=0,
            max_model_len=config.model.max_model_len,
            tiers=tuple(config.tiers),
            metrics=Metrics(lambda: self.runtime),
            keys={
                t.api_key_sha256: TenantAccess(t.name, t.tier or config.tiers[0])
                for t in config.tenants
            },
            log_prompts=config.server.log_prompts,
            queue_timeout=config.server.queue_timeout,
            status="loading",
        )
        self.store = StateStore(config.path(config.server.state_file))
        self.admin_socket = config.path(config.server.admin_socket)
        self.admin = Admin(config, self.state, self.store, describe_device)
        self._stop = trio.Event()  # first signal: drain, then stop
        self._http_stopped = trio.Event()  # hypercorn's shutdown trigger
        self._load_scope = trio.CancelScope()
        self.signals = 0
        self.clean = False  # every request ended and its pages were released

    async def run(self) -> int:
        """Serve until a signal; returns the exit status."""
        config = self.config
        log.info("lifecycle.start", version=__version__, pid=os.getpid(), model=config.served_model)
        saved = self.store.load()  # a corrupt state file stops the start here
        if saved is not None:
            differs = overridden(config, saved)
            self.admin.restored = {"file": str(self.store.path), "overrides": differs}
            # The file wins over the config (it holds the admin changes made
            # live): an operator who edited the config must hear of it.
            (log.warning if differs else log.info)(
                "lifecycle.state_restored",
                path=str(self.store.path),
                overrides=differs,
                hint="the state file's settings replace these config sections; "
                "apply edits with kvctl, or remove the file to start from the config"
                if differs
                else None,
            )
        async with trio.open_nursery() as nursery:  # signals, watchdog, the engine task
            nursery.start_soon(self._watch_signals)
            nursery.start_soon(systemd.watchdog, self._alive)
            async with trio.open_nursery() as http:
                await self._start_http(http)
                await self._start_admin(http)
                systemd.notify("STATUS=loading the model and compiling")
                loaded = None
                with self._load_scope:
                    loaded = await trio.to_thread.run_sync(
                        lambda: load(config, _log_progress, saved), abandon_on_cancel=True
                    )
                if loaded is not None and not self._stop.is_set():
                    self._go_live(nursery, loaded)
                    await self._stop.wait()
                    await self._drain()
                else:
                    self.clean = True  # stopped while loading: nothing to drain
                self._http_stopped.set()
            nursery.cancel_scope.cancel()
        self.admin_socket.unlink(missing_ok=True)
        self._report_stopped()
        return 0

    async def _start_http(self, nursery: trio.Nursery) -> None:
        hconfig = _Hypercorn()
        hconfig.bind = [self.listen]
        hconfig.accesslog = None
        hconfig.graceful_timeout = 1.0  # the drain has already waited for requests
        hconfig.keep_alive_timeout = 30.0
        app = create_app(self.state, max_body=body_limit(self.config))

        async def serve(task_status: trio.TaskStatus[list[str]]) -> None:
            await hypercorn_serve(
                app, hconfig, shutdown_trigger=self._http_stopped.wait, task_status=task_status
            )

        bound = await nursery.start(serve)
        log.info("lifecycle.listening", addresses=bound)

        mconfig = _Hypercorn()
        mconfig.bind = [self.config.server.metrics_listen]
        mconfig.accesslog = None
        mconfig.graceful_timeout = 1.0
        metrics_app = create_metrics_app(self.state.metrics)

        async def serve_metrics(task_status: trio.TaskStatus[list[str]]) -> None:
            await hypercorn_serve(
                metrics_app,
                mconfig,
                shutdown_trigger=self._http_stopped.wait,
                task_status=task_status,
            )

        bound = await nursery.start(serve_metrics)
        log.info("lifecycle.metrics_listening", addresses=bound)

    async def _start_admin(self, nursery: trio.Nursery) -> None:
        """The admin API on its Unix socket (a separate app: one app served
        twice would run its start-up hooks twice)."""
        prepare_socket_path(self.admin_socket)
        hconfig = _Hypercorn()
        hconfig.bind = [f"unix:{self.admin_socket}"]
        hconfig.accesslog = None
        hconfig.graceful_timeout = 1.0
        hconfig.socket_mode = socket_mode(self.config)
        hconfig.socket_group = self.config.server.admin_group
        app = create_admin_app(self.admin)

        async def serve(task_status: trio.TaskStatus[list[str]]) -> None:
            await hypercorn_serve(
                app, hconfig, shutdown_trigger=self._http_stopped.wait, task_status=task_status
            )

        await nursery.start(serve)
        log.info("lifecycle.admin_socket", path=str(self.admin_socket))

    def _go_live(self, nursery: trio.Nursery, loaded: Loaded) -> None:
        runtime = Runtime(
            loaded.scheduler,
            step_log_interval=self.config.server.step_log_interval,
            max_in_flight=self.config.server.max_in_flight,
        )
        self.runtime = runtime
        state = self.state
        runtime.latency_sink = state.metrics.observe_latencies
        state.runtime = runtime
        self.admin.live = loaded.live
        # The keys of the tenants in force (the state file's, after a restart).
        state.keys.clear()
        state.keys.update(
            {
                t.api_key_sha256: TenantAccess(t.name, t.tier or self.config.tiers[0])
                for t in loaded.live.tenants
            }
        )
        state.tokenizer = loaded.model.tokenizer
        state.vocab_size = loaded.model.config.vocab_size
        nursery.start_soon(runtime.run)
        state.ready = True
        state.status = "ready"
        tenants = {
            t.name: {"reservation_pages": t.reservation_pages, "cap_pages": t.cap_pages}
            for t in loaded.scheduler.tenants.values()
        }
        log.info(
            "lifecycle.ready",
            pool_pages=loaded.pool_pages,
            page_bytes=loaded.page_bytes,
            tenants=tenants,
            prefixes=[name for name, _ in loaded.scheduler.kv.public.items()],
        )
        systemd.notify("READY=1", "STATUS=serving")

    def _alive(self, timeout: float) -> bool:
        """For the systemd watchdog: loading (a worker thread), or the engine
        task has come round its loop within ``timeout`` seconds."""
        runtime = self.runtime
        return runtime is None or time.monotonic() - runtime.heartbeat < timeout

    async def _watch_signals(self) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                name = signal.Signals(signum).name
                self.signals += 1
                if self.signals > 1:
                    log.warning("lifecycle.forced_exit", signal=name)
                    os._exit(1)
                log.info("lifecycle.signal", signal=name)
                self._arm_hard_deadline()
                self.state.status = "draining"
                self.admin.shutting_down = True
                systemd.notify("STOPPING=1", "STATUS=draining")
                if self.runtime is not None:
                    self.runtime.draining = True
                self._load_scope.cancel()  # a no-op once loaded
                self._stop.set()

    async def _drain(self) -> None:
        runtime = self.runtime
        assert runtime is not None
        timeout = self.config.server.drain_timeout
        log.info("lifecycle.draining", in_flight=runtime.in_flight, timeout_s=timeout)
        with trio.move_on_after(timeout):
            while runtime.in_flight:
                systemd.notify(f"STATUS=draining: {runtime.in_flight} requests in flight")
                with trio.move_on_after(1.0):
                    await runtime.wait_idle()
        if runtime.in_flight:
            aborted = runtime.abort_all()
            log.warning("lifecycle.drain_timeout", aborted=aborted)
        await runtime.settle()
        kv = runtime.scheduler.kv
        self.clean = kv.pool.num_referenced() == 0
        log.info("lifecycle.drained", used_pages=kv.pool.num_referenced(), clean=self.clean)

    def _arm_hard_deadline(self) -> None:
        deadline = self.config.server.drain_timeout + self.config.server.hard_deadline

        def hard_exit() -> None:
            log.warning(
                "lifecycle.hard_exit",
                after_s=deadline,
                clean=self.clean,
                reason="connections still open after the drain",
            )
            os._exit(0 if self.clean else 1)

        timer = threading.Timer(deadline, hard_exit)
        timer.daemon = True
        timer.start()

    def _report_stopped(self) -> None:
        fields: dict[str, Any] = {}
        if self.runtime is not None:
            kv = self.runtime.scheduler.kv
            kv.check_invariants()
            fields = {"used_pages": kv.pool.num_referenced(), "free_pages": len(kv.pool.free)}
        log.info("lifecycle.stopped", **fields)


def describe_device() -> str:
    import jax

    device = jax.devices()[0]
    return f"{device.platform}: {device.device_kind} x{jax.device_count()}"


def _log_progress(event: str, fields: dict[str, Any]) -> None:
    log.info(event, **fields)


def check_paths(config: Config) -> list[str]:
    """Paths the config names that do not exist (for check-config)."""
    missing = []
    for prefix in config.prefixes:
        if prefix.token_file is not None and not config.path(prefix.token_file).is_file():
            missing.append(str(config.path(prefix.token_file)))
    source = config.model.source
    if source not in ("random", "gemma3-270m") and not Path(config.path(source)).exists():
        missing.append(str(config.path(source)))
    return missing


def startup_failure(exc: BaseException) -> str | None:
    """The message of an expected start-up failure (a bad model, pool or
    budget, an address in use), unwrapped from trio's exception groups;
    None for anything else (a bug: let it show its traceback)."""
    from kvd.engine.engine import EngineError
    from kvd.engine.loader import ModelLoadError
    from kvd.kv.ledger import BudgetError

    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    if isinstance(
        exc, ConfigError | StateError | ModelLoadError | BudgetError | EngineError | OSError
    ):
        log.error("lifecycle.failed", error=str(exc))
        return str(exc)
    return None
