"""``kvd generate`` as a user runs it: the installed script, the real model."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent


def kvd(*args: str, cache: Path) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("kvd", path=str(BIN))
    assert exe is not None
    env = dict(os.environ, KVD_CACHE_DIR=str(cache), JAX_PLATFORMS="cpu")
    return subprocess.run(
        [exe, *args], capture_output=True, text=True, timeout=600, check=False, env=env
    )


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kvd-cache")


def test_generate_json_from_a_prompt_file(cache: Path, tmp_path: Path) -> None:
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("The capital of France is", encoding="utf-8")
    out = kvd("generate", "--prompt-file", str(prompt), "--max-tokens", "8", "--json", cache=cache)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["prompt_ids"] == [2, 818, 5279, 529, 7001, 563]
    assert result["completion_ids"][:4] == [506, 5279, 529, 506]  # " the capital of the"
    assert result["text"].startswith(" the capital of the country of France")
    assert len(result["completion_ids"]) == 8 and result["finish_reason"] == "length"
    assert "loading gemma3-270m" in out.stderr  # progress goes to stderr


def test_generate_refuses_bad_input_without_a_traceback(cache: Path, tmp_path: Path) -> None:
    long_prompt = tmp_path / "long.txt"
    long_prompt.write_text("word " * 40_000, encoding="utf-8")
    out = kvd("generate", "--prompt-file", str(long_prompt), cache=cache)
    assert out.returncode == 2
    assert "context is 32768 tokens" in out.stderr and "Traceback" not in out.stderr
    out = kvd("generate", "--model", "gemma9", "--prompt", "x", cache=cache)
    assert out.returncode != 0 and "unknown model 'gemma9'" in out.stderr
    out = kvd("generate", "--model", str(tmp_path / "nope.gguf"), "--prompt", "x", cache=cache)
    assert out.returncode != 0 and "no such file" in out.stderr
    out = kvd("generate", cache=cache)
    assert out.returncode == 2 and "exactly one of --prompt and --prompt-file" in out.stderr
    out = kvd("generate", "--prompt", "x", "--temperature", "-1", cache=cache)
    assert out.returncode == 2 and "Traceback" not in out.stderr
