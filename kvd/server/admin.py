"""The operators' admin API, served on a Unix socket only (kvctl's peer).

Every change is validated against the live state and applied on the step
loop between two steps (``Runtime.call``), so a step never sees half a
change; then it is written to the state file and to the audit log. If the
state file cannot be written, the change is undone and reported: a change
that is in force is always a change that survives a restart.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import msgspec
import structlog
import trio
from msgspec import UNSET, UnsetType
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from kvd import __version__, faults
from kvd.kv.ledger import BudgetMode
from kvd.kv.scope import SharingPolicy
from kvd.server.config import Config, ConfigError, TenantEntry, validate
from kvd.server.runtime import EngineFailed
from kvd.server.scheduling import tenant_config
from kvd.server.serving import ServerContext, TenantAccess
from kvd.server.state import AUDIT_KEPT, AuditEntry, LiveState, PrefixTokens, StateStore
from kvd.server.status import Status, StatusError

log = structlog.get_logger("kvd")
_encoder = msgspec.json.Encoder()


class AdminError(Exception):
    def __init__(self, status: int, message: str, **fields: Any) -> None:
        super().__init__(message)
        self.status = status
        self.fields = fields  # more of the reply body (why the daemon is not ready)


class TenantPatch(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    api_key_sha256: str | UnsetType = UNSET
    reservation: str | UnsetType = UNSET
    burst_cap: str | None | UnsetType = UNSET  # null: the whole pool
    tier: str | UnsetType = UNSET
    weight: float | UnsetType = UNSET
    requests_per_minute: float | None | UnsetType = UNSET  # null: unlimited
    tokens_per_minute: float | None | UnsetType = UNSET
    max_queue: int | UnsetType = UNSET
    swap: str | None | UnsetType = UNSET  # null: all of scheduler.swap_space
    host_quota: str | None | UnsetType = UNSET  # null: all of pool.host_size


class FaultsBody(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    spec: str


class ModeBody(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    mode: BudgetMode


class PolicyBody(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    policy: SharingPolicy


class PrefixBody(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    name: str
    text: str | None = None  # tokenized like a completion prompt
    tokens: list[int] | None = None
    chat_system: str | None = None  # a chat system message, as chat requests render it


class Admin:
    def __init__(
        self,
        config: Config,
        context: ServerContext,
        store: StateStore,
        describe_device: Callable[[], str],
    ) -> None:
        self.config = config
        self.context = context
        self._live: LiveState | None = None  # set once the model is loaded
        self.store = store
        self._describe_device = describe_device
        self._device: str | None = None
        self.started = time.monotonic()
        self._changing = trio.Lock()  # one change at a time, file writes in order
        # Set when the start restored a state file: its path, and the config
        # sections it replaced with different values.
        self.restored: dict[str, Any] | None = None
        # The engine failures recorded beside the state file (the last one's
        # time and cause, and how many), read at start.
        self.failures: dict[str, Any] | None = None

    @property
    def device(self) -> str:
        if self._device is None:
            self._device = self._describe_device()
        return self._device

    @property
    def live(self) -> LiveState:
        if self._live is None:
            raise self.not_ready()
        return self._live

    @live.setter
    def live(self, value: LiveState) -> None:
        self._live = value

    @property
    def runtime(self) -> Any:
        runtime = self.context.runtime
        if runtime is None or runtime.failure is not None:
            raise self.not_ready()
        return runtime

    def not_ready(self) -> AdminError:
        """Why the daemon cannot take admin commands now, for kvctl to say."""
        server = self.context.status
        failure = self.context.runtime.failure if self.context.runtime is not None else None
        if failure is not None or server.status is Status.FAILED:
            message = (
                f"the engine failed ({failure or server.detail}); the daemon is exiting "
                "so that its supervisor restarts it"
            )
            status = str(Status.FAILED)
        else:
            message = f"the daemon is {server}" + (f": {server.detail}" if server.detail else "")
            status = str(server)
        return AdminError(
            503, message, state=status, reason=server.detail, last_failure=self.failures
        )

    # -- reading -------------------------------------------------------------------

    async def status(self) -> dict[str, Any]:
        try:
            return await self.runtime.call(self._status, quiet=False)  # type: ignore[no-any-return]
        except EngineFailed:
            raise self.not_ready() from None

    def _status(self) -> dict[str, Any]:
        runtime = self.runtime
        scheduler = runtime.scheduler
        kv = scheduler.kv
        stats = scheduler.stats()
        runtime.snapshot = stats  # fresh figures for /metrics too
        rates = scheduler.rates
        kv_stats = stats.kv
        query, hit = kv_stats.prefix_query_tokens, kv_stats.prefix_hit_tokens
        return {
            "version": __version__,
            "pid": os.getpid(),
            "uptime_s": round(time.monotonic() - self.started, 1),
            "device": self.device,
            "model": {
                "name": self.context.model_name,
                "source": self.config.model.source,
                "dtype": self.config.model.dtype,
                "quantization": self.context.quantization,
                "weight_bytes": self.context.weight_bytes,
                "kv_dtype": kv.layout.geometry.dtype,
                "max_model_len": self.config.model.max_model_len,
            },
            "pool": {
                "pages": kv_stats.capacity_pages,
                "page_bytes": kv_stats.page_bytes,
                "referenced": kv_stats.referenced_pages,
                "cached": kv_stats.cached_pages,
                "free": kv_stats.free_pages,
                "reserved": kv_stats.reserved_pages,
                # What a router following the KV events indexes (global: full attention).
                "findable_blocks": kv.findable_blocks(),
            },
            "hosts": self.context.hosts,
            "state": {"file": str(self.store.path), "restored": self.restored},
            "engine_failures": self.failures,
            "budget_mode": str(kv.mode),
            "sharing_policy": str(kv.policy),
            "draining": self.context.status.status is Status.DRAINING,
            "in_flight": runtime.in_flight,
            "requests": {
                "running": stats.running,
                "waiting": stats.waiting,
                "swapped": stats.swapped,
            },
            "prefix_cache": {
                "query_tokens": query,
                "hit_tokens": hit,
                "hit_rate": round(hit / query, 4) if query else 0.0,
                "device_hit_tokens": hit - kv_stats.host_hit_tokens,
                "host_hit_tokens": kv_stats.host_hit_tokens,
            },
            "host": {
                "pages": kv_stats.host_pages,
                "bytes": kv_stats.host_pages * kv.layout.page_bytes,
                "cached_pages": kv_stats.host_cached_pages,
                "swap_pages": kv_stats.host_swap_pages,
                "offloads": kv_stats.host_offloads,
                "evictions": kv_stats.host_evictions,
            },
            "rates": None
            if rates is None
            else {
                "prefill_tokens_per_s": round(rates.prefill_tokens_per_s, 1),
                "copy_bytes_per_s": round(rates.copy_bytes_per_s),
                "crossover_tokens": rates.crossover_tokens(),
            },
            "tenants": self._tenants(stats),
            "prefixes": self._prefixes(),
        }

    def _tenants(self, stats: Any) -> list[dict[str, Any]]:
        scheduler = self.context.runtime.scheduler  # type: ignore[union-attr]
        out = []
        for entry in self.live.tenants:
            config = scheduler.book.tenants[entry.name]
            tenant = stats.tenants[entry.name]
            out.append(
                {
                    "name": entry.name,
                    "tier": config.tier,
                    "weight": config.weight,
                    "reservation": entry.reservation,
                    "burst_cap": entry.burst_cap,
                    "reservation_pages": config.reservation_pages,
                    "cap_pages": config.cap_pages,
                    "charged_pages": tenant.charged_pages,
                    "surplus_pages": tenant.surplus_pages,
                    "running": tenant.running,
                    "waiting": tenant.waiting,
                    "swapped": tenant.swapped,
                    "swap": entry.swap,
                    "swap_pages": config.swap_pages,
                    "host_swap_pages": tenant.host_swap_pages,
                    "host_quota": entry.host_quota,
                    "host_quota_pages": config.host_quota_pages,
                    "host_cached_pages": tenant.host_cached_pages,
                    "requests_per_minute": entry.requests_per_minute,
                    "tokens_per_minute": entry.tokens_per_minute,
                    "max_queue": entry.max_queue,
                    "prompt_tokens": tenant.prompt_tokens,
                    "completion_tokens": tenant.completion_tokens,
                    "cached_tokens": tenant.cached_tokens,
                    "preempted_recompute": tenant.preempted_recompute,
                    "preempted_swap": tenant.preempted_swap,
                    "rate_limited": tenant.rate_limited,
                }
            )
        return out

    def _prefixes(self) -> list[dict[str, Any]]:
        hits = self.context.runtime.scheduler.prefix_hits  # type: ignore[union-attr]
        out = []
        for prefix in self.live.prefixes:
            requests, served, tokens = hits.get(prefix.name, [0, 0, 0])
            out.append(
                {
                    "name": prefix.name,
                    "tokens": len(prefix.tokens),
                    "requests": requests,
                    "hits": served,
                    "hit_tokens": tokens,
                }
            )
        return out

    # -- changing ------------------------------------------------------------------

    async def change(
        self,
        op: str,
        detail: dict[str, Any],
        apply: Callable[[], Callable[[], None]],
        publish: Callable[[], None] | None = None,
    ) -> dict[str, Any]:
        """Apply a change at a step boundary, persist it, audit it; the reply
        comes once the state file holds it.

        ``apply`` validates and applies (raising ValueError to refuse, with
        nothing changed) and returns the function that undoes it; what must
        not be seen before the change is durable (a new tenant's key) goes in
        ``publish``, run after the write. Only the apply and a snapshot of the
        state run on the step loop; the file is written (and fsynced) in a
        worker thread, so neither HTTP nor the engine waits for the disk.
        Changes are serialised, so the file always ends with the last one; a
        write that fails undoes its own change before the next starts. The
        whole is shielded: a client that hangs up cannot leave a change
        applied but not saved."""
        async with self._changing:
            with trio.CancelScope(shield=True):
                await self._change(op, detail, apply)
        if publish is not None:
            publish()
        log.info("admin.audit", op=op, **detail)
        return {"ok": True, "op": op}

    async def _change(
        self, op: str, detail: dict[str, Any], apply: Callable[[], Callable[[], None]]
    ) -> None:
        undo: list[Callable[[], None]] = []
        audit: list[list[AuditEntry]] = []

        def run() -> bytes:
            undo.append(apply())
            audit.append(self.live.audit)
            entry = AuditEntry(datetime.now(UTC).isoformat(timespec="seconds"), op, detail)
            self.live.audit = [*audit[0], entry][-AUDIT_KEPT:]
            return self.store.encode(self.live)

        try:
            body = await self.runtime.call(run)
        except (ValueError, ConfigError) as exc:
            raise AdminError(409, str(exc)) from None
        except EngineFailed:
            raise self.not_ready() from None
        try:
            await self._write(body)
        except OSError as exc:

            def revert() -> None:
                undo[0]()
                self.live.audit = audit[0]

            try:
                await self.runtime.call(revert)
            except (EngineFailed, AdminError):
                raise self.not_ready() from None  # nothing is live any more to be unsaved
            except Exception as undo_failed:  # noqa: BLE001  # reported, with both causes
                log.error("admin.undo_failed", op=op, error=str(undo_failed))
                raise AdminError(
                    500,
                    f"the state file could not be written ({exc}), and undoing the change "
                    f"failed ({undo_failed}): it is live but not saved; a restart loses it",
                ) from None
            raise AdminError(
                500, f"the change was undone: the state file could not be written: {exc}"
            ) from None

    async def _write(self, body: bytes) -> None:
        """The state file's bytes to disk in a worker thread (fsyncs must not
        pause the event loop)."""
        await trio.to_thread.run_sync(self.store.write, body)

    def _entry(self, name: str) -> tuple[int, TenantEntry]:
        for i, entry in enumerate(self.live.tenants):
            if entry.name == name:
                return i, entry
        raise AdminError(404, f"no tenant {name!r}")

    def _checked(self, tenants: list[TenantEntry]) -> None:
        """The same checks as the configuration file's, on the changed list."""
        config = msgspec.structs.replace(self.config, tenants=tenants)
        try:
            validate(config)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None

    def _tenant_config(self, entry: TenantEntry) -> Any:
        kv = self.runtime.scheduler.kv
        return tenant_config(self.config, entry, kv.layout.page_bytes, kv.stats().capacity_pages)

    async def tenant_add(self, entry: TenantEntry) -> dict[str, Any]:
        if any(t.name == entry.name for t in self.live.tenants):
            raise AdminError(409, f"tenant {entry.name!r} already exists")

        def apply() -> Callable[[], None]:
            if any(t.name == entry.name for t in self.live.tenants):
                raise ValueError(f"tenant {entry.name!r} already exists")
            tenants = [*self.live.tenants, entry]
            self._checked(tenants)
            scheduler = self.runtime.scheduler
            scheduler.set_tenant(self._tenant_config(entry))
            old_tenants = self.live.tenants
            self.live.tenants = tenants

            def undo() -> None:  # no request can have come: the key is not out yet
                self.live.tenants = old_tenants
                scheduler.remove_tenant(entry.name)

            return undo

        def publish() -> None:
            self.context.keys[entry.api_key_sha256] = _access(self.config, entry)

        return await self.change("tenant.add", _redacted(entry), apply, publish)

    async def tenant_set(self, name: str, patch: TenantPatch) -> dict[str, Any]:
        changes = {k: v for k, v in msgspec.structs.asdict(patch).items() if v is not UNSET}
        if not changes:
            raise AdminError(400, "nothing to change")
        self._entry(name)  # 404 early; looked up again at the step boundary

        def apply() -> Callable[[], None]:
            index, old = self._entry(name)
            new = msgspec.structs.replace(old, **changes)
            tenants = list(self.live.tenants)
            tenants[index] = new
            self._checked(tenants)
            scheduler = self.runtime.scheduler
            scheduler.set_tenant(self._tenant_config(new))
            old_tenants = self.live.tenants
            self.live.tenants = tenants
            keys = self.context.keys
            keys.pop(old.api_key_sha256, None)
            keys[new.api_key_sha256] = _access(self.config, new)

            def undo() -> None:
                self.live.tenants = old_tenants
                keys.pop(new.api_key_sha256, None)
                keys[old.api_key_sha256] = _access(self.config, old)
                scheduler.set_tenant(self._tenant_config(old))

            return undo

        detail = {"name": name} | {
            k: ("<redacted>" if k == "api_key_sha256" else v) for k, v in changes.items()
        }
        return await self.change("tenant.set", detail, apply)

    async def tenant_remove(self, name: str) -> dict[str, Any]:
        self._entry(name)

        def apply() -> Callable[[], None]:
            _, old = self._entry(name)
            if len(self.live.tenants) == 1:
                raise ValueError("cannot remove the last tenant")
            scheduler = self.runtime.scheduler
            scheduler.remove_tenant(name)  # refuses while the tenant has live requests
            # Its cached prompts must not serve a tenant added later under the
            # same name: forget every page nobody uses.
            scheduler.flush_cache()
            old_tenants = self.live.tenants
            self.live.tenants = [t for t in old_tenants if t.name != name]
            self.context.keys.pop(old.api_key_sha256, None)

            def undo() -> None:
                self.live.tenants = old_tenants
                self.context.keys[old.api_key_sha256] = _access(self.config, old)
                scheduler.set_tenant(self._tenant_config(old))

            return undo

        return await self.change("tenant.remove", {"name": name}, apply)

    async def set_mode(self, mode: BudgetMode) -> dict[str, Any]:
        def apply() -> Callable[[], None]:
            kv = self.runtime.scheduler.kv
            old = kv.mode
            kv.set_mode(mode)
            self.live.mode = mode

            def undo() -> None:
                kv.set_mode(old)
                self.live.mode = old

            return undo

        return await self.change("budget.mode", {"mode": str(mode)}, apply)

    async def set_policy(self, policy: SharingPolicy) -> dict[str, Any]:
        def apply() -> Callable[[], None]:
            kv = self.runtime.scheduler.kv
            old = kv.policy
            kv.set_policy(policy)
            self.live.policy = policy

            def undo() -> None:
                kv.set_policy(old)
                self.live.policy = old

            return undo

        return await self.change("sharing.policy", {"policy": str(policy)}, apply)

    async def prefix_add(self, body: PrefixBody) -> dict[str, Any]:
        if sum(value is not None for value in (body.text, body.tokens, body.chat_system)) != 1:
            raise AdminError(400, "give exactly one of text, tokens, chat_system")
        if not body.name or len(body.name) > 128:
            raise AdminError(400, "a prefix name is 1 to 128 characters")
        tokenizer = self.context.tokenizer
        if body.text is not None:
            assert tokenizer is not None
            tokens = tokenizer.encode(body.text)
        elif body.chat_system is not None:
            assert tokenizer is not None
            tokens = tokenizer.chat_system_prefix(body.chat_system)
        else:
            tokens = list(body.tokens or [])
        vocab = self.context.vocab_size
        if any(not 0 <= t < vocab for t in tokens):
            raise AdminError(400, f"token ids must be in 0..{vocab - 1}")
        prefix = PrefixTokens(body.name, tokens)

        def apply() -> Callable[[], None]:
            kv = self.runtime.scheduler.kv
            kv.add_public_prefix(prefix.name, prefix.tokens)  # refuses a name in use
            self.live.prefixes = [*self.live.prefixes, prefix]

            def undo() -> None:
                kv.remove_public_prefix(prefix.name)
                self.live.prefixes = self.live.prefixes[:-1]

            return undo

        return await self.change("prefix.add", {"name": body.name, "tokens": len(tokens)}, apply)

    async def prefix_remove(self, name: str) -> dict[str, Any]:
        if not any(p.name == name for p in self.live.prefixes):
            raise AdminError(404, f"no public prefix {name!r}")

        def apply() -> Callable[[], None]:
            kv = self.runtime.scheduler.kv
            old = self.live.prefixes
            removed = next((p for p in old if p.name == name), None)
            if removed is None:
                raise ValueError(f"no public prefix {name!r}")
            kv.remove_public_prefix(name)
            self.live.prefixes = [p for p in old if p.name != name]

            def undo() -> None:
                kv.add_public_prefix(removed.name, removed.tokens)
                self.live.prefixes = old

            return undo

        return await self.change("prefix.remove", {"name": name}, apply)

    async def flush(self) -> dict[str, Any]:
        freed: list[int] = []

        def apply() -> Callable[[], None]:
            freed.append(self.runtime.scheduler.flush_cache())
            return lambda: None  # nothing to undo: a flush only forgets a cache

        result = await self.change("cache.flush", {}, apply)
        return result | {"freed_pages": freed[0]}

    async def drain(self) -> dict[str, Any]:
        self.runtime  # noqa: B018  # refused once the engine has failed
        try:
            self.context.status.drain()
        except StatusError as exc:
            raise AdminError(409, str(exc)) from None
        log.info("admin.audit", op="drain", in_flight=self.runtime.in_flight)
        await self._audit_only("drain")
        return {"ok": True, "op": "drain", "in_flight": self.runtime.in_flight}

    async def undrain(self) -> dict[str, Any]:
        self.runtime  # noqa: B018  # refused once the engine has failed
        try:
            self.context.status.undrain()
        except StatusError as exc:
            raise AdminError(409, str(exc)) from None
        log.info("admin.audit", op="undrain")
        await self._audit_only("undrain")
        return {"ok": True, "op": "undrain"}

    async def _audit_only(self, op: str) -> None:
        """Drain state is not persisted (a restart serves again), but audited."""
        async with self._changing:
            entry = AuditEntry(datetime.now(UTC).isoformat(timespec="seconds"), op, {})
            self.live.audit = [*self.live.audit, entry][-AUDIT_KEPT:]
            try:
                await self._write(self.store.encode(self.live))
            except OSError as exc:
                log.error("admin.state_write_failed", error=str(exc))


def _access(config: Config, entry: TenantEntry) -> TenantAccess:
    return TenantAccess(entry.name, entry.tier or config.tiers[0])


def _redacted(entry: TenantEntry) -> dict[str, Any]:
    detail = msgspec.to_builtins(entry)
    detail["api_key_sha256"] = "<redacted>"
    return detail


def _decode(body: bytes, kind: type[Any]) -> Any:
    try:
        return msgspec.json.decode(body, type=kind)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise AdminError(400, f"bad request body: {exc}") from None


def create_admin_app(admin: Admin) -> QuartTrio:
    app = QuartTrio("kvd-admin")
    app.config["MAX_CONTENT_LENGTH"] = 16 * 1024 * 1024

    def reply(body: Any, status: int = 200) -> Response:
        return Response(_encoder.encode(body), status, content_type="application/json")

    @app.errorhandler(AdminError)
    async def admin_error(exc: AdminError) -> Response:
        return reply({"error": str(exc), **exc.fields}, exc.status)

    @app.errorhandler(HTTPException)
    async def http_error(exc: HTTPException) -> Response:
        return reply(
            {"error": f"{exc.code} {exc.name}: {request.method} {request.path}"}, exc.code or 500
        )

    async def body(kind: type[Any]) -> Any:
        data = await request.get_data(cache=False)
        assert isinstance(data, bytes)
        return _decode(data, kind)

    @app.get("/v1/status")
    async def status() -> Response:
        return reply(await admin.status())

    if faults.testing():
        # The test suite's hook (KVD_FAULTS with KVD_TESTING=1): arm faults in
        # a running daemon, counted afresh. Absent (404) in any other daemon.
        @app.post("/v1/faults")
        async def arm_faults() -> Response:
            spec = (await body(FaultsBody)).spec
            try:
                faults.armed = faults.parse(spec)
            except faults.FaultSpecError as exc:
                raise AdminError(400, str(exc)) from None
            log.warning("faults.armed", faults=str(faults.armed))
            return reply({"ok": True, "faults": str(faults.armed)})

    @app.get("/v1/tenants")
    async def tenants() -> Response:
        return reply((await admin.status())["tenants"])

    @app.post("/v1/tenants")
    async def tenant_add() -> Response:
        return reply(await admin.tenant_add(await body(TenantEntry)), 201)

    @app.patch("/v1/tenants/<name>")
    async def tenant_set(name: str) -> Response:
        return reply(await admin.tenant_set(name, await body(TenantPatch)))

    @app.delete("/v1/tenants/<name>")
    async def tenant_remove(name: str) -> Response:
        return reply(await admin.tenant_remove(name))

    @app.get("/v1/budget")
    async def budget() -> Response:
        return reply({"mode": str(admin.live.mode)})

    @app.put("/v1/budget")
    async def budget_set() -> Response:
        return reply(await admin.set_mode((await body(ModeBody)).mode))

    @app.get("/v1/sharing")
    async def sharing() -> Response:
        return reply({"policy": str(admin.live.policy)})

    @app.put("/v1/sharing")
    async def sharing_set() -> Response:
        return reply(await admin.set_policy((await body(PolicyBody)).policy))

    @app.get("/v1/prefixes")
    async def prefixes() -> Response:
        return reply((await admin.status())["prefixes"])

    @app.post("/v1/prefixes")
    async def prefix_add() -> Response:
        return reply(await admin.prefix_add(await body(PrefixBody)), 201)

    @app.delete("/v1/prefixes/<name>")
    async def prefix_remove(name: str) -> Response:
        return reply(await admin.prefix_remove(name))

    @app.post("/v1/flush")
    async def flush() -> Response:
        return reply(await admin.flush())

    @app.post("/v1/drain")
    async def drain() -> Response:
        return reply(await admin.drain())

    @app.post("/v1/undrain")
    async def undrain() -> Response:
        return reply(await admin.undrain())

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(
            admin.context.metrics.render(), 200, content_type="text/plain; version=0.0.4"
        )

    @app.get("/v1/audit")
    async def audit() -> Response:
        return reply(msgspec.to_builtins(admin.live.audit))

    return app
