"""The admin plane: a real daemon, the real kvctl (subprocess) on its socket."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.conftest import (
    ALICE,
    BOB,
    DaemonEnv,
    DaemonProcess,
    wait_until,
    write_config,
)

DAVE = "kvd-test-dave"
MODEL = "random"


def kvctl(daemon: DaemonProcess | Path, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    socket_path = daemon if isinstance(daemon, Path) else daemon.admin_socket
    return subprocess.run(
        [sys.executable, "-m", "kvctl.cli", "--socket", str(socket_path), *args],
        capture_output=True,
        text=True,
        timeout=120,
        **kw,
    )


def status(daemon: DaemonProcess) -> dict[str, Any]:
    result = kvctl(daemon, "status", "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def complete(daemon: DaemonProcess, key: str, prompt: Any, **body: Any) -> httpx.Response:
    return httpx.post(
        f"{daemon.url}/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0} | body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
    )


def test_status_top_and_usage_errors(tiny_daemon: DaemonProcess) -> None:
    data = status(tiny_daemon)
    assert {t["name"] for t in data["tenants"]} == {"alice", "bob", "carol"}
    assert data["pool"]["pages"] > 0 and data["device"].startswith("cpu")
    assert data["rates"]["prefill_tokens_per_s"] > 0
    human = kvctl(tiny_daemon, "status")
    assert human.returncode == 0 and "TENANT" in human.stdout and "alice" in human.stdout
    top = kvctl(tiny_daemon, "top", "--iterations", "2", "--interval", "0.1")
    assert top.returncode == 0 and top.stdout.count("TENANT") == 2
    usage = kvctl(tiny_daemon, "tenant", "set", "bob")
    assert usage.returncode == 2 and "nothing to change" in usage.stderr
    refused = kvctl(tiny_daemon, "tenant", "remove", "nobody")
    assert refused.returncode == 1 and "no tenant 'nobody'" in refused.stderr
    over = kvctl(tiny_daemon, "tenant", "set", "bob", "--reservation", "90%")
    assert over.returncode == 1 and "pool has" in over.stderr  # alice holds 25%
    assert kvctl(tiny_daemon, "tenant", "set", "bob", "--swap", "50%").returncode == 0
    bob = {t["name"]: t for t in status(tiny_daemon)["tenants"]}["bob"]
    assert bob["swap"] == "50%" and bob["swap_pages"] > 0 and bob["host_swap_pages"] == 0
    assert kvctl(tiny_daemon, "tenant", "set", "bob", "--swap", "all").returncode == 0
    bad = kvctl(tiny_daemon, "tenant", "set", "bob", "--swap", "lots")
    assert bad.returncode == 1 and "swap" in bad.stderr, bad.stderr
    gone = kvctl(tiny_daemon.admin_socket.with_name("absent.sock"), "status")
    assert gone.returncode == 3 and "absent.sock" in gone.stderr


def test_reservation_change_lets_a_refused_request_in(start_daemon: Any) -> None:
    """In static mode a tenant's reservation is its limit: with none, its
    requests are a 413 that says so at once (not a wait that nothing ends);
    raising the reservation live lets them in."""
    daemon: DaemonProcess = start_daemon()
    assert kvctl(daemon, "budget", "set", "static").returncode == 0
    added = kvctl(daemon, "tenant", "add", "dave", "--key", DAVE, "--reservation", "0")
    assert added.returncode == 0, added.stderr
    refused = complete(daemon, DAVE, "no pages of my own", max_tokens=3)
    assert refused.status_code == 413, refused.text
    assert "your reservation (the budget is static) allows 0" in refused.json()["error"]["message"]
    raised = kvctl(daemon, "tenant", "set", "dave", "--reservation", "10%")
    assert raised.returncode == 0, raised.stderr
    response = complete(daemon, DAVE, "pages of my own", max_tokens=3)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3
    removed = kvctl(daemon, "tenant", "remove", "dave")
    assert removed.returncode == 0, removed.stderr
    assert complete(daemon, DAVE, "gone").status_code == 401


def test_a_chat_system_prefix_is_shared_by_chat_requests(
    tiny_daemon: DaemonProcess, tmp_path: Path
) -> None:
    """Registered as chat requests render it, a system prompt is a public
    prefix that chat requests of every tenant hit (the developer role too)."""
    system = "You are the support assistant of a small bakery in Lyon. " * 6
    (tmp_path / "system.txt").write_text(system.strip() + "\n")
    added = kvctl(
        tiny_daemon, "prefix", "add", "bakery", "--chat-system-file", str(tmp_path / "system.txt")
    )
    assert added.returncode == 0, added.stderr
    listed = json.loads(kvctl(tiny_daemon, "prefix", "list", "--json").stdout)
    tokens = next(p["tokens"] for p in listed if p["name"] == "bakery")

    def chat(key: str, role: str, question: str) -> int:
        response = httpx.post(
            f"{tiny_daemon.url}/v1/chat/completions",
            json={
                "model": MODEL,
                "max_tokens": 2,
                "messages": [
                    {"role": role, "content": system.strip()},
                    {"role": "user", "content": question},
                ],
            },
            headers={"Authorization": f"Bearer {key}"},
            timeout=60,
        )
        assert response.status_code == 200, response.text
        return int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    assert chat(ALICE, "system", "When do you open on Sundays?") == 0  # computes it
    shared = chat(BOB, "developer", "Do you sell rye bread?")
    # Every full block of the prefix, less at most the one a merge at the
    # boundary with the question's text can change.
    assert 16 * (tokens // 16 - 1) <= shared <= 16 * (tokens // 16), (shared, tokens)
    assert kvctl(tiny_daemon, "prefix", "remove", "bakery").returncode == 0


def test_a_change_the_state_file_cannot_hold_is_undone(start_daemon: Any, tmp_path: Path) -> None:
    """The write runs after the change is applied: when it fails, the change
    is undone (a new tenant's key was never published), and the next change
    after the disk recovers is saved."""
    daemon: DaemonProcess = start_daemon(state_file="statedir/state.json")
    assert kvctl(daemon, "tenant", "set", "bob", "--weight", "2").returncode == 0
    state_dir = tmp_path / "statedir"
    shutil.rmtree(state_dir)
    state_dir.write_text("a file where the state directory was")  # every write now fails
    added = kvctl(daemon, "tenant", "add", "dave", "--key", DAVE)
    assert added.returncode == 1 and "the change was undone" in added.stderr, added.stderr
    assert complete(daemon, DAVE, "let me in").status_code == 401
    changed = kvctl(daemon, "tenant", "set", "bob", "--weight", "3")
    assert changed.returncode == 1 and "undone" in changed.stderr
    tenants = {t["name"]: t for t in status(daemon)["tenants"]}
    assert "dave" not in tenants and tenants["bob"]["weight"] == 2
    state_dir.unlink()
    assert kvctl(daemon, "tenant", "add", "dave", "--key", DAVE).returncode == 0
    assert complete(daemon, DAVE, "let me in").status_code == 200
    saved = json.loads((state_dir / "state.json").read_text())
    assert [e["op"] for e in saved["state"]["audit"]][-1] == "tenant.add"


def test_isolated_policy_stops_public_prefix_hits(start_daemon: Any, tmp_path: Path) -> None:
    daemon: DaemonProcess = start_daemon()
    prefix = [2] + [1000 + i for i in range(47)]  # three full 16-token blocks
    (tmp_path / "prefix.json").write_text(json.dumps(prefix))
    added = kvctl(daemon, "prefix", "add", "sys", "--token-file", str(tmp_path / "prefix.json"))
    assert added.returncode == 0, added.stderr

    def cached(key: str, tail: list[int]) -> int:
        response = complete(daemon, key, prefix + tail, max_tokens=2)
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(ALICE, [5, 6, 7]) == 0
    assert cached(BOB, [8, 9, 10]) == 48  # alice's computed prefix, shared with bob
    listed = json.loads(kvctl(daemon, "prefix", "list", "--json").stdout)
    assert listed == [{"name": "sys", "tokens": 48, "requests": 2, "hits": 1, "hit_tokens": 48}]
    assert kvctl(daemon, "sharing", "set", "isolated").returncode == 0
    assert kvctl(daemon, "sharing", "get").stdout.strip() == "isolated"
    assert cached(BOB, [11, 12, 13]) == 0
    assert cached(ALICE, [14, 15, 16]) == 0
    assert kvctl(daemon, "flush").returncode == 0
    assert kvctl(daemon, "prefix", "remove", "sys").returncode == 0
    assert json.loads(kvctl(daemon, "prefix", "list", "--json").stdout) == []
    ops = [e["op"] for e in json.loads(kvctl(daemon, "audit", "--json").stdout)]
    assert ops == ["prefix.add", "sharing.policy", "cache.flush", "prefix.remove"]
    assert daemon.wait_for("admin.audit")["op"] == "prefix.add"


def test_drain_wait_and_undrain(start_daemon: Any) -> None:
    daemon: DaemonProcess = start_daemon()
    lines: list[str] = []

    def stream() -> None:
        with httpx.stream(
            "POST",
            f"{daemon.url}/v1/completions",
            json={"model": MODEL, "prompt": "drain me", "max_tokens": 150, "stream": True},
            headers={"Authorization": f"Bearer {ALICE}"},
            timeout=60,
        ) as response:
            lines.extend(line for line in response.iter_lines() if line)

    thread = threading.Thread(target=stream)
    thread.start()
    daemon.wait_count("request.accepted", 1)
    waiting = subprocess.Popen(
        [sys.executable, "-m", "kvctl.cli", "--socket", str(daemon.admin_socket),
         "drain", "--wait", "--timeout", "60"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    wait_until(lambda: status(daemon)["draining"], "kvctl drain took effect")
    refused = complete(daemon, BOB, "new work")
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
    assert httpx.get(f"{daemon.url}/ready").status_code == 503
    stdout, stderr = waiting.communicate(timeout=60)
    assert waiting.returncode == 0, stderr
    assert "requests in flight" in stderr and "drained" in stdout
    thread.join(timeout=30)
    assert lines[-1] == "data: [DONE]"
    assert kvctl(daemon, "undrain").returncode == 0
    assert complete(daemon, BOB, "welcome back").status_code == 200
    assert httpx.get(f"{daemon.url}/ready").status_code == 200


def serve_once(config: Path, env: DaemonEnv) -> subprocess.CompletedProcess[str]:
    """`kvd serve` expected to refuse to start."""
    return subprocess.run(
        [sys.executable, "-m", "kvd.cli", "serve", "--config", str(config)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_changes_survive_kill_9_and_corruption_is_refused(
    tmp_path: Path, daemon_env: DaemonEnv
) -> None:
    config = write_config(tmp_path / "kvd.toml")
    daemon = DaemonProcess(config, daemon_env)
    try:
        assert kvctl(daemon, "tenant", "set", "bob", "--reservation", "40%").returncode == 0
        assert kvctl(daemon, "sharing", "set", "shared").returncode == 0
        assert kvctl(daemon, "budget", "set", "static").returncode == 0
        added = kvctl(
            daemon, "tenant", "add", "dave", "--key", DAVE, "--tier", "batch", "--reservation", "5%"
        )
        assert added.returncode == 0
        daemon.proc.send_signal(signal.SIGKILL)
        daemon.proc.wait()
    finally:
        daemon.kill()
    restarted = DaemonProcess(config, daemon_env)  # a stale socket is cleaned up
    try:
        data = status(restarted)
        bob = next(t for t in data["tenants"] if t["name"] == "bob")
        assert bob["reservation"] == "40%"
        assert data["sharing_policy"] == "shared" and data["budget_mode"] == "static"
        assert "dave" in {t["name"] for t in data["tenants"]}
        # The file replaced the config's sections: said at start, and in status.
        overrides = ["tenants", "budget.mode", "sharing.policy"]
        assert data["state"]["restored"]["overrides"] == overrides
        restored = restarted.wait_for("lifecycle.state_restored")
        assert restored["level"] == "warning" and restored["overrides"] == overrides
        assert "overrides the config's tenants" in kvctl(restarted, "status").stdout
        assert complete(restarted, DAVE, "I persist").status_code == 200
        assert len(json.loads(kvctl(restarted, "audit", "--json").stdout)) == 4
        assert restarted.terminate() == 0
    finally:
        restarted.kill()
    state = tmp_path / "state.json"
    good = state.read_bytes()
    state.write_bytes(good[: len(good) // 2])  # a torn write
    failed = serve_once(config, daemon_env)
    assert failed.returncode == 1
    assert "state file is corrupt" in failed.stderr and "state.json.prev" in failed.stderr
    assert state.read_bytes() == good[: len(good) // 2]  # nothing overwritten
    previous = json.loads((tmp_path / "state.json.prev").read_text())
    assert previous["format"] == "kvd-state/1"
    edited = good.replace(b'"40%"', b'"45%"')  # valid JSON, wrong checksum
    state.write_bytes(edited)
    failed = serve_once(config, daemon_env)
    assert failed.returncode == 1 and "checksum" in failed.stderr


PROBE = """
import socket, sys
sock = socket.socket(socket.AF_UNIX)
try:
    sock.connect(sys.argv[1])
except PermissionError:
    print("refused")
else:
    print("connected")
"""


@pytest.mark.skipif(
    os.geteuid() != 0 or not Path("/usr/bin/python3").exists(),
    reason="needs root (to probe as another user) and a system python 'nobody' can run",
)
def test_the_os_refuses_a_user_without_access(tiny_daemon: DaemonProcess) -> None:
    """Root bypasses file modes, so the probe runs as 'nobody' (the venv's
    python lives under /root, out of nobody's reach: the system python
    connects instead, as kvctl would)."""
    sock = tiny_daemon.admin_socket
    assert sock.stat().st_mode & 0o777 == 0o660  # root:root, so nobody is "other"
    sock.parent.chmod(0o755)  # only the socket's own mode may decide

    def probe() -> str:
        result = subprocess.run(
            ["/usr/bin/python3", "-c", PROBE, str(sock)],
            capture_output=True,
            text=True,
            timeout=60,
            user=65534,
            group=65534,
            extra_groups=[],
            env={"PATH": "/usr/bin:/bin"},
        )
        return result.stdout.strip() or result.stderr

    assert probe() == "refused"
    sock.chmod(0o666)  # the control: the same user with the mode open connects
    try:
        assert probe() == "connected"
    finally:
        sock.chmod(0o660)


def test_the_host_tier_through_kvctl_status_metrics_and_flush(start_daemon: Any) -> None:
    """A pool smaller than the prompts it serves: evicted cached blocks go to
    the host tier (charged to their tenant), a quota set live drops them, a
    flush empties the tier, and a repeated greedy prompt answers the same.
    The pool holds int8 K/V: pages (scales included) are what status counts."""
    daemon: DaemonProcess = start_daemon(pool="80KiB", host_size="4MiB", kv_dtype="int8")
    described = status(daemon)
    assert described["model"]["kv_dtype"] == "int8"
    # 6 layers x 1 KV head x (16 int8 values + a 4-byte scale) x K and V, 16 tokens a page.
    page_bytes = described["pool"]["page_bytes"]
    assert page_bytes * described["pool"]["pages"] <= 80 * 1024
    assert page_bytes % (16 * 2 * (16 + 4)) == 0
    first = complete(daemon, ALICE, "alpha beta gamma " * 60)
    assert first.status_code == 200, first.text
    for i in range(3):  # other long prompts take the pool's pages
        flood = complete(daemon, BOB, f"{i} delta epsilon zeta " * 50)
        assert flood.status_code == 200, flood.text
    daemon.wait_pages_released()
    tenants = {t["name"]: t for t in status(daemon)["tenants"]}
    host = status(daemon)["host"]
    assert host["pages"] > 0 and host["offloads"] > 0 and host["cached_pages"] > 0
    assert tenants["alice"]["host_cached_pages"] > 0
    metrics = daemon.metrics()
    assert metrics['kvd_host_pages{use="cached"}'] == host["cached_pages"]
    assert 'kvd_prefix_hit_tokens_by_tier_total{tier="host"}' in metrics
    again = complete(daemon, ALICE, "alpha beta gamma " * 60)
    assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    # A quota of 0 leaves alice nothing on the host; bob keeps his.
    set_quota = kvctl(daemon, "tenant", "set", "alice", "--host-quota", "0")
    assert set_quota.returncode == 0, set_quota.stderr
    tenants = {t["name"]: t for t in status(daemon)["tenants"]}
    assert tenants["alice"]["host_cached_pages"] == 0
    assert tenants["alice"]["host_quota"] == "0" and tenants["alice"]["host_quota_pages"] == 0
    assert "HOST QUOTA" in kvctl(daemon, "status").stdout
    assert kvctl(daemon, "flush").returncode == 0
    assert status(daemon)["host"]["cached_pages"] == 0
