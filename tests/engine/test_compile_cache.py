"""The compile cache's own failure modes (the daemon-level row is in
tests/server/test_faults.py): a directory that cannot be one, and entries
that cannot be read, in a fresh process each (JAX's cache is process-wide)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

PROGRAM = """
import sys
from pathlib import Path
import jax, jax.numpy as jnp
from kvd.engine import compile_cache
print("enabled", compile_cache.enable(Path(sys.argv[1])))
f = jax.jit(lambda x: x * 3 + 1)
print("result", f(jnp.arange(4)).tolist(), f(jnp.arange(5)).tolist())
"""


def run(directory: Path) -> str:
    result = subprocess.run(
        [sys.executable, "-c", PROGRAM, str(directory)],
        capture_output=True,
        text=True,
        timeout=120,
        env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr
    return result.stdout + result.stderr


def test_a_file_where_the_cache_directory_should_be_is_not_used(tmp_path: Path) -> None:
    (tmp_path / "xla").write_text("not a directory")
    out = run(tmp_path / "xla")
    assert "enabled False" in out and "engine.compile_cache_unusable" in out
    assert "result [1, 4, 7, 10] [1, 4, 7, 10, 13]" in out
    assert (tmp_path / "xla").read_text() == "not a directory"  # left as found


def test_unreadable_entries_are_replaced_by_fresh_ones(tmp_path: Path) -> None:
    cache = tmp_path / "xla"
    assert "enabled True" in run(cache)
    entries = sorted(p.name for p in cache.iterdir())
    for entry in cache.iterdir():
        entry.write_bytes(b"garbage")
    out = run(cache)
    assert "engine.compile_cache_entry_dropped" in out
    assert "result [1, 4, 7, 10] [1, 4, 7, 10, 13]" in out
    assert sorted(p.name for p in cache.iterdir()) == entries
    assert all(p.read_bytes() != b"garbage" for p in cache.iterdir())
    # And the next process reads them without a word.
    assert "compile_cache_entry_dropped" not in run(cache)


def test_only_the_damaged_entry_of_a_program_goes(tmp_path: Path) -> None:
    cache = tmp_path / "xla"
    run(cache)
    shapes = sorted(p for p in cache.iterdir() if p.name.startswith("jit__lambda-"))
    assert len(shapes) == 2  # one program, two shape buckets
    damaged, intact = shapes
    damaged.write_bytes(damaged.read_bytes()[:20])  # truncated
    kept = intact.read_bytes()
    out = run(cache)
    assert "dropped=1" in out or '"dropped": 1' in out, out
    assert intact.read_bytes() == kept and intact.stat().st_size == len(kept)
    assert len(damaged.read_bytes()) > 20  # written again, whole
