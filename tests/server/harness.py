"""The daemon in-process: the real Daemon, HTTP app, admin app, runtime and
scheduler, over the simulated executor (kvd/sched/simulated.py) and the
embedded model's real tokenizer, called through the apps' test clients under
pytest-trio. No JAX, no subprocess, no socket unless a test asks for one.

Steps run inline on the event loop and every clock is trio's, so a test that
takes a ``MockClock`` (``clock`` fixture) moves rate limits, queue deadlines
and drain timeouts in virtual time. The simulated executor reaches the
engine's fault points, so the fault matrix runs here as well.
"""

from __future__ import annotations

import functools
import gc
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, MutableMapping
from contextlib import asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import structlog
import trio
from quart.typing import TestClientProtocol

from kvd.engine.loader import embedded_tokenizer, random_model_config
from kvd.engine.tokenizer import Tokenizer
from kvd.kv.layout import build_layout
from kvd.sched.executor import ExecutorSizes
from kvd.sched.simulated import SimulatedExecutor
from kvd.server.admin import create_admin_app
from kvd.server.config import Config, load_config
from kvd.server.daemon import Daemon, Loader
from kvd.server.scheduling import Loaded, build_scheduler, config_prefixes
from kvd.server.state import LiveState, from_config
from kvd.units import parse_size
from tests.server.conftest import ALICE, parse_metrics, write_config

MODEL = "random"
DEVICE = "simulated: SimulatedExecutor x1"


_threaded_steps: ContextVar[bool] = ContextVar("threaded_steps", default=False)


@functools.cache
def tokenizer() -> Tokenizer:
    return embedded_tokenizer()


def token_buckets(limit: int) -> tuple[int, ...]:
    buckets, size = [], 1
    while size < limit:
        buckets.append(size)
        size *= 2
    return (*buckets, limit)


def simulated_loader(
    executors: list[SimulatedExecutor], *, in_thread: bool = False
) -> Callable[..., Loaded]:
    """A loader for ``Daemon``: the config's pool, limits, tenants and
    prefixes over a simulated executor of the tiny random model's KV
    geometry (each one made is appended to ``executors``). ``in_thread``:
    for ``Daemon.run``, which loads in a worker thread and steps in another
    (the scheduler's clock is then the real one)."""

    def load(
        config: Config,
        progress: Callable[[str, dict[str, Any]], None],
        saved: LiveState | None,
    ) -> Loaded:
        cfg = config.model
        progress("lifecycle.loading", {"source": "simulated", "dtype": cfg.dtype})
        words = tokenizer()
        vocab = words.vocab_size
        shape = random_model_config(vocab, 32, max(cfg.max_model_len, 256))
        layout = build_layout(shape.kv_geometry(cfg.kv_dtype or cfg.dtype), config.pool.block_size)
        pool_tokens = layout.pool_tokens(parse_size(config.pool.size))
        pages = pool_tokens // layout.block_size * layout.num_groups + 1
        limits = ExecutorSizes(
            max_model_len=cfg.max_model_len,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            vocab_size=vocab,
            token_buckets=token_buckets(cfg.max_num_batched_tokens),
        )
        executor = SimulatedExecutor(layout, pages, limits, words.stop_ids())
        executors.append(executor)
        live = saved or from_config(config, config_prefixes(config, words, vocab))
        # The runtime's clock: trio's on the event loop, a real one for steps
        # in a worker thread (trio's cannot be read there).
        clock = time.monotonic if in_thread or _threaded_steps.get() else trio.current_time
        scheduler = build_scheduler(config, executor, live, layout.page_bytes, clock=clock)
        progress("lifecycle.calibrating", {"what": "the prefill and copy rates"})
        scheduler.calibrate(repeats=1)
        return Loaded(scheduler, words, vocab, pages - 1, layout.page_bytes, live)

    return load


class Reply:
    """An httpx response with the test client's reading methods."""

    def __init__(self, response: httpx.Response) -> None:
        self.response = response
        self.status_code = response.status_code
        self.headers = response.headers

    async def get_json(self) -> Any:
        if not self.response.headers.get("content-type", "").startswith("application/json"):
            return None  # an event stream
        return self.response.json()

    async def get_data(self) -> bytes:
        return self.response.content


@dataclass
class Served:
    """One in-process daemon and its two apps' test clients."""

    daemon: Daemon
    http: TestClientProtocol
    admin: TestClientProtocol
    executors: list[SimulatedExecutor]
    config_path: Path
    logs: list[MutableMapping[str, Any]] = field(default_factory=list)
    exits: list[int] = field(default_factory=list)  # exits deadlines would have taken

    @property
    def address(self) -> tuple[str, int]:
        """The tenants' listener (``http_socket=True``)."""
        url = self.named("lifecycle.listening")[0]["addresses"][0]
        host, port = url.removeprefix("http://").rsplit(":", 1)
        return host, int(port)

    @property
    def executor(self) -> SimulatedExecutor:
        return self.executors[-1]

    @property
    def scheduler(self) -> Any:
        assert self.daemon.runtime is not None
        return self.daemon.runtime.scheduler

    async def complete(self, key: str = ALICE, prompt: Any = "hello", **body: Any) -> Reply:
        payload = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0} | body
        return await self.post("/v1/completions", payload, key)

    async def chat(self, key: str = ALICE, **body: Any) -> Reply:
        return await self.post("/v1/chat/completions", {"model": MODEL} | body, key)

    async def post(self, path: str, body: Any, key: str | None = ALICE, **kw: Any) -> Reply:
        """Over httpx's ASGI transport, which takes the body as it is sent
        (quart's test client holds ten chunks, then stalls a long stream)."""
        headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
        headers |= kw.pop("headers", {})
        data = body if isinstance(body, bytes | str) else json.dumps(body)
        transport = httpx.ASGITransport(app=self.daemon.http_app)  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://kvd") as client:
            response = await client.post(
                path,
                content=data,
                headers=headers | {"Content-Type": "application/json"},
                timeout=None,
                **kw,
            )
        return Reply(response)

    async def admin_json(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        kw: dict[str, Any] = {} if body is None else {"json": body}
        response = await getattr(self.admin, method)(path, **kw)
        return response.status_code, await response.get_json()

    async def status(self) -> dict[str, Any]:
        code, body = await self.admin_json("get", "/v1/status")
        assert code == 200, body
        return body  # type: ignore[no-any-return]

    async def metrics(self) -> dict[str, float]:
        return parse_metrics(await (await self.admin.get("/metrics")).get_data(as_text=True))

    def named(self, event: str) -> list[MutableMapping[str, Any]]:
        return [e for e in self.logs if e.get("event") == event]

    async def settled(self) -> None:
        """Until the step loop has applied every command posted so far
        (the cancels of requests that ended, say)."""
        assert self.daemon.runtime is not None
        await self.daemon.runtime.settle()

    async def assert_whole(self) -> None:
        """No request in flight, no page referenced, every invariant kept."""
        await self.settled()
        runtime = self.daemon.runtime
        assert runtime is not None and runtime.in_flight == 0
        kv = runtime.scheduler.kv
        assert kv.registry.pool.num_referenced() == 0, kv.registry.pool.num_referenced()
        kv.check_invariants()


async def until(condition: Callable[[], object], what: str, timeout: float = 30) -> None:
    """Poll ``condition`` on the event loop until it holds (tests wait for
    states, never for a fixed time); fails after ``timeout`` seconds."""
    with trio.fail_after(timeout):
        while not condition():
            await trio.sleep(0.01)


async def kvctl(served: Served, *args: str) -> subprocess.CompletedProcess[bytes]:
    """The real kvctl, in a subprocess, on the daemon's admin socket (the
    event loop keeps serving while it runs)."""
    return await trio.run_process(
        [sys.executable, "-m", "kvctl.cli", "--socket", str(served.daemon.admin_socket), *args],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )


@asynccontextmanager
async def serving(
    tmp_path: Path,
    *,
    config_path: Path | None = None,
    admin_socket: bool = False,
    http_socket: bool = False,
    step_in_thread: bool = False,
    extra_server: str = "",
    loader: Loader | None = None,
    freeze_at_ready: bool = False,
    **values: Any,
) -> AsyncIterator[Served]:
    """An in-process daemon, loaded and ready, for the ``async with`` body;
    its step loop is stopped after. ``values`` fill the tiny config (see
    conftest.write_config); ``config_path`` reuses a written one (a restart);
    ``admin_socket`` serves the admin API on its real Unix socket as well,
    kept bound as the daemon keeps it; ``step_in_thread`` runs steps in the
    worker thread the engine's run in (``step_timeout`` applies);
    ``extra_server`` is more of the config's [server] section; ``loader``
    replaces the simulated executor (``kvd.server.daemon.load_engine``: the
    real engine). The exit a deadline would take is recorded in
    ``Served.exits``, not taken. ``freeze_at_ready``: as the daemon does
    (off by default here: each start's full collection would walk all a
    test process holds)."""
    if config_path is None:
        config_path = write_config(tmp_path / "kvd.toml", **values)
        if extra_server:
            text = config_path.read_text().replace("[server]", f"[server]\n{extra_server}", 1)
            config_path.write_text(text)
    config = load_config(config_path)
    executors: list[SimulatedExecutor] = []
    exits: list[int] = []
    daemon = Daemon(
        config,
        loader=loader or simulated_loader(executors),
        describe_device=lambda: DEVICE,
        step_in_thread=step_in_thread,
        clock=time.monotonic if step_in_thread else trio.current_time,
        exit_process=exits.append,
        freeze_at_ready=freeze_at_ready,
        keep_heap_at_ready=False,  # it would outlive the daemon, in the test process
    )
    with structlog.testing.capture_logs() as logs:
        daemon.open_kv_events()
        saved = daemon.restore()
        threaded = _threaded_steps.set(step_in_thread)
        try:
            loaded = daemon._load(saved)
        finally:
            _threaded_steps.reset(threaded)
        async with trio.open_nursery() as nursery:
            if admin_socket:
                await daemon._start_admin(nursery)
            if http_socket:  # the listeners on 127.0.0.1, port 0
                await daemon._start_http(nursery)
            daemon.go_live(nursery, loaded)
            served = Served(
                daemon,
                daemon.http_app.test_client(),
                create_admin_app(daemon.admin).test_client(),
                executors,
                config_path,
                logs,
                exits,
            )
            try:
                yield served
            finally:
                for executor in executors:
                    executor.unhang.set()
                daemon._http_stopped.set()
                nursery.cancel_scope.cancel()
                daemon.close_kv_events()
                if freeze_at_ready:
                    gc.unfreeze()  # as Daemon.run does: go_live froze what start-up built
