"""Tensor parallelism on simulated devices: one subprocess with
``--xla_force_host_platform_device_count=4`` (the device count is fixed when
JAX starts, so it cannot be changed inside this test process) runs every
case, one JAX start and one compile cache for them all."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import TEST_XLA_FLAGS

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"{TEST_XLA_FLAGS} --xla_force_host_platform_device_count=4"
    env["JAX_PLATFORMS"] = "cpu"
    result = subprocess.run(
        [sys.executable, "-m", "tests.engine.tp_check"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["devices"] == 4
    return out


@pytest.mark.parametrize("devices", ["2", "4"])
def test_sharded_logits_match_single_device(devices: str, report: dict[str, Any]) -> None:
    entry = report["tiny"][devices]
    assert entry["param_shards"] == int(devices)  # the weights really are split
    # The pool is split by KV head when they divide evenly (6 over 2), else
    # replicated (6 over 4).
    assert entry["pool_split"] == (devices == "2")
    assert entry["swap_roundtrip"]  # pages out to the host and back in, intact
    # Sharded matmuls sum in another order: f32 rounding of logits of
    # magnitude ~10 (1.5e-5 seen once the pages the step used moved).
    assert entry["max_logit_diff"] < 5e-5, entry  # a decode step of 3 sequences, 2 past the window
    assert entry["max_logprob_diff"] < 1e-5, entry
    assert entry["same_tokens"], entry  # 30 decode steps, past the 12-token window


def test_int8_weights_split_with_their_scales(report: dict[str, Any]) -> None:
    entry = report["tiny_int8"]["2"]
    assert entry["param_shards"] == 2  # the int8 values split (their scales with them)
    assert entry["swap_roundtrip"]
    assert entry["max_logit_diff"] < 5e-5, entry
    assert entry["max_logprob_diff"] < 1e-5, entry
    assert entry["same_tokens"], entry


def test_real_model_greedy_is_unchanged_under_sharding(report: dict[str, Any]) -> None:
    assert report["real"]["2"]["same_tokens"], report["real"]
    assert report["real"]["2"]["param_shards"] == 2


def test_a_tensor_parallel_daemon_answers_the_same(report: dict[str, Any]) -> None:
    """The daemon's own load path with ``tensor_parallel = 2``, over HTTP:
    the greedy text of the single-device engine."""
    assert report["server"]["same_text"], report["server"]
    assert all(report["server"]["texts"])
