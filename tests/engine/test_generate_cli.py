"""``kvd generate`` as a user runs it, on the real model: its command line
in this process (the arguments, the output and the exit status are the
subject; the engine it builds is the same in any process)."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner, Result

from kvd.cli import cli


def kvd(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args), prog_name="kvd")


def test_generate_json_from_a_prompt_file(tmp_path: Path) -> None:
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("The capital of France is", encoding="utf-8")
    out = kvd("generate", "--prompt-file", str(prompt), "--max-tokens", "8", "--json")
    assert out.exit_code == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["prompt_ids"] == [2, 818, 5279, 529, 7001, 563]
    assert result["completion_ids"][:4] == [506, 5279, 529, 506]  # " the capital of the"
    assert result["text"].startswith(" the capital of the country of France")
    assert len(result["completion_ids"]) == 8 and result["finish_reason"] == "length"
    assert "loading gemma3-270m" in out.stderr  # progress goes to stderr


def test_generate_refuses_bad_input_without_a_traceback(tmp_path: Path) -> None:
    long_prompt = tmp_path / "long.txt"
    long_prompt.write_text("word " * 40_000, encoding="utf-8")
    out = kvd("generate", "--prompt-file", str(long_prompt))
    assert out.exit_code == 2 and isinstance(out.exception, SystemExit)  # no traceback
    assert "context is 32768 tokens" in out.stderr
    out = kvd("generate", "--model", "gemma9", "--prompt", "x")
    assert out.exit_code != 0 and "unknown model 'gemma9'" in out.stderr
    out = kvd("generate", "--model", str(tmp_path / "nope.gguf"), "--prompt", "x")
    assert out.exit_code != 0 and "no such file" in out.stderr
    out = kvd("generate")
    assert out.exit_code == 2 and "exactly one of --prompt and --prompt-file" in out.stderr
    out = kvd("generate", "--prompt", "x", "--temperature", "-1")
    assert out.exit_code == 2 and isinstance(out.exception, SystemExit)
