"""Every run has its own kvd cache directory (``KVD_CACHE_DIR``: the
assembled embedded model, built tokenizers, XLA's compiled programs): every
engine and daemon a test process starts reuses what an earlier one built,
and nothing is read from or written to the user's own cache, so a run is the
same on a fresh machine as on a used one.

Each test process (pytest-xdist's workers, or the one process of a run
without them) has a directory of its own inside the run's, and the daemons
it starts use it too. Only the assembled model is shared between them (a
``models`` link to one directory): it is written under a file lock and by
rename. XLA's cache writes its entries in place, so a worker reading one
that another is still writing would see it damaged: they are not shared.
The run's directory is removed when the run ends, and so is the directory
under /tmp where the tests make their sockets' directories (``short_dir``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

_RUN_CACHE = "KVD_TEST_RUN_CACHE"

# XLA's LLVM back end at -O0 in the test processes (and the tensor-parallel
# subprocess): their engines are tiny, so compiling is most of their cost, and
# -O0 compiles a third faster (tests/engine/test_parity.py: 152 s at the
# default, 113 s at -O0, same results). Only LLVM's passes change: XLA's own
# graph passes, its fusions and its library matmuls are the same, and without
# fast-math LLVM keeps IEEE results at every level. The daemons the tests start
# keep XLA's defaults: they are the process as shipped, and some generate for
# long (at -O0 the tiny model's sampling over 262k tokens ran too slowly for
# the drain test's 600 tokens on a busy machine).
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"
_MADE_BY = "KVD_TEST_RUN_CACHE_MADE_BY"
_SHORT = "KVD_TEST_SHORT_DIR"


def short_dir(prefix: str = "kvd-") -> str:
    """A new directory with a short path, for Unix sockets (a socket's path
    is limited to 107 bytes, and pytest's own temporary paths are long):
    inside the run's directory under /tmp, removed when the run ends."""
    return tempfile.mkdtemp(prefix=prefix, dir=os.environ[_SHORT])


def pytest_configure(config: pytest.Config) -> None:
    # torch's oracles on one thread: beside another worker, a daemon or a
    # busy machine, its OpenMP threads spin against each other (transformers'
    # greedy generation on the 270M measured 3.8x slower on two threads than
    # on one with one busy loop beside it, 91.8 s against 24.1 s).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("XLA_FLAGS", TEST_XLA_FLAGS)  # read when JAX starts: before any test
    base = os.environ.get(_RUN_CACHE)
    if base is None:  # the controlling process: xdist's workers inherit its environment
        base = tempfile.mkdtemp(prefix="kvd-test-cache-")
        os.environ[_RUN_CACHE] = base
        short = tempfile.mkdtemp(prefix="kvd-run-", dir="/tmp")
        # Traversable by anyone, as /tmp is: a test that probes a socket as
        # another user opens only the socket's own directory to it.
        os.chmod(short, 0o755)
        os.environ[_SHORT] = short
        os.environ[_MADE_BY] = str(os.getpid())
    own = Path(base) / os.environ.get("PYTEST_XDIST_WORKER", "main")
    own.mkdir(exist_ok=True)
    models = Path(base) / "models"
    models.mkdir(exist_ok=True)
    if not (own / "models").exists():
        (own / "models").symlink_to(models, target_is_directory=True)
    os.environ["KVD_CACHE_DIR"] = str(own)
    # Every engine of this process compiles into the process's own cache
    # (JAX's cache is process-wide: the entry point enables it, as kvd's
    # commands do; XLA_FLAGS is set above, before JAX starts).
    from kvd.engine import compile_cache

    compile_cache.enable_default()


# Modules that take minutes, first: xdist hands whole modules out in
# collection order (scripts/test.sh turns its reordering by test count off),
# so the long ones start at once and the workers finish together.
LONG_MODULES = (
    "tests/e2e/test_real_270m.py",
    "tests/e2e/test_multihost.py",
    "tests/engine/test_tensor_parallel.py",
    "tests/server/test_processes.py",
    "tests/experiments/test_experiments.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        path = item.nodeid.split("::", 1)[0]
        return LONG_MODULES.index(path) if path in LONG_MODULES else len(LONG_MODULES)

    items.sort(key=rank)  # stable: each module keeps its own order


def pytest_unconfigure(config: pytest.Config) -> None:
    if os.environ.get(_MADE_BY) == str(os.getpid()):
        shutil.rmtree(os.environ[_RUN_CACHE], ignore_errors=True)
        shutil.rmtree(os.environ[_SHORT], ignore_errors=True)


@pytest.fixture(scope="session")
def kvd_cache() -> Path:
    return Path(os.environ["KVD_CACHE_DIR"])


@pytest.fixture(scope="session")
def daemon_env(kvd_cache: Path) -> dict[str, str]:
    """The environment of the daemons the tests start: this process's cache,
    JAX on the CPU with one device and XLA's default flags."""
    env = dict(os.environ)
    env["KVD_CACHE_DIR"] = str(kvd_cache)
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("XLA_FLAGS", None)
    return env
