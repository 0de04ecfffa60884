"""XLA's persistent compilation cache, and what kvd does when it is damaged.

A restart reads compiled programs from disk instead of compiling for minutes.
The cache is an optimisation, never a reason not to serve:

- a cache directory that cannot be made, listed, written or read (a file in
  its place, a full or read-only disk, wrong permissions) is not used: the
  start compiles everything, slower, and says why
  (``engine.compile_cache_unusable``);
- an entry that cannot be read (truncated, garbage) makes JAX compile that
  program again, but JAX never overwrites an entry that exists, so every
  later start would pay the same compile. As JAX reports one, kvd removes
  that program's entries that no longer decompress (all of its entries if
  none fails that way: JAX names the program, not the entry), logging
  ``engine.compile_cache_entry_dropped``; the compile that follows writes
  good ones.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import warnings
from pathlib import Path
from typing import Any

import jax
import structlog

log = structlog.get_logger("kvd")

_UNREADABLE = re.compile(r"Error reading persistent compilation cache entry for '([^']+)': (.*)")
_lock = threading.Lock()
_state: dict[str, Any] = {"directory": None, "hooked": False, "refused": set()}


def enable(directory: Path) -> bool:
    """Use ``directory`` for compiled programs if it works; False if not (logged once)."""
    with _lock:
        problem = _unusable(directory)
        if problem is not None:
            if str(directory) not in _state["refused"]:
                _state["refused"].add(str(directory))
                log.warning(
                    "engine.compile_cache_unusable",
                    path=str(directory),
                    error=problem,
                    effect="compiling every program at start, without the cache",
                )
            jax.config.update("jax_compilation_cache_dir", None)
            _state["directory"] = None
            return False
        jax.config.update("jax_compilation_cache_dir", str(directory))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        _state["directory"] = directory
        if not _state["hooked"]:
            _state["hooked"] = True
            _hook_warnings()
        return True


def enable_default() -> bool:
    """Use kvd's cache directory (``kvd.engine.loader.cache_dir()``, ``xla``
    in it). JAX's cache is process-wide, so the process's entry point calls
    this (``kvd serve``, ``kvd generate``, ``kvd bench``, ``kvd experiment``,
    the test session), not the engine it builds."""
    from kvd.engine.loader import cache_dir

    return enable(cache_dir() / "xla")


def _unusable(directory: Path) -> str | None:
    """Why ``directory`` cannot hold the cache, or None."""
    probe = directory / f".probe-{os.getpid()}-{threading.get_ident()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        os.listdir(directory)
        probe.write_bytes(b"kvd")
        if probe.read_bytes() != b"kvd":
            return "a file written there reads back different"
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        with contextlib.suppress(OSError):
            probe.unlink(missing_ok=True)
    return None


def _hook_warnings() -> None:
    shown = warnings.showwarning

    def showwarning(message: Any, category: Any, *args: Any, **kwargs: Any) -> None:
        match = _UNREADABLE.match(str(message))
        if match is None:
            shown(message, category, *args, **kwargs)
            return
        name, error = match.groups()
        log.warning(
            "engine.compile_cache_entry_dropped",
            program=name,
            error=error,
            dropped=_drop_entries(name),
            effect="compiled again; the fresh entry replaces it",
        )

    warnings.showwarning = showwarning
    # Every occurrence, not once per message: each damaged entry must be seen.
    warnings.filterwarnings("always", message="Error reading persistent compilation cache entry")


def _drop_entries(name: str) -> int:
    """Remove the damaged entries of program ``name`` (a module name: one
    per shape bucket; or a full key): those that no longer decompress, or,
    if the damage is deeper than that, all of them."""
    directory = _state["directory"]
    if directory is None:
        return 0
    try:
        candidates = [directory / e for e in os.listdir(directory) if e.startswith(f"{name}-")]
    except OSError:
        return 0
    damaged = [path for path in candidates if not _decompresses(path)]
    dropped = 0
    for path in damaged or candidates:
        with contextlib.suppress(OSError):
            path.unlink()
            dropped += 1
    return dropped


def _decompresses(path: Path) -> bool:
    try:
        from jax._src.compilation_cache import decompress_executable
    except ImportError:  # another JAX: take every entry of the program as damaged
        return False
    try:
        decompress_executable(path.read_bytes())
    except Exception:  # noqa: BLE001  # any failure to read it back is damage
        return False
    return True
