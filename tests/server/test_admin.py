"""The admin plane in-process: the real admin app over the real runtime and
scheduler on the simulated executor, through its test client, and the real
kvctl (subprocess) on the real Unix socket where the CLI or the socket is
what is tested."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio

from kvd.server.state import StateError
from tests.server.conftest import ALICE, BOB
from tests.server.harness import Served, kvctl, serving, until

DAVE = "kvd-test-dave"


def dave(**fields: Any) -> dict[str, Any]:
    return {"name": "dave", "api_key_sha256": hashlib.sha256(DAVE.encode()).hexdigest()} | fields


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[Served]:
    async with serving(tmp_path) as daemon:
        yield daemon


async def test_kvctl_status_top_and_usage_errors(tmp_path: Path) -> None:
    async with serving(tmp_path, admin_socket=True) as served:
        result = await kvctl(served, "status", "--json")
        assert result.returncode == 0, result.stderr
        data = json.loads(result.stdout)
        assert {t["name"] for t in data["tenants"]} == {"alice", "bob", "carol"}
        assert data["pool"]["pages"] > 0 and data["device"].startswith("simulated")
        assert data["rates"]["prefill_tokens_per_s"] > 0
        assert data["model"]["quantization"] == "none" and data["model"]["weight_bytes"] == 0
        human = await kvctl(served, "status")
        assert human.returncode == 0 and b"TENANT" in human.stdout and b"alice" in human.stdout
        assert b"weights float32, KV float32" in human.stdout, human.stdout
        assert b"hosts in lockstep" not in human.stdout  # one process
        # Several processes (docs/howto/multi-host.md): what host 0's devices hold.
        served.daemon.context.hosts = {
            "processes": 2,
            "weight_bytes_per_host": 300 << 20,
            "pool_bytes_per_host": 128 << 20,
        }
        hosts = await kvctl(served, "status")
        assert b"2 hosts in lockstep; host 0's devices hold weights 300 MiB and pool 128 MiB" in (
            hosts.stdout
        ), hosts.stdout
        assert (
            json.loads((await kvctl(served, "status", "--json")).stdout)["hosts"]["processes"] == 2
        )
        top = await kvctl(served, "top", "--iterations", "2", "--interval", "0.1")
        assert top.returncode == 0 and top.stdout.count(b"TENANT") == 2
        usage = await kvctl(served, "tenant", "set", "bob")
        assert usage.returncode == 2 and b"nothing to change" in usage.stderr
        refused = await kvctl(served, "tenant", "remove", "nobody")
        assert refused.returncode == 1 and b"no tenant 'nobody'" in refused.stderr
        over = await kvctl(served, "tenant", "set", "bob", "--reservation", "90%")
        assert over.returncode == 1 and b"pool has" in over.stderr  # alice holds 25%
        assert (await kvctl(served, "tenant", "set", "bob", "--swap", "50%")).returncode == 0
        bob = {t["name"]: t for t in (await served.status())["tenants"]}["bob"]
        assert bob["swap"] == "50%" and bob["swap_pages"] > 0 and bob["host_swap_pages"] == 0
        assert (await kvctl(served, "tenant", "set", "bob", "--swap", "all")).returncode == 0
        bad = await kvctl(served, "tenant", "set", "bob", "--swap", "lots")
        assert bad.returncode == 1 and b"swap" in bad.stderr, bad.stderr
        added = await kvctl(served, "tenant", "add", "dave", "--key", DAVE, "--tier", "batch")
        assert added.returncode == 0, added.stderr
        assert (await served.complete(DAVE)).status_code == 200
        listed = json.loads((await kvctl(served, "tenant", "list", "--json")).stdout)
        assert "dave" in [t["name"] for t in listed]
        assert (await kvctl(served, "tenant", "remove", "dave")).returncode == 0
        assert (await served.complete(DAVE)).status_code == 401
        ops = [e["op"] for e in json.loads((await kvctl(served, "audit", "--json")).stdout)]
        assert ops == ["tenant.set", "tenant.set", "tenant.add", "tenant.remove"]
        gone = served.daemon.admin_socket.with_name("absent.sock")
        missing = await trio.run_process(
            [*kvctl_command(gone), "status"], capture_stdout=True, capture_stderr=True, check=False
        )
        assert missing.returncode == 3 and b"absent.sock" in missing.stderr


def kvctl_command(socket_path: Path) -> list[str]:
    import sys

    return [sys.executable, "-m", "kvctl.cli", "--socket", str(socket_path)]


async def test_reservation_change_lets_a_refused_request_in(served: Served) -> None:
    """In static mode a tenant's reservation is its limit: with none, its
    requests are a 413 that says so at once (not a wait that nothing ends);
    raising the reservation live lets them in."""
    assert (await served.admin_json("put", "/v1/budget", {"mode": "static"}))[0] == 200
    assert await served.admin_json("get", "/v1/budget") == (200, {"mode": "static"})
    code, body = await served.admin_json("post", "/v1/tenants", dave(reservation="0"))
    assert code == 201, body
    refused = await served.complete(DAVE, "no pages of my own", max_tokens=3)
    assert refused.status_code == 413
    message = (await refused.get_json())["error"]["message"]
    assert "your reservation (the budget is static) allows 0" in message
    code, body = await served.admin_json("patch", "/v1/tenants/dave", {"reservation": "10%"})
    assert code == 200, body
    response = await served.complete(DAVE, "pages of my own", max_tokens=3)
    assert response.status_code == 200
    assert (await response.get_json())["usage"]["completion_tokens"] == 3
    assert (await served.admin_json("delete", "/v1/tenants/dave"))[0] == 200
    assert (await served.complete(DAVE, "gone")).status_code == 401
    await served.assert_whole()


async def test_admin_bodies_and_refusals(served: Served) -> None:
    code, body = await served.admin_json("post", "/v1/tenants", dave(colour="red"))
    assert code == 400 and "colour" in body["error"]
    code, body = await served.admin_json("post", "/v1/tenants", dave(name="alice"))
    assert code == 409 and "already exists" in body["error"]
    code, body = await served.admin_json("patch", "/v1/tenants/bob", {})
    assert code == 400 and body["error"] == "nothing to change"
    code, body = await served.admin_json("patch", "/v1/tenants/nobody", {"weight": 2.0})
    assert code == 404
    code, body = await served.admin_json("put", "/v1/budget", {"mode": "loose"})
    assert code == 400
    code, body = await served.admin_json("post", "/v1/prefixes", {"name": "x"})
    assert code == 400 and "exactly one" in body["error"]
    code, body = await served.admin_json(
        "post", "/v1/prefixes", {"name": "x", "tokens": [1, 10**9]}
    )
    assert code == 400 and "token ids" in body["error"]
    code, body = await served.admin_json("delete", "/v1/prefixes/none")
    assert code == 404
    code, body = await served.admin_json("get", "/v1/nothing")
    assert code == 404 and "404" in body["error"]
    for name in ("alice", "bob"):
        assert (await served.admin_json("delete", f"/v1/tenants/{name}"))[0] == 200
    code, body = await served.admin_json("delete", "/v1/tenants/carol")
    assert code == 409 and "last tenant" in body["error"]
    # Without KVD_TESTING's faults the test-only endpoint does not exist.
    code, _ = await served.admin_json("post", "/v1/faults", {"spec": "step:raise"})
    assert code == 404


async def test_a_chat_system_prefix_is_shared_by_chat_requests(served: Served) -> None:
    """Registered as chat requests render it, a system prompt is a public
    prefix that chat requests of every tenant hit (the developer role too)."""
    system = ("You are the support assistant of a small bakery in Lyon. " * 6).strip()
    code, body = await served.admin_json(
        "post", "/v1/prefixes", {"name": "bakery", "chat_system": system}
    )
    assert code == 201, body
    code, listed = await served.admin_json("get", "/v1/prefixes")
    tokens = next(p["tokens"] for p in listed if p["name"] == "bakery")

    async def chat(key: str, role: str, question: str) -> int:
        response = await served.chat(
            key,
            max_tokens=2,
            messages=[{"role": role, "content": system}, {"role": "user", "content": question}],
        )
        assert response.status_code == 200
        return int((await response.get_json())["usage"]["prompt_tokens_details"]["cached_tokens"])

    assert await chat(ALICE, "system", "When do you open on Sundays?") == 0  # computes it
    shared = await chat(BOB, "developer", "Do you sell rye bread?")
    # Every full block of the prefix, less at most the one a merge at the
    # boundary with the question's text can change.
    assert 16 * (tokens // 16 - 1) <= shared <= 16 * (tokens // 16), (shared, tokens)
    assert (await served.admin_json("delete", "/v1/prefixes/bakery"))[0] == 200


async def test_a_change_the_state_file_cannot_hold_is_undone(tmp_path: Path) -> None:
    """The write runs after the change is applied: when it fails, the change
    is undone (a new tenant's key was never published), and the next change
    after the disk recovers is saved."""
    async with serving(tmp_path, state_file="statedir/state.json") as served:
        assert (await served.admin_json("patch", "/v1/tenants/bob", {"weight": 2.0}))[0] == 200
        state_dir = tmp_path / "statedir"
        shutil.rmtree(state_dir)
        state_dir.write_text("a file where the state directory was")  # every write now fails
        code, body = await served.admin_json("post", "/v1/tenants", dave())
        assert code == 500 and "the change was undone" in body["error"], body
        assert (await served.complete(DAVE, "let me in")).status_code == 401
        code, body = await served.admin_json("patch", "/v1/tenants/bob", {"weight": 3.0})
        assert code == 500 and "undone" in body["error"]
        tenants = {t["name"]: t for t in (await served.status())["tenants"]}
        assert "dave" not in tenants and tenants["bob"]["weight"] == 2
        state_dir.unlink()
        assert (await served.admin_json("post", "/v1/tenants", dave()))[0] == 201
        assert (await served.complete(DAVE, "let me in")).status_code == 200
        saved = json.loads((state_dir / "state.json").read_text())
        assert [e["op"] for e in saved["state"]["audit"]][-1] == "tenant.add"


async def test_isolated_policy_stops_public_prefix_hits(served: Served) -> None:
    prefix = [2] + [1000 + i for i in range(47)]  # three full 16-token blocks
    code, body = await served.admin_json("post", "/v1/prefixes", {"name": "sys", "tokens": prefix})
    assert code == 201, body

    async def cached(key: str, tail: list[int]) -> int:
        response = await served.complete(key, prefix + tail, max_tokens=2)
        assert response.status_code == 200
        return int((await response.get_json())["usage"]["prompt_tokens_details"]["cached_tokens"])

    assert await cached(ALICE, [5, 6, 7]) == 0
    assert await cached(BOB, [8, 9, 10]) == 48  # alice's computed prefix, shared with bob
    code, listed = await served.admin_json("get", "/v1/prefixes")
    assert listed == [{"name": "sys", "tokens": 48, "requests": 2, "hits": 1, "hit_tokens": 48}]
    assert (await served.admin_json("put", "/v1/sharing", {"policy": "isolated"}))[0] == 200
    assert await served.admin_json("get", "/v1/sharing") == (200, {"policy": "isolated"})
    assert await cached(BOB, [11, 12, 13]) == 0
    assert await cached(ALICE, [14, 15, 16]) == 0
    code, flushed = await served.admin_json("post", "/v1/flush")
    assert code == 200 and flushed["freed_pages"] > 0
    assert (await served.admin_json("delete", "/v1/prefixes/sys"))[0] == 200
    assert await served.admin_json("get", "/v1/prefixes") == (200, [])
    code, audit = await served.admin_json("get", "/v1/audit")
    assert [e["op"] for e in audit] == [
        "prefix.add",
        "sharing.policy",
        "cache.flush",
        "prefix.remove",
    ]
    assert served.named("admin.audit")[0]["op"] == "prefix.add"
    await served.assert_whole()


async def test_drain_wait_and_undrain(served: Served) -> None:
    lines: list[str] = []

    async def stream() -> None:
        response = await served.complete(
            ALICE, "drain me", max_tokens=150, stream=True, temperature=1.0
        )
        lines.extend(line for line in (await response.get_data()).decode().split("\n") if line)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(stream)
        while not served.named("request.start"):
            await trio.sleep(0)
        code, body = await served.admin_json("post", "/v1/drain")
        assert code == 200 and body["in_flight"] == 1
        assert (await served.status())["draining"]
        assert (await served.metrics())["kvd_draining"] == 1
        refused = await served.complete(BOB, "new work")
        assert refused.status_code == 503
        assert (await refused.get_json())["error"]["code"] == "draining"
        ready = await served.http.get("/ready")
        assert ready.status_code == 503 and (await ready.get_json())["status"] == "draining"
    assert lines[-1] == "data: [DONE]"  # the request in flight finished
    assert (await served.status())["in_flight"] == 0
    assert (await served.admin_json("post", "/v1/undrain"))[0] == 200
    assert (await served.complete(BOB, "welcome back")).status_code == 200
    assert (await served.http.get("/ready")).status_code == 200
    code, audit = await served.admin_json("get", "/v1/audit")
    assert [e["op"] for e in audit] == ["drain", "undrain"]
    # A daemon stopping for good (a signal) cannot be undrained.
    served.daemon.stop()
    code, body = await served.admin_json("post", "/v1/undrain")
    assert code == 409 and "shutting down" in body["error"]


async def test_changes_persist_across_a_restart(tmp_path: Path) -> None:
    """What a restart reads back: the state file's tenants, mode and policy
    replace the config's (said at start, and in status), its audit kept."""
    async with serving(tmp_path) as served:
        config_path = served.config_path
        assert (await served.admin_json("patch", "/v1/tenants/bob", {"reservation": "40%"}))[
            0
        ] == 200
        assert (await served.admin_json("put", "/v1/sharing", {"policy": "shared"}))[0] == 200
        assert (await served.admin_json("put", "/v1/budget", {"mode": "static"}))[0] == 200
        code, _ = await served.admin_json(
            "post", "/v1/tenants", dave(tier="batch", reservation="5%")
        )
        assert code == 201
    async with serving(tmp_path, config_path=config_path) as restarted:
        data = await restarted.status()
        bob = next(t for t in data["tenants"] if t["name"] == "bob")
        assert bob["reservation"] == "40%"
        assert data["sharing_policy"] == "shared" and data["budget_mode"] == "static"
        assert "dave" in {t["name"] for t in data["tenants"]}
        overrides = ["tenants", "budget.mode", "sharing.policy"]
        assert data["state"]["restored"]["overrides"] == overrides
        restored = restarted.named("lifecycle.state_restored")[0]
        assert restored["log_level"] == "warning" and restored["overrides"] == overrides
        assert (await restarted.complete(DAVE, "I persist")).status_code == 200
        assert len((await restarted.admin_json("get", "/v1/audit"))[1]) == 4


def test_a_torn_or_edited_state_file_is_refused(tmp_path: Path) -> None:
    from kvd.server.config import load_config
    from kvd.server.daemon import Daemon

    async def write_state() -> None:
        async with serving(tmp_path) as served:
            assert (await served.admin_json("put", "/v1/budget", {"mode": "static"}))[0] == 200
            assert (await served.admin_json("put", "/v1/sharing", {"policy": "shared"}))[0] == 200

    trio.run(write_state)
    config = load_config(tmp_path / "kvd.toml")
    state = tmp_path / "state.json"
    good = state.read_bytes()
    state.write_bytes(good[: len(good) // 2])  # a torn write
    with pytest.raises(StateError, match="state file is corrupt") as torn:
        Daemon(config).restore()
    assert "state.json.prev" in str(torn.value)
    assert state.read_bytes() == good[: len(good) // 2]  # nothing overwritten
    previous = json.loads((tmp_path / "state.json.prev").read_text())
    assert previous["format"] == "kvd-state/1"
    state.write_bytes(good.replace(b'"shared"', b'"public"'))  # valid JSON, wrong checksum
    with pytest.raises(StateError, match="checksum"):
        Daemon(config).restore()


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
async def test_the_os_refuses_a_user_without_access(tmp_path: Path) -> None:
    """Root bypasses file modes, so the probe runs as 'nobody' (the venv's
    python lives under /root, out of nobody's reach: the system python
    connects instead, as kvctl would)."""
    async with serving(tmp_path, admin_socket=True) as served:
        sock = served.daemon.admin_socket
        assert sock.stat().st_mode & 0o777 == 0o660  # root:root, so nobody is "other"
        sock.parent.chmod(0o755)  # only the socket's own mode may decide

        async def probe() -> str:
            result = await trio.run_process(
                ["/usr/bin/python3", "-c", PROBE, str(sock)],
                capture_stdout=True,
                capture_stderr=True,
                check=False,
                user=65534,
                group=65534,
                extra_groups=[],
                env={"PATH": "/usr/bin:/bin"},
            )
            return (result.stdout or result.stderr).decode().strip()

        assert await probe() == "refused"
        sock.chmod(0o666)  # the control: the same user with the mode open connects
        assert await probe() == "connected"


async def test_a_removed_admin_socket_directory_is_made_again(tmp_path: Path) -> None:
    async with serving(tmp_path, admin_socket=True) as served:
        shutil.rmtree(served.daemon.admin_socket.parent)
        await until(lambda: served.named("admin.socket_restored"), "the socket bound again")
        assert served.named("admin.socket_lost")
        result = await kvctl(served, "status", "--json")
        assert result.returncode == 0, result.stderr


async def test_a_second_daemon_on_the_admin_socket_is_refused(tmp_path: Path) -> None:
    from kvd.server.config import ConfigError
    from kvd.server.daemon import prepare_socket_path

    async with serving(tmp_path, admin_socket=True) as served:
        with pytest.raises(ConfigError, match="another daemon is listening"):
            prepare_socket_path(served.daemon.admin_socket)
        assert (await kvctl(served, "status", "--json")).returncode == 0
    # The daemon gone, its socket is stale: the next start replaces it.
    stale = served.daemon.admin_socket
    import socket

    with socket.socket(socket.AF_UNIX) as left:
        left.bind(str(tmp_path / "stale.sock"))
    prepare_socket_path(tmp_path / "stale.sock")
    assert not (tmp_path / "stale.sock").exists()
    assert stale.parent.exists()


async def test_the_host_cache_through_status_metrics_and_flush(tmp_path: Path) -> None:
    """A pool smaller than the prompts it serves: evicted cached blocks go to
    the host cache (charged to their tenant), a quota set live drops them, a
    flush empties the host cache, and a repeated greedy prompt answers the same.
    The pool holds int8 K/V: pages (scales included) are what status counts."""
    async with serving(tmp_path, pool="80KiB", host_size="4MiB", kv_dtype="int8") as served:
        # Copies cheaper than any recompute: whether a host hit is reloaded is
        # the cost model's call (measured rates, which a busy machine skews),
        # and this test is about the host cache's plumbing.
        rates = served.scheduler.rates
        if rates is not None:
            served.scheduler.rates = msgspec.structs.replace(
                rates, copy_fixed_s=0.0, copy_s_per_page=1e-12
            )
        described = await served.status()
        assert described["model"]["kv_dtype"] == "int8"
        # 6 layers x 1 KV head x (16 int8 values + a 4-byte scale) x K and V, 16 tokens a page.
        page_bytes = described["pool"]["page_bytes"]
        assert page_bytes * described["pool"]["pages"] <= 80 * 1024
        assert page_bytes % (16 * 2 * (16 + 4)) == 0
        first = await served.complete(ALICE, "alpha beta gamma " * 60)
        assert first.status_code == 200
        for i in range(3):  # other long prompts take the pool's pages
            flood = await served.complete(BOB, f"{i} delta epsilon zeta " * 50)
            assert flood.status_code == 200
        await served.assert_whole()
        status = await served.status()
        tenants = {t["name"]: t for t in status["tenants"]}
        host = status["host"]
        assert host["pages"] > 0 and host["offloads"] > 0 and host["cached_pages"] > 0
        assert tenants["alice"]["host_cached_pages"] > 0
        metrics = await served.metrics()
        assert metrics['kvd_host_pages{use="cached"}'] == host["cached_pages"]
        assert 'kvd_prefix_hit_tokens_by_memory_total{memory="host"}' in metrics
        again = await served.complete(ALICE, "alpha beta gamma " * 60)
        assert (await again.get_json())["choices"][0]["text"] == (await first.get_json())[
            "choices"
        ][0]["text"]
        assert (await served.status())["prefix_cache"]["host_hit_tokens"] > 0
        # A quota of 0 leaves alice nothing on the host; bob keeps his.
        code, _ = await served.admin_json("patch", "/v1/tenants/alice", {"host_quota": "0"})
        assert code == 200
        tenants = {t["name"]: t for t in (await served.status())["tenants"]}
        assert tenants["alice"]["host_cached_pages"] == 0
        assert tenants["alice"]["host_quota"] == "0" and tenants["alice"]["host_quota_pages"] == 0
        assert (await served.admin_json("post", "/v1/flush"))[0] == 200
        assert (await served.status())["host"]["cached_pages"] == 0
        await served.assert_whole()


def test_kvctl_text_of_a_host_cache(tmp_path: Path) -> None:
    """kvctl's status table shows the host quota column once a host cache exists."""

    async def main() -> subprocess.CompletedProcess[bytes]:
        async with serving(tmp_path, admin_socket=True, host_size="4MiB") as served:
            return await kvctl(served, "status")

    result = trio.run(main)
    assert result.returncode == 0 and b"HOST QUOTA" in result.stdout, result.stdout


async def test_an_admin_change_sees_the_step_in_flight_read(served: Served) -> None:
    """Steps overlap: a change waits for the step in flight to be read (every
    sampled token recorded), a read of figures does not; the request goes on."""
    runtime = served.daemon.runtime
    assert runtime is not None
    seen: list[tuple[bool, bool]] = []
    done = trio.Event()

    async def watch() -> None:
        while not done.is_set():
            busy = served.scheduler.in_flight
            quiet = await runtime.call(lambda: served.scheduler.in_flight)
            seen.append((busy, quiet))
            await trio.sleep(0)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch)
        reply = await served.complete(prompt="a long one", max_tokens=40, ignore_eos=True)
        done.set()
    assert reply.status_code == 200
    assert (await reply.get_json())["usage"]["completion_tokens"] == 40
    assert any(busy for busy, _ in seen)  # steps were in flight between calls
    assert not any(quiet for _, quiet in seen)  # but never when a change ran
    await served.assert_whole()
