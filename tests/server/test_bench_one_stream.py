"""scripts/bench_one_stream.py against a real listener: one streaming
client, and the server's CPU per chunk by thread (the server runs in this
process, its steps in the step thread)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import trio

from tests.server.conftest import ALICE, wait_until
from tests.server.harness import MODEL, serving

SCRIPT = Path(__file__).parents[2] / "scripts" / "bench_one_stream.py"


async def test_one_stream_and_the_servers_cpu_by_thread(tmp_path: Path) -> None:
    async with serving(tmp_path, http_socket=True, step_in_thread=True) as served:
        host, port = served.address
        done = await trio.run_process(
            [
                sys.executable,
                str(SCRIPT),
                f"--url=http://{host}:{port}",
                f"--key={ALICE}",
                f"--model={MODEL}",
                "--repeat=1",
                "--requests=2",
                "--tokens=64",
                f"--cpu-of={os.getpid()}",
            ],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
    out = done.stdout.decode()
    assert done.returncode == 0, done.stderr.decode()
    assert "2 requests, decode" in out
    lines = out.split("CPU per chunk received, by thread (")[1].splitlines()
    chunks = int(lines[0].split()[0])
    assert chunks >= 2 * 2  # at least two chunks with text a request
    by_thread = {line.rsplit(None, 2)[0].strip(): float(line.split()[-2]) for line in lines[1:]}
    assert by_thread["main"] > 0  # the event loop served every chunk
    assert "(this client)" in by_thread


def run_script(*flags: str) -> subprocess.CompletedProcess[str]:
    """The script with ``flags``, against a port nothing listens on."""
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--url=http://127.0.0.1:9", *flags],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_process_not_there_is_refused_before_any_request() -> None:
    done = run_script("--cpu-of=999999999")
    assert done.returncode == 1
    assert "--cpu-of 999999999: no such process here" in done.stderr


def test_burn_needs_the_in_process_arm() -> None:
    done = run_script("--burn=1")
    assert done.returncode == 2
    assert "--burn needs --inprocess" in done.stderr


def test_the_burner_spends_cpu_while_it_runs_and_is_gone_after() -> None:
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from bench_one_stream import Burner, cpu_seconds
    finally:
        sys.path.remove(str(SCRIPT.parent))
    with Burner(cpu_ms=2.0, period_s=0.01) as burner:
        process = burner.process
        assert process is not None
        stat = f"/proc/{process.pid}/stat"
        wait_until(lambda: cpu_seconds(stat) >= 0.05, "the burner spent 50 ms of CPU")
    assert process.poll() is not None  # killed and reaped
