"""The shipped configuration as an operator installs it, and the README's
examples as a user runs them.

``etc/kvd.toml`` boots as it is (the embedded 270M, ``pool.size = "auto"``),
with only its addresses and paths swapped for temporary ones; the README's
curl and Python examples then run against it word for word, only the address
changed. Every example config passes ``kvd check-config``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server.conftest import ALICE, BOB, DaemonProcess, digest

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
README_URL = "http://127.0.0.1:8000"


def shipped_config(directory: Path) -> Path:
    text = (REPO / "etc" / "kvd.toml").read_text()
    # The demo keys are the shipped digests: no key needs swapping.
    assert digest(ALICE) in text and digest(BOB) in text
    socket_dir = tempfile.mkdtemp(prefix="kvd-", dir="/tmp")  # short: a socket path
    swaps = {
        '"127.0.0.1:8000"': '"127.0.0.1:0"',
        '"127.0.0.1:9464"': '"127.0.0.1:0"',
        '"/run/kvd/admin.sock"': f'"{socket_dir}/admin.sock"',
        '"/var/lib/kvd/state.json"': f'"{directory}/state.json"',
    }
    for old, new in swaps.items():
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    assert 'size = "auto"' in text
    path = directory / "kvd.toml"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def shipped(
    tmp_path_factory: pytest.TempPathFactory, daemon_env: dict[str, str]
) -> Iterator[DaemonProcess]:
    daemon = DaemonProcess(
        shipped_config(tmp_path_factory.mktemp("kvd-shipped")), daemon_env, ready_timeout=900
    )
    yield daemon
    assert daemon.terminate() == 0, daemon.tail()


@pytest.mark.parametrize("name", ["kvd.toml", "kvd.dev.toml"])
def test_every_example_config_checks(name: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvd.cli", "check-config", str(REPO / "etc" / name)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr


def test_the_shipped_config_boots_with_an_auto_pool(shipped: DaemonProcess) -> None:
    pool = shipped.wait_for("lifecycle.pool")
    assert pool["pages"] > 0
    # On a CPU "auto" stays within the host's share (at most 4 GiB).
    assert pool["pages"] * pool["page_bytes"] <= 4 << 30
    ready = shipped.wait_for("lifecycle.ready")
    assert set(ready["tenants"]) == {"alice", "batch-jobs"}
    assert not shipped.named("lifecycle.state_restored")  # a first start


def _readme_block(language: str, marker: str) -> str:
    blocks = re.findall(rf"```{language}\n(.*?)```", README, re.S)
    matching = [b for b in blocks if marker in b]
    assert len(matching) == 1, f"one {language} block with {marker!r} in the README"
    return matching[0]


def test_the_readme_curl_examples_work(shipped: DaemonProcess) -> None:
    script = _readme_block("sh", "curl")
    assert README_URL in script
    out = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script.replace(README_URL, shipped.url)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    completion, _, stream = out.stdout.partition("}data: ")
    body = json.loads(completion + "}")
    assert body["choices"][0]["text"] and body["usage"]["completion_tokens"] == 16
    events = [e for e in ("data: " + stream).split("\n\n") if e.strip()]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text.strip()
    assert chunks[-1]["usage"]["completion_tokens"] > 0


def test_the_readme_python_example_works(shipped: DaemonProcess) -> None:
    script = _readme_block("python", "from openai import OpenAI")
    assert README_URL in script
    out = subprocess.run(
        [sys.executable, "-c", script.replace(README_URL, shipped.url)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    *words, cached = out.stdout.split()
    assert words and cached.isdigit()
