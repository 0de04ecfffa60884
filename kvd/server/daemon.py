"""``kvd serve``: one trio process that owns the device, the engine and the
scheduler, and serves tenants over HTTP.

Lifecycle:
1. Bind the listener at once (``/health`` answers, ``/ready`` says loading).
2. In a worker thread: load the weights, size the pool, compile every shape
   bucket (progress logged), measure the recompute and swap rates, apply
   tenants and public prefixes. Then the step loop starts and ``/ready``
   turns 200.
3. SIGTERM/SIGINT: drain. New requests get 503; in-flight ones have
   ``drain_timeout`` seconds to finish; what is left is aborted (its pages
   released), the listener closes and the process exits 0. A second signal
   exits at once (1). A hard deadline (``drain_timeout + hard_deadline``)
   exits even if a client that stopped reading holds a connection open:
   hypercorn's send cannot be cancelled, so only leaving the process ends it.
4. The engine fails (a step raised or hung, an invariant broke): the daemon
   fails fast rather than sit alive and mute. ``/ready`` answers 503 with the
   cause at once, every request in flight gets an error (``engine_failed``),
   new ones 503, systemd hears ``STOPPING=1``, ``lifecycle.failed`` is logged
   and the failure recorded beside the state file; after at most a second
   for the answers to go out the process exits 1, so ``Restart=`` brings it
   back with its persisted state. A hard deadline makes sure it does.
"""

from __future__ import annotations

import gc
import os
import signal
import socket
import stat
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import structlog
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve

from kvd import __version__, faults
from kvd.engine.heap import keep_freed_memory
from kvd.server import systemd
from kvd.server.admin import Admin, create_admin_app
from kvd.server.config import (
    Config,
    ConfigError,
    body_limit,
    parse_listen,
    socket_mode,
)
from kvd.server.http import create_app, create_metrics_app
from kvd.server.kvevents import KVEventPublisher
from kvd.server.metrics import Metrics
from kvd.server.runtime import Runtime
from kvd.server.scheduling import Loaded
from kvd.server.serving import ServerContext, TenantAccess
from kvd.server.state import LiveState, StateError, StateStore, overridden
from kvd.server.status import ServerStatus

log = structlog.get_logger("kvd")

TCP_USER_TIMEOUT_MS = 30_000  # unacknowledged data this long drops the connection
EXIT_FAILED = 1  # the engine failed: restart me (systemd's Restart=on-failure)
ANSWER_WINDOW_S = 1.0  # after a failure: the error answers go out, /ready says failed
FAILED_EXIT_DEADLINE_S = 5.0  # after a failure, the process is gone by then whatever happens
ADMIN_SOCKET_CHECK_S = 1.0  # how often the admin socket's path is checked to still be ours


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


def _identity(path: Path) -> tuple[int, int] | None:
    """What the path names now (device, inode), None if nothing."""
    try:
        info = path.lstat()
    except OSError:
        return None
    return info.st_dev, info.st_ino


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


Loader = Callable[[Config, Callable[[str, dict[str, Any]], None], LiveState | None], Loaded]


def load_engine(
    config: Config, progress: Callable[[str, dict[str, Any]], None], saved: LiveState | None
) -> Loaded:
    """The real loader (the model on the device, compiled): imported only
    when called, so the daemon's own modules stay free of JAX."""
    from kvd.server.loading import load

    return load(config, progress, saved)


class Daemon:
    """The process: listeners, the load, the step loop, signals, drain.

    ``loader`` builds what serving starts from (the engine by default; the
    in-process tests pass a simulated one), ``describe_device`` names the
    device for kvctl, and ``step_in_thread``/``clock`` go to the runtime."""

    def __init__(
        self,
        config: Config,
        *,
        listen: str | None = None,
        loader: Loader = load_engine,
        describe_device: Callable[[], str] | None = None,
        step_in_thread: bool = True,
        clock: Callable[[], float] = time.monotonic,
        exit_process: Callable[[int], object] = os._exit,
        freeze_at_ready: bool = True,
        keep_heap_at_ready: bool = True,
    ) -> None:
        self.config = config
        # Off only where many daemons start in one process (the tests): each
        # start's full collection walks everything the process holds, and
        # the heap setting would outlive the daemon.
        self.freeze_at_ready = freeze_at_ready
        self.keep_heap_at_ready = keep_heap_at_ready
        self.heap_kept = False
        self.listen = listen or config.server.listen
        parse_listen(self.listen)
        self.loader = loader
        self.exit_process = exit_process  # how a deadline leaves (tests record it)
        self.step_in_thread = step_in_thread
        self.clock = clock
        self.runtime: Runtime | None = None
        self.status = ServerStatus()
        self.context = ServerContext(
            runtime=None,
            tokenizer=None,
            model_name=config.served_model,
            vocab_size=0,
            max_model_len=config.model.max_model_len,
            tiers=tuple(config.tiers),
            metrics=Metrics(lambda: self.runtime, self.status, config.served_model),
            keys={
                t.api_key_sha256: TenantAccess(t.name, t.tier or config.tiers[0])
                for t in config.tenants
            },
            status=self.status,
            log_prompts=config.server.log_prompts,
            queue_timeout=config.server.queue_timeout,
            max_n=config.server.max_n,
        )
        self.store = StateStore(config.path(config.server.state_file))
        self.admin_socket = config.path(config.server.admin_socket)
        self.admin = Admin(config, self.context, self.store, describe_device or _jax_device)
        self.http_app = create_app(self.context, max_body=body_limit(config))
        self._stop = trio.Event()  # first signal: drain, then stop
        self._http_stopped = trio.Event()  # hypercorn's shutdown trigger
        self._load_scope = trio.CancelScope()
        self.signals = 0
        self.clean = False  # every request ended and its pages were released
        self.failure: str | None = None  # why the engine failed
        self.kv_events: KVEventPublisher | None = None

    async def run(self) -> int:
        """Serve until a signal; returns the exit status."""
        config = self.config
        log.info("lifecycle.start", version=__version__, pid=os.getpid(), model=config.served_model)
        armed = faults.arm_from_environment()
        if armed is not None:
            log.warning("lifecycle.faults_armed", faults=str(armed), reason="KVD_TESTING=1")
        saved = self.restore()
        try:
            await self._serve(saved)
        except BaseException:
            # Whatever went wrong, the process must end: a task that ignores
            # cancellation must not keep a listener open that nobody serves.
            self._arm_exit_deadline(FAILED_EXIT_DEADLINE_S, EXIT_FAILED, "an unexpected error")
            raise
        finally:
            # What was frozen at ready can be collected again: a daemon run in
            # a longer-lived process (the tests) leaves nothing unreachable.
            gc.unfreeze()
        self.admin_socket.unlink(missing_ok=True)
        self._report_stopped()
        return EXIT_FAILED if self.failure is not None else 0

    def restore(self) -> LiveState | None:
        """The persisted admin state and failure record, if any (a corrupt
        state file stops the start here: StateError)."""
        saved = self.store.load()
        failures = self.store.load_failures()
        if failures is not None:
            self.admin.failures = msgspec.to_builtins(failures)
            self.context.metrics.engine_failures.inc(failures.count)
            log.warning(
                "lifecycle.previous_failures",
                count=failures.count,
                last_at=failures.last_at,
                last_cause=failures.last_cause,
            )
        if saved is not None:
            differs = overridden(self.config, saved)
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
        return saved

    async def _serve(self, saved: Any) -> None:
        self.open_kv_events()  # first: a bad endpoint fails the start at once
        try:
            await self._serve_until_stopped(saved)
        finally:
            self.close_kv_events()

    def open_kv_events(self) -> None:
        """The KV-event sockets, if ``[kv_events]`` enables them (KVEventsError
        if they cannot be opened); events flow once the daemon is live."""
        section = self.config.kv_events
        if not section.enable:
            return
        self.kv_events = KVEventPublisher(section)
        self.context.metrics.kv_events = self.kv_events
        log.info(
            "lifecycle.kv_events",
            endpoint=self.kv_events.endpoint,
            replay_endpoint=self.kv_events.replay_endpoint,
            private_blocks=section.private_blocks.value,
        )

    def close_kv_events(self) -> None:
        if self.kv_events is not None:
            self.kv_events.close()

    async def _serve_until_stopped(self, saved: Any) -> None:
        async with trio.open_nursery() as nursery:  # signals, watchdog, the step loop
            nursery.start_soon(self._watch_signals)
            nursery.start_soon(systemd.watchdog, self._alive)
            async with trio.open_nursery() as http:
                await self._start_http(http)
                await self._start_admin(http)
                self.status.loading("loading the model")
                systemd.notify("STATUS=loading the model and compiling")
                loaded = None
                with self._load_scope:
                    loaded = await trio.to_thread.run_sync(
                        lambda: self._load(saved), abandon_on_cancel=True
                    )
                if loaded is not None and not self._stop.is_set():
                    self.go_live(nursery, loaded)
                    await self._stop.wait()
                    if self.failure is None:
                        await self.drain()
                        await self._stop_followers(loaded)
                    else:
                        await self._let_answers_out()
                else:
                    self.clean = True  # stopped while loading: nothing to drain
                self._http_stopped.set()
            nursery.cancel_scope.cancel()

    async def _start_http(self, nursery: trio.Nursery) -> None:
        hconfig = _Hypercorn()
        hconfig.bind = [self.listen]
        hconfig.accesslog = None
        hconfig.graceful_timeout = 1.0  # the drain has already waited for requests
        hconfig.keep_alive_timeout = 30.0

        async def serve(task_status: trio.TaskStatus[list[str]]) -> None:
            await hypercorn_serve(
                self.http_app,
                hconfig,
                shutdown_trigger=self._http_stopped.wait,
                task_status=task_status,
            )

        bound = await nursery.start(serve)
        log.info("lifecycle.listening", addresses=bound)

        mconfig = _Hypercorn()
        mconfig.bind = [self.config.server.metrics_listen]
        mconfig.accesslog = None
        mconfig.graceful_timeout = 1.0
        metrics_app = create_metrics_app(self.context.metrics)

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
        await nursery.start(self._serve_admin)
        log.info("lifecycle.admin_socket", path=str(self.admin_socket))

    async def _serve_admin(self, task_status: trio.TaskStatus[None]) -> None:
        """The admin API on its Unix socket, kept there: a socket removed
        under the daemon (its directory cleaned away, say) is bound again
        within ADMIN_SOCKET_CHECK_S, so kvctl never loses the daemon for good.
        A bind that fails then (the directory not ours to make, the path
        taken) is logged and tried again; only the first bind stops a start."""
        started: list[bool] = []
        while not self._http_stopped.is_set():
            failure: str | None = None
            try:
                prepare_socket_path(self.admin_socket)
                await self._serve_admin_until_lost(started, task_status)
            except* (ConfigError, OSError) as group:
                if not started:
                    raise
                failure = "; ".join(str(exc) for exc in group.exceptions)
            if failure is not None:
                log.error("admin.socket_rebind_failed", path=str(self.admin_socket), error=failure)
                with trio.move_on_after(ADMIN_SOCKET_CHECK_S):
                    await self._http_stopped.wait()

    async def _serve_admin_until_lost(
        self, started: list[bool], task_status: trio.TaskStatus[None]
    ) -> None:
        stop = trio.Event()
        async with trio.open_nursery() as server:
            await server.start(self._serve_admin_once, stop)
            if not started:
                started.append(True)
                task_status.started()
            else:
                log.warning("admin.socket_restored", path=str(self.admin_socket))
            bound = _identity(self.admin_socket)
            while not self._http_stopped.is_set():
                if bound is None or _identity(self.admin_socket) != bound:
                    log.warning(
                        "admin.socket_lost", path=str(self.admin_socket), action="binding again"
                    )
                    break
                with trio.move_on_after(ADMIN_SOCKET_CHECK_S):
                    await self._http_stopped.wait()
            stop.set()

    async def _serve_admin_once(
        self, stop: trio.Event, task_status: trio.TaskStatus[list[str]]
    ) -> None:
        # A fresh app each time: one app served twice would run its start-up
        # hooks twice.
        hconfig = _Hypercorn()
        hconfig.bind = [f"unix:{self.admin_socket}"]
        hconfig.accesslog = None
        hconfig.graceful_timeout = 1.0
        hconfig.socket_mode = socket_mode(self.config)
        hconfig.socket_group = self.config.server.admin_group
        await hypercorn_serve(
            create_admin_app(self.admin),
            hconfig,
            shutdown_trigger=stop.wait,
            task_status=task_status,
        )

    def _load(self, saved: Any) -> Loaded:
        """The loader, with the failures a start expects passed on as they
        are, and any other (the device failing its first steps, say) as an
        EngineError: one line for the operator, the traceback in the log."""
        from kvd.engine.engine import EngineError

        try:
            return self.loader(self.config, self._progress, saved)
        except Exception as exc:
            if _expected_startup_failure(exc):
                raise
            log.error("lifecycle.load_failed", error=repr(exc), exc_info=exc)
            raise EngineError(f"the engine failed while starting: {exc!r}") from exc

    def _progress(self, event: str, fields: dict[str, Any]) -> None:
        """Loading progress: logged, and what ``/ready`` and kvctl say meanwhile."""
        log.info(event, **fields)
        self.status.loading(
            " ".join(
                [event, *(f"{k}={v}" for k, v in fields.items() if not isinstance(v, dict | list))]
            )
        )

    def go_live(self, nursery: trio.Nursery, loaded: Loaded) -> None:
        """Serve ``loaded``: the step loop starts in ``nursery`` and the
        daemon turns ready (unless a stop came first)."""
        runtime = Runtime(
            loaded.scheduler,
            step_log_interval=self.config.server.step_log_interval,
            max_in_flight=self.config.server.max_in_flight,
            step_timeout=self.config.server.step_timeout,
            step_in_thread=self.step_in_thread,
            clock=self.clock,
        )
        self.runtime = runtime
        context = self.context
        runtime.latency_sink = context.metrics.observe_latencies
        context.runtime = runtime
        self.admin.live = loaded.live
        # The keys of the tenants in force (the state file's, after a restart).
        context.keys.clear()
        context.keys.update(
            {
                t.api_key_sha256: TenantAccess(t.name, t.tier or self.config.tiers[0])
                for t in loaded.live.tenants
            }
        )
        context.tokenizer = loaded.tokenizer
        context.vocab_size = loaded.vocab_size
        context.weight_bytes = loaded.weight_bytes
        context.hosts = loaded.bytes_here
        context.quantization = loaded.quantization
        if self.kv_events is not None:
            kv = loaded.scheduler.kv
            kv.flush_cache()  # subscribers start from an empty cache (and are told so)
            self.kv_events.attach(kv.enable_events(self.config.kv_events.private_blocks))
            runtime.after_change = self.kv_events.offer
        nursery.start_soon(self._run_step_loop, runtime)
        # What start-up built lives as long as the daemon (the model's and
        # tokenizer's Python objects, the compiled programs' handles): frozen,
        # the collector's full passes skip it. Otherwise each walks all of it,
        # 0.32-0.34 s with the 270M warmed up, stalling every stream mid-step.
        if self.freeze_at_ready:
            gc.collect()
            gc.freeze()
        # Each step's temporaries reuse the last step's memory instead of
        # being mapped and faulted in afresh (kvd/engine/heap.py).
        if self.keep_heap_at_ready:
            self.heap_kept = keep_freed_memory()
        self.status.ready()
        tenants = {
            t.name: {"reservation_pages": t.reservation_pages, "cap_pages": t.cap_pages}
            for t in loaded.scheduler.book.tenants.values()
        }
        log.info(
            "lifecycle.ready",
            pool_pages=loaded.pool_pages,
            page_bytes=loaded.page_bytes,
            tenants=tenants,
            prefixes=loaded.scheduler.kv.public_prefixes(),
            frozen_objects=gc.get_freeze_count() if self.freeze_at_ready else 0,
            heap_kept=self.heap_kept,
        )
        systemd.notify("READY=1", "STATUS=serving")

    async def _run_step_loop(self, runtime: Runtime) -> None:
        await runtime.run()  # returns only if the engine failed
        assert runtime.failure is not None
        await self._fail(runtime.failure)

    async def _fail(self, cause: str) -> None:
        """The engine failed: say so everywhere at once, then stop (the
        requests in flight have already been answered by the runtime)."""
        self.failure = cause
        self.status.fail(cause)
        self.context.metrics.engine_failures.inc()
        self._arm_exit_deadline(FAILED_EXIT_DEADLINE_S, EXIT_FAILED, "the engine failed")
        systemd.notify("STOPPING=1", f"STATUS=failed: {cause}"[:512])
        log.error(
            "lifecycle.failed",
            error=cause,
            exit_status=EXIT_FAILED,
            hint="the daemon exits so that its supervisor restarts it; admin changes "
            "are in the state file",
        )
        try:
            with trio.move_on_after(1.0):  # a disk that hangs must not delay the exit
                record = await trio.to_thread.run_sync(
                    self.store.record_failure, cause, abandon_on_cancel=True
                )
                self.admin.failures = msgspec.to_builtins(record)
        except OSError as exc:
            log.warning("lifecycle.failure_not_recorded", error=str(exc))
        self._stop.set()

    async def _let_answers_out(self) -> None:
        """The window in which the handlers send their errors, and /ready and
        new requests say why (a load balancer polling /ready sees it)."""
        await trio.sleep(ANSWER_WINDOW_S)

    def _alive(self, timeout: float) -> bool:
        """For the systemd watchdog: loading (a worker thread), or the step
        loop has come round within ``timeout`` seconds."""
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
                if self.failure is not None:  # already on its way out, saying why
                    log.info("lifecycle.signal", signal=name, ignored="exiting: the engine failed")
                    continue
                log.info("lifecycle.signal", signal=name)
                self._arm_hard_deadline()
                self.stop()

    def stop(self) -> None:
        """Drain and stop (a signal's effect): new requests are refused, the
        requests in flight have ``drain_timeout`` to finish."""
        self.status.stop()
        systemd.notify("STOPPING=1", "STATUS=draining")
        self._load_scope.cancel()  # a no-op once loaded
        self._stop.set()

    async def drain(self) -> None:
        """Wait up to ``drain_timeout`` for the requests in flight, abort
        what is left (its pages released), and say whether the pool is whole."""
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
        referenced = kv.referenced_pages()
        self.clean = referenced == 0
        log.info("lifecycle.drained", referenced_pages=referenced, clean=self.clean)

    async def _stop_followers(self, loaded: Loaded) -> None:
        """Several processes: the leader has drained; its followers stop now,
        between steps (the step loop runs the call)."""
        if loaded.stop_followers is None or self.runtime is None:
            return
        await self.runtime.call(loaded.stop_followers)
        log.info("distributed.followers_stopped")

    def _arm_hard_deadline(self) -> None:
        deadline = self.config.server.drain_timeout + self.config.server.hard_deadline
        self._arm_exit_deadline(deadline, None, "connections still open after the drain")

    def _arm_exit_deadline(self, after_s: float, status: int | None, reason: str) -> None:
        """Leave the process ``after_s`` from now whatever it is doing, with
        ``status`` (None: 0 if the drain ended clean, else 1)."""

        def hard_exit() -> None:
            if status is not None:
                code = status
            else:
                code = EXIT_FAILED if self.failure is not None or not self.clean else 0
            log.warning(
                "lifecycle.hard_exit", after_s=after_s, status=code, clean=self.clean, reason=reason
            )
            sys.stdout.flush()
            self.exit_process(code)

        timer = threading.Timer(after_s, hard_exit)
        timer.daemon = True
        timer.start()

    def _report_stopped(self) -> None:
        fields: dict[str, Any] = {}
        if self.failure is not None:
            # The scheduler is in whatever state the failure left it (a hung
            # step may still hold it): nothing to check, only to leave.
            log.info("lifecycle.stopped", failed=True, exit_status=EXIT_FAILED)
            return
        if self.runtime is not None:
            kv = self.runtime.scheduler.kv
            kv.check_invariants()
            pool = kv.stats()
            fields = {"referenced_pages": pool.referenced_pages, "free_pages": pool.free_pages}
        log.info("lifecycle.stopped", **fields)


def _jax_device() -> str:
    import jax

    device = jax.devices()[0]
    return f"{device.platform}: {device.device_kind} x{jax.device_count()}"


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
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    if _expected_startup_failure(exc):
        log.error("lifecycle.failed", error=str(exc))
        return str(exc)
    log.error("lifecycle.failed", error=repr(exc))  # a bug: its traceback follows
    return None


def _expected_startup_failure(exc: BaseException) -> bool:
    from kvd.engine.engine import EngineError
    from kvd.engine.loader import ModelLoadError
    from kvd.kv.ledger import BudgetError

    return isinstance(
        exc,
        ConfigError
        | StateError
        | ModelLoadError
        | BudgetError
        | EngineError
        | OSError
        | faults.FaultSpecError,
    )
