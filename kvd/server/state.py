"""The live state operators change through the admin API, persisted.

What kvctl can change (tenants, budget mode, sharing policy, public prefixes)
and the audit log are written to one JSON file after every change: a
temporary file, fsync, rename over the old one, fsync of the directory, so a
crash leaves the old file or the new one, never a mix. The file carries a
SHA-256 of its content: a truncated or edited file is detected and refused
with a clear error, never silently ignored. The previous good file is kept
beside it (``.prev``) so an operator can roll back.

When the file exists, it overrides those sections of the configuration on
start; everything else (model, pool, listen address) comes from the config.

Beside it, ``<state file>.failures`` records the engine's failures (how many,
the last one's time and cause), so a daemon its supervisor restarted can say
why it was restarted.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec

from kvd import faults
from kvd.kv.ledger import BudgetMode
from kvd.kv.scope import SharingPolicy
from kvd.server.config import Config, TenantEntry

FORMAT = "kvd-state/1"
AUDIT_KEPT = 256


class StateError(ValueError):
    """The state file is unreadable or corrupt; the message says what to do."""


class PrefixTokens(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    name: str
    tokens: list[int]


class AuditEntry(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    at: str  # ISO 8601, UTC
    op: str
    detail: dict[str, Any]


class LiveState(msgspec.Struct, forbid_unknown_fields=True):
    tenants: list[TenantEntry]
    mode: BudgetMode
    policy: SharingPolicy
    prefixes: list[PrefixTokens]
    audit: list[AuditEntry] = msgspec.field(default_factory=list)


class EngineFailures(msgspec.Struct, forbid_unknown_fields=True):
    count: int
    last_at: str  # ISO 8601, UTC
    last_cause: str


class _File(msgspec.Struct, forbid_unknown_fields=True):
    format: str
    sha256: str
    state: msgspec.Raw


def _digest(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


class StateStore:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.previous = path.with_name(path.name + ".prev")
        self.failures_path = path.with_name(path.name + ".failures")

    def load_failures(self) -> EngineFailures | None:
        """The engine failures recorded so far (None: none, or unreadable:
        a record of past failures must never stop a start)."""
        try:
            return msgspec.json.decode(self.failures_path.read_bytes(), type=EngineFailures)
        except (OSError, msgspec.DecodeError, msgspec.ValidationError):
            return None

    def record_failure(self, cause: str) -> EngineFailures:
        """Count an engine failure on disk (durably: the process exits next)."""
        before = self.load_failures()
        record = EngineFailures(
            (before.count if before else 0) + 1,
            datetime.now(UTC).isoformat(timespec="seconds"),
            cause,
        )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._write(self.failures_path, msgspec.json.encode(record))
        return record

    def load(self) -> LiveState | None:
        """The saved state, None if there is none; raises StateError if corrupt."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StateError(f"{self.path}: cannot read the state file: {exc}") from None
        try:
            wrapper = msgspec.json.decode(data, type=_File)
            if wrapper.format != FORMAT:
                raise ValueError(f"unknown format {wrapper.format!r} (expected {FORMAT})")
            raw = bytes(wrapper.state)
            if _digest(raw) != wrapper.sha256:
                raise ValueError("its checksum does not match its content")
            return msgspec.json.decode(raw, type=LiveState)
        except (msgspec.DecodeError, ValueError) as exc:
            hint = (
                f"the previous good state is in {self.previous}: move it into place to use it"
                if self.previous.exists()
                else "there is no previous good state"
            )
            raise StateError(
                f"{self.path}: the state file is corrupt ({exc}); kvd will not start from it. "
                f"{hint}, or remove the file to start from the configuration"
            ) from None

    def save(self, state: LiveState) -> None:
        self.write(self.encode(state))

    @staticmethod
    def encode(state: LiveState) -> bytes:
        """The file's bytes for ``state``: a snapshot, cheap to take at a
        step boundary; ``write`` (disk, fsync) can then run anywhere."""
        raw = msgspec.json.encode(state)
        return msgspec.json.encode(
            {"format": FORMAT, "sha256": _digest(raw), "state": msgspec.Raw(raw)}
        )

    def write(self, body: bytes) -> None:
        """Make ``body`` the state file, durably; the old good one becomes
        the previous. Blocking: call it from a worker thread."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        injected = faults.fire("statefile")
        if self.path.exists():
            try:
                self.load()
            except StateError:
                pass  # never keep a corrupt file as the "previous good" one
            else:
                self._write(self.previous, self.path.read_bytes())
        self._write(self.path, body, injected)

    def _write(self, target: Path, body: bytes, injected: str | None = None) -> None:
        """``body`` into ``target`` through a temporary file that a failure
        removes: the target is the old file or the new one, never a part."""
        temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        if injected == "readonly":
            raise OSError(errno.EROFS, f"{os.strerror(errno.EROFS)} (injected)", str(temporary))
        try:
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                if injected == "enospc":  # the disk fills part of the way through
                    os.write(fd, body[: len(body) // 2])
                    raise OSError(
                        errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (injected)", str(temporary)
                    )
                view = memoryview(body)
                while view:  # a short write is not an error: write the rest
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(temporary, target)
        except BaseException:
            with contextlib.suppress(OSError):  # a read-only disk: the first error says it
                temporary.unlink(missing_ok=True)
            raise
        directory = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)


def overridden(config: Config, saved: LiveState) -> list[str]:
    """The config's settings that a saved state replaces with different
    values (prefixes compared by name: the config's are not tokenized yet)."""
    differs = []
    if msgspec.json.encode(saved.tenants) != msgspec.json.encode(config.tenants):
        differs.append("tenants")
    if saved.mode != config.budget.mode:
        differs.append("budget.mode")
    if saved.policy != config.sharing.policy:
        differs.append("sharing.policy")
    if [p.name for p in saved.prefixes] != [p.name for p in config.prefixes]:
        differs.append("prefixes")
    return differs


def from_config(config: Config, prefixes: list[PrefixTokens]) -> LiveState:
    return LiveState(
        tenants=list(config.tenants),
        mode=config.budget.mode,
        policy=config.sharing.policy,
        prefixes=prefixes,
    )
