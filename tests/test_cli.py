"""kvctl and kvd as users run them: real subprocesses of the installed scripts."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server.conftest import write_config

BIN = Path(sys.executable).parent


def run(prog: str, *args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which(prog, path=str(BIN))
    assert exe is not None, f"{prog} is not installed next to {sys.executable}"
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=120, check=False)


def test_capacity_json_for_the_seed() -> None:
    out = run("kvctl", "capacity", "--model", "gemma4-12b", "--pool", "3.8GiB", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["bytes_per_token"]["global"] == 131072
    assert report["bytes_per_token"]["sliding"] == 327680
    eager = report["eager"]
    assert eager["sliding_floor_bytes"] == 320 * 1024**2
    assert eager["total_tokens"] == 8894
    assert eager["longest_sequence_tokens"] == 28569
    assert eager["max_sequences"] == 12
    assert report["kvd"]["max_sequences_512"] == 17
    assert report["kvd"]["longest_sequence_tokens"] > 28000


def test_capacity_human_output() -> None:
    out = run("kvctl", "capacity", "--model", "gemma4-12b", "--pool", "3.8GiB")
    assert out.returncode == 0, out.stderr
    for text in (
        "128 KiB",
        "320 KiB",
        "320 MiB",
        "8,894",
        "28,569",
    ):
        assert text in out.stdout
    assert re.search(r"concurrent 512-token sequences\s+17\n", out.stdout)


def test_capacity_by_flags_prices_the_70b_example() -> None:
    out = run(
        "kvctl",
        "capacity",
        "--layers",
        "80",
        "--kv-heads",
        "8",
        "--head-dim",
        "128",
        "--context",
        "131072",
    )
    assert out.returncode == 0 and "42.9 GB" in out.stdout
    out = run(
        "kvctl",
        "capacity",
        "--layers",
        "80",
        "--kv-heads",
        "64",
        "--head-dim",
        "128",
        "--context",
        "131072",
    )
    assert "343.6 GB" in out.stdout


@pytest.mark.parametrize(
    "args",
    [
        ["--model", "gemma9", "--pool", "1GiB"],
        ["--model", "gemma4-12b", "--pool", "3.8Gb"],
        ["--model", "gemma4-12b", "--pool", "-1GiB"],
        ["--model", "gemma4-12b", "--pool", "lots"],
        ["--model", "gemma4-12b", "--pool", "1KiB"],
        ["--model", "gemma4-12b", "--layers", "3"],
        ["--layers", "4"],
        ["--layers", "x", "--kv-heads", "1", "--head-dim", "8"],
        ["--model", "gemma4-12b", "--dtype", "float64"],
        ["--model", "gemma4-12b", "--bogus"],
    ],
)
def test_capacity_bad_input_is_one_line_and_exit_2(args: list[str]) -> None:
    out = run("kvctl", "capacity", *args)
    assert out.returncode == 2
    assert out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvctl: error: ")


@pytest.mark.parametrize(
    "args",
    [
        ["tenant", "set", "alice", "--weight", "nan"],
        ["tenant", "set", "alice", "--weight", "inf"],
        ["tenant", "set", "alice", "--rpm", "nan"],
        ["tenant", "set", "alice", "--tpm", "inf"],
        ["tenant", "add", "dave", "--key", "k", "--tpm", "-inf"],
        ["top", "--interval", "nan"],
        ["drain", "--timeout", "inf"],
        ["prefix", "add", "p", "--text", "a", "--chat-system", "b"],
        ["prefix", "add", "p", "--chat-system-file", "/nonexistent/system.txt"],
    ],
)
def test_kvctl_refuses_non_finite_numbers_without_a_traceback(
    args: list[str], tmp_path: Path
) -> None:
    """Refused before any daemon is asked (the socket does not exist)."""
    out = run("kvctl", "--socket", str(tmp_path / "absent.sock"), *args)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvctl: error: "), out.stderr


def test_bench_kv_prints_figures() -> None:
    out = run("kvd", "bench", "kv", "--running", "8,32", "--steps", "5", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert [s["running"] for s in report["steps"]] == [8, 32]
    assert all(s["mean_ms"] > 0 for s in report["steps"])
    assert report["hash_tokens_per_s"] > 0
    bad = run("kvd", "bench", "kv", "--running", "a,b")
    assert bad.returncode == 2 and bad.stderr.startswith("kvd: error:")


def test_bench_sampling_prints_figures() -> None:
    out = run("kvd", "bench", "sampling", "--batch", "2", "--vocabulary", "1024", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert len(report["cases"]) == 13 and all(c["ms"] > 0 for c in report["cases"])
    temperature = next(c for c in report["cases"] if c["name"] == "temperature alone")
    assert temperature["ratio_to_temperature"] == 1.0


def test_bench_sampling_on_the_models_own_logits() -> None:
    """--model-logits: greedy, temperature and softmax's normaliser on the
    embedded model's next-token logits along a text, beside the made-up ones;
    a batch the text cannot fill is a one-line error."""
    out = run(
        "kvd",
        "bench",
        "sampling",
        "--batch",
        "2",
        "--vocabulary",
        "1024",
        "--model-logits",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    model = json.loads(out.stdout)["model"]
    assert model["model"] == "gemma3-270m" and model["positions"] == 2
    assert model["greedy_ms"] > 0 and model["temperature_ms"] > 0 and model["weigh_ms"] > 0
    assert model["temperature_to_weigh"] > 0
    bad = run("kvd", "bench", "sampling", "--batch", "5000", "--model-logits")
    assert bad.returncode == 2 and bad.stderr.startswith("kvd: error: --model-logits"), bad.stderr


def test_capacity_shows_what_int8_weights_buy_on_the_seeds_chip() -> None:
    out = run(
        "kvctl", "capacity", "--model", "gemma4-12b", "--weights", "int8",
        "--device-memory", "28.7GiB", "--json",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    fits = {fit["weights"]: fit for fit in report["weights"]}
    # bf16 weights leave the seed's ~3.8 GiB pool and its 17 sequences of 512.
    assert abs(fits["bfloat16"]["pool_bytes"] - 3.8 * 1024**3) < 1024**2
    assert fits["bfloat16"]["max_sequences_512"] == 17
    assert fits["int8"]["weight_bytes"] < 0.6 * fits["bfloat16"]["weight_bytes"]
    assert report["pool_bytes"] == fits["int8"]["pool_bytes"] > 3 * fits["bfloat16"]["pool_bytes"]
    assert report["kvd"]["max_sequences_512"] == fits["int8"]["max_sequences_512"] > 3 * 17
    human = run(
        "kvctl", "capacity", "--model", "gemma4-12b", "--weights", "int8",
        "--device-memory", "28.7GiB",
    )  # fmt: skip
    assert re.search(r"int8 \(this report\)\s+weights 12\.52 GiB", human.stdout), human.stdout
    for bad, message in (
        (["--weights", "int8"], "--weights and --device-memory go together"),
        (["--weights", "int8", "--device-memory", "28GiB", "--pool", "1GiB"], "not both"),
        (["--weights", "float32", "--device-memory", "28.7GiB"], "leave no pool"),
    ):
        failed = run("kvctl", "capacity", "--model", "gemma4-12b", *bad)
        assert failed.returncode != 0 and message in failed.stderr, failed.stderr
    custom = run(
        "kvctl", "capacity", "--layers", "4", "--kv-heads", "1", "--head-dim", "64",
        "--weights", "int8", "--device-memory", "1GiB",
    )  # fmt: skip
    assert custom.returncode != 0 and "give --parameters" in custom.stderr


def test_capacity_over_several_devices() -> None:
    out = run(
        "kvctl", "capacity", "--model", "gemma4-31b", "--weights", "bfloat16",
        "--device-memory", "16GiB", "--devices", "8", "--json",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    fits = {f["weights"]: f for f in json.loads(out.stdout)["weights"]}
    assert fits["bfloat16"]["devices"] == 8 and not fits["bfloat16"]["pool_split"]
    assert fits["bfloat16"]["max_sequences_512"] > 0
    human = run(
        "kvctl", "capacity", "--model", "gemma4-31b", "--weights", "int8",
        "--device-memory", "16GiB", "--devices", "8",
    )  # fmt: skip
    assert "over 8 devices of 16 GiB" in human.stdout and "per device" in human.stdout
    bad = run("kvctl", "capacity", "--layers", "4", "--kv-heads", "2", "--head-dim", "64",
              "--weights", "int8", "--device-memory", "16GiB", "--devices", "2",
              "--parameters", "1000000")  # fmt: skip
    assert bad.returncode != 0 and "give --hidden-size" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


def test_bench_decode_measures_the_engine_a_config_serves(tmp_path: Path) -> None:
    """--config: the engine ``kvd serve`` builds from the file (here the tiny
    random model's), not one sized for the workload; what the file cannot
    serve, and options the file settles, are one-line errors."""
    config = write_config(tmp_path / "kvd.toml", max_num_seqs=4)
    args = ["bench", "decode", "--config", str(config), "--prompt-len", "8", "--new-tokens", "4"]
    out = run("kvd", *args, "--batches", "1,2", "--rounds", "1", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["config"] == str(config) and report["model"] == "random"
    assert report["transformers"] == [] and "not random" in report["transformers_note"]
    assert report["engine"].startswith("4 rows, max_model_len 256, ")
    assert [(f["system"], f["batch"]) for f in report["kvd"]] == [
        ("kvd", 1),
        ("kvd serial", 1),
        ("kvd", 2),
        ("kvd serial", 2),
    ]
    assert all(f["decode_tokens_per_s"] > 0 for f in report["kvd"])
    for extra, problem in [
        (["--batches", "8"], "batch 8 exceeds"),
        (["--new-tokens", "300"], "exceed"),
        (["--matmul", "xla"], "--matmul: the engine's settings come from --config"),
    ]:
        bad = run("kvd", *args, *extra, "--no-baseline")
        assert bad.returncode == 2, bad.stderr
        assert bad.stderr.strip().splitlines()[-1].startswith("kvd: error: "), bad.stderr
        assert problem in bad.stderr
