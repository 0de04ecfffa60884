"""``[distributed]`` and the lockstep's messages, without a second process:
each bad set-up is a one-line error, and a message decodes to what was sent
(tests/e2e/test_multihost.py runs two real processes)."""

from __future__ import annotations

import socket
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from click.testing import CliRunner

from kvd.cli import cli
from kvd.engine.lockstep import (
    GATHER,
    HEADER,
    MIN_PAYLOAD,
    STEP,
    LockstepError,
    decode,
    encode,
    payload_buckets,
)
from kvd.server.config import ConfigError, load_config
from kvd.server.config import resolve_distributed as resolve
from tests.server.conftest import DaemonEnv, serve_until_exit

KEY = "d93d17449c095335a72f8000357bd400fb42d2368421d771778fac8412bfae65"
TENANT = f'[[tenants]]\nname = "alice"\napi_key_sha256 = "{KEY}"\n'


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvd.toml"
    path.write_text(text + TENANT)
    return path


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ("num_processes = 2\nprocess_id = 0\n", "distributed.coordinator: missing"),
        ("coordinator = 'h'\nnum_processes = 2\n", "'h' is not HOST:PORT or 'auto'"),
        (
            "coordinator = 'h:1'\nnum_processes = 2\nprocess_id = 2\n",
            "distributed.process_id: 2 is out of range for 2 processes (0 to 1)",
        ),
        ("coordinator = 'h:1'\nnum_processes = 0\n", "num_processes: must be at least 1"),
        ("coordinator = 'auto'\nnum_processes = 2\n", "come from the runtime"),
        ("coordinator = 'h:1'\nnum_processes = 2\nheartbeat_timeout = 0\n", "must be > 0"),
        ("coordinator = 'h:1'\nnum_processes = 2\ncpu_collectives = 'tcp'\n", "gloo or mpi"),
        ("coordinator = 'h:1'\nnum_processes = 2\nprocesses = 2\n", "unknown field"),
    ],
)
def test_a_bad_set_is_one_line(tmp_path: Path, section: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, "[distributed]\n" + section))
    assert message in str(info.value), str(info.value)
    assert "\n" not in str(info.value)


def test_the_id_may_come_from_the_command_line(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, "[distributed]\ncoordinator='h:1'\nnum_processes=3\n"))
    assert config.distributed is not None
    assert resolve(config.distributed, 2) == ("h:1", 3, 2)
    with pytest.raises(ConfigError, match="process_id: missing"):
        resolve(config.distributed, None)
    with pytest.raises(ConfigError, match="3 is out of range"):
        resolve(config.distributed, 3)
    auto = load_config(write(tmp_path, "[distributed]\ncoordinator = 'auto'\n"))
    assert auto.distributed is not None
    assert resolve(auto.distributed, None) == (None, None, None)


def test_serve_refuses_a_process_id_without_a_set(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        cli, ["serve", "--config", str(write(tmp_path, "")), "--process-id", "1"]
    )
    assert result.exit_code == 2
    assert result.stderr.strip().endswith(
        "error: --process-id needs a [distributed] section in the configuration"
    )
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_set_whose_devices_do_not_match_the_model_is_one_line(
    tmp_path: Path, daemon_env: DaemonEnv
) -> None:
    """A real ``kvd serve`` joins a set of one process (one CPU device) and
    stops before loading anything: tensor parallel 4 cannot span it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = write(
        tmp_path,
        f"[model]\nsource = 'random'\ntensor_parallel = 4\n"
        f"[distributed]\ncoordinator = '127.0.0.1:{port}'\nnum_processes = 1\n",
    )
    result = serve_until_exit(config, daemon_env, "--process-id", "0")
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("kvd: error:")]
    assert errors == [
        "kvd: error: model.tensor_parallel: 4 does not match the 1 devices of the 1 "
        "processes (1 each); one model spans them all"
    ]


def test_a_message_decodes_to_what_was_sent() -> None:
    buckets = payload_buckets(100_000)
    assert buckets[0] == MIN_PAYLOAD and buckets[-1] >= 100_000
    arrays = (
        np.arange(7, dtype=np.int32),
        None,
        np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3),
        np.array([-128, 0, 127], np.int8),  # three bytes: padded to a word
        np.asarray(5, np.int32),  # a scalar
        np.array([True, False, True]),
        np.full((2, 2, 2, 2), np.nan, np.float32),  # bits travel, NaN included
        np.array([1.5, -2.25, 3.0], ml_dtypes.bfloat16),  # a bf16 pool's pages
    )
    header, payload = encode(STEP, (64, 34, 8), arrays, buckets)
    assert header.shape == (HEADER,) and payload is not None and payload.size in buckets
    message = decode(header, payload)
    assert message.op == STEP and message.statics == (64, 34, 8)
    assert len(message.arrays) == len(arrays)
    for sent, got in zip(arrays, message.arrays, strict=True):
        if sent is None:
            assert got is None
            continue
        assert got.dtype == sent.dtype and got.shape == sent.shape
        assert got.tobytes() == sent.tobytes()


def test_a_message_without_arrays_has_no_payload() -> None:
    header, payload = encode(GATHER, (), (), payload_buckets(0))
    assert payload is None
    assert decode(header, None) == (GATHER, (), ())


def test_what_a_message_cannot_carry_is_refused() -> None:
    buckets = payload_buckets(MIN_PAYLOAD)
    with pytest.raises(LockstepError, match="exceeds the largest bucket"):
        encode(STEP, (), (np.zeros(buckets[-1] + 1, np.int32),), buckets)
    with pytest.raises(LockstepError, match="cannot carry a float64"):
        encode(STEP, (), (np.zeros(3),), buckets)
    with pytest.raises(LockstepError, match="at most"):
        encode(STEP, tuple(range(9)), (), buckets)
