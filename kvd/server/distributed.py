"""One kvd over several processes (the hosts of a slice), on JAX's
multi-controller runtime: starting it from ``[distributed]``, the watch that
ends every process when one is lost, and a follower's life (what the
processes agree on before they load: ``kvd.server.coordination``).

Process 0, the leader, is the daemon (``kvd.server.daemon``): the HTTP API,
the admin socket, the scheduler and the KV manager. Every other process, a
follower, loads the same model and engine, compiles the same programs, and
then only replays the leader's device calls (``Engine.follow``,
``kvd.engine.lockstep``). The coordinator, the collectives and the transfers
are JAX's; this module adds no channel of its own.

A process that dies, hangs or fails ends the set: a collective with a dead
peer fails at once, and JAX's coordination service marks a process that
stops sending heartbeats for ``heartbeat_timeout`` seconds as lost; the
watch then logs one line naming it and the process exits non-zero, so the
supervisor restarts every host. Docs: docs/howto/multi-host.md.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, NamedTuple

import structlog

from kvd.server import coordination, systemd
from kvd.server.config import Config, ConfigError, resolve_distributed

if TYPE_CHECKING:
    from kvd.engine.engine import Engine

log = structlog.get_logger("kvd.distributed")

EXIT_LOST = 1  # a process of the set was lost, or this one failed
WATCH_INTERVAL_S = 1.0


class Role(NamedTuple):
    process: int
    processes: int

    @property
    def leader(self) -> bool:
        return self.process == 0


def start(config: Config, process_id: int | None) -> Role:
    """Join the set (blocks until every process has): JAX's runtime, then the
    check that the model spans every device. ConfigError on a bad set."""
    section = config.distributed
    assert section is not None
    coordinator, processes, pid = resolve_distributed(section, process_id)
    import jax

    # Collectives between processes' CPU devices (tests, development): gloo.
    jax.config.update("jax_cpu_collectives_implementation", section.cpu_collectives)
    # A lost process is then reported (the watch below names it and exits)
    # instead of aborting every other process from inside the runtime.
    jax.config.update("jax_enable_recoverability", True)
    log.info(
        "distributed.joining",
        coordinator=coordinator or "auto",
        processes=processes,
        process=pid,
    )
    try:
        jax.distributed.initialize(
            coordinator_address=coordinator,
            num_processes=processes,
            process_id=pid,
            heartbeat_timeout_seconds=max(1, round(section.heartbeat_timeout)),
            initialization_timeout=max(1, round(section.join_timeout)),
        )
    except Exception as exc:  # noqa: BLE001  # JAX raises several kinds: all mean "cannot join"
        raise ConfigError(f"distributed: cannot join the set: {exc}") from None
    role = Role(jax.process_index(), jax.process_count())
    devices, local = jax.device_count(), jax.local_device_count()
    tp = config.model.tensor_parallel
    if tp != devices:
        raise ConfigError(
            f"model.tensor_parallel: {tp} does not match the {devices} devices of the "
            f"{role.processes} processes ({local} each); one model spans them all"
        )
    log.info(
        "distributed.joined",
        process=role.process,
        processes=role.processes,
        role="leader" if role.leader else "follower",
        local_devices=local,
        devices=devices,
    )
    return role


def watch(role: Role) -> threading.Thread:
    """A thread that ends this process, with one line, when the coordination
    service reports another process lost."""
    from jax._src import distributed as jax_distributed

    client = jax_distributed.global_state.client
    assert client is not None  # start() joined the set
    everyone = list(range(role.processes))

    def run() -> None:
        while True:
            time.sleep(WATCH_INTERVAL_S)
            try:
                live = set(client.get_live_nodes(everyone))
            except Exception as exc:  # noqa: BLE001  # the service itself is gone
                if not coordination.is_ending():
                    lost(role, [0], f"the coordination service is unreachable: {exc}")
                return
            missing = [p for p in everyone if p not in live]
            if missing and not coordination.is_ending():
                lost(role, missing, "stopped sending heartbeats (died, hung or unreachable)")
                return

    thread = threading.Thread(target=run, name="kvd-distributed-watch", daemon=True)
    thread.start()
    return thread


def lost(role: Role, processes: list[int], why: str) -> None:
    """One line naming the lost processes, then this process ends at once
    (no shutdown barrier: the others are gone)."""
    names = ", ".join(f"process {p}" + (" (the leader)" if p == 0 else "") for p in processes)
    log.error(
        "distributed.process_lost",
        lost=processes,
        process=role.process,
        error=f"{names} {why}; this process exits so that the set restarts",
        exit_status=EXIT_LOST,
    )
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_LOST)


def run_follower(config: Config, role: Role) -> int:
    """A follower's life: load and compile as the leader does, tell systemd
    it is ready, then replay the leader's device calls until it says stop.
    Signals do not stop a follower: the leader drains first and then stops
    every follower (a second signal forces the exit)."""
    from kvd.engine.heap import keep_freed_memory
    from kvd.server.loading import build_engine, warm_fields

    signals = [0]

    def on_signal(signum: int, _frame: Any) -> None:
        signals[0] += 1
        name = signal.Signals(signum).name
        if signals[0] > 1:
            log.warning("lifecycle.forced_exit", signal=name)
            os._exit(EXIT_LOST)
        log.info("lifecycle.signal", signal=name, ignored="the leader stops its followers")

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    systemd.notify("STATUS=loading the model and compiling")

    def progress(event: str, fields: dict[str, Any]) -> None:
        log.info(event, **fields)

    engine, _, _ = build_engine(config, progress)
    seconds = engine.warm_up()
    progress("lifecycle.warm", warm_fields(engine, seconds))
    failure: list[BaseException] = []
    # As the leader does at ready (Daemon.go_live): a full collection walking
    # the engine's start-up objects would stall a step the leader waits on.
    gc.collect()
    gc.freeze()
    keep_freed_memory()  # as the leader does at ready: kvd/engine/heap.py
    thread = threading.Thread(
        target=_follow, args=(engine, failure), name="kvd-follower", daemon=True
    )
    thread.start()
    systemd.notify("READY=1", "STATUS=following process 0")
    log.info("distributed.following", process=role.process, leader=0)
    interval = systemd.watchdog_interval()
    while thread.is_alive():  # the main thread stays free for signals
        thread.join(interval or 1.0)
        if interval is not None and thread.is_alive():
            systemd.notify("WATCHDOG=1")
    if failure:
        log.error(
            "distributed.follower_failed",
            process=role.process,
            error=repr(failure[0]),
            exit_status=EXIT_LOST,
        )
        return EXIT_LOST
    log.info("lifecycle.stopped", process=role.process, messages=_messages(engine))
    return 0


def _follow(engine: Engine, failure: list[BaseException]) -> None:
    try:
        engine.follow()
        coordination.ending()
    except BaseException as exc:  # noqa: BLE001  # reported by the main thread
        failure.append(exc)


def _messages(engine: Engine) -> int:
    return 0 if engine.lockstep is None else engine.lockstep.messages
