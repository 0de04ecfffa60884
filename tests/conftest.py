"""The whole run shares one kvd cache directory (the assembled embedded
model, built tokenizers, XLA's compiled programs): every engine and daemon
the suite starts reuses what an earlier one built, and nothing is read from
or written to the user's own cache, so a run is the same on a fresh machine
as on a used one.

The directory is made before any test imports kvd, in the controlling
process; pytest-xdist's workers inherit the environment, so they share it
(the model is assembled under a file lock, cache entries are written by
rename). It is removed when the run ends.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

_MADE_HERE = "KVD_TEST_CACHE_MADE_BY"


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("KVD_CACHE_DIR") and os.environ.get(_MADE_HERE):
        return  # an xdist worker: the controller's directory
    os.environ["KVD_CACHE_DIR"] = tempfile.mkdtemp(prefix="kvd-test-cache-")
    os.environ[_MADE_HERE] = str(os.getpid())


def pytest_unconfigure(config: pytest.Config) -> None:
    if os.environ.get(_MADE_HERE) == str(os.getpid()):
        shutil.rmtree(os.environ["KVD_CACHE_DIR"], ignore_errors=True)


@pytest.fixture(scope="session")
def kvd_cache() -> Path:
    return Path(os.environ["KVD_CACHE_DIR"])


@pytest.fixture(scope="session")
def daemon_env(kvd_cache: Path) -> dict[str, str]:
    """The environment of the daemons the tests start: the run's cache, JAX
    on the CPU with one device (a tensor-parallel check sets its own)."""
    env = dict(os.environ)
    env["KVD_CACHE_DIR"] = str(kvd_cache)
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("XLA_FLAGS", None)
    return env
