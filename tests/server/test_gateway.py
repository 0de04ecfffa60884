"""Two kvd replicas behind a real inference gateway: smg (Shepherd Model
Gateway, from PyPI) in front of two in-process daemons on real loopback
listeners, launched as docs/howto/scale-out.md says. The gateway registers both,
forwards each tenant's own key (so each request runs, and is billed, as its
tenant), and its cache-aware policy sends a repeated prefix back to the
replica that cached it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any, BinaryIO

import httpx
import pytest
import trio

from kvd.bench.fleet import free_port, smg_command
from tests.server.conftest import ALICE, BOB
from tests.server.harness import Served, serving

SMG = shutil.which("smg", path=str(Path(sys.executable).parent))
pytestmark = pytest.mark.skipif(SMG is None, reason="smg is not installed (the test extra)")

PROMPT = "A bakery's recipe book begins with the rules of the house: " * 8


def launch_smg(urls: list[str], policy: str, port: int, log: BinaryIO) -> subprocess.Popen[bytes]:
    """smg as an operator runs it in front of kvd (docs/howto/scale-out.md): alice's
    key is the gateway's own, bob's is listed and forwarded as it came."""
    args = smg_command(urls, policy, port, ALICE, {"bob": BOB})
    return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)


async def registered(gateway: str, count: int) -> list[dict[str, Any]]:
    """The gateway's workers once ``count`` are ready with kvd's model id."""
    async with httpx.AsyncClient(timeout=5) as client:
        with trio.fail_after(60):
            while True:
                try:
                    reply = await client.get(
                        f"{gateway}/workers", headers={"Authorization": f"Bearer {ALICE}"}
                    )
                    workers = reply.json().get("workers", []) if reply.status_code == 200 else []
                except httpx.TransportError:
                    workers = []
                ready = [w for w in workers if w["status"] == "ready" and w["model_id"] == "random"]
                if len(ready) == count:
                    return ready
                await trio.sleep(0.2)


async def complete(gateway: str, key: str, prompt: str) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=60) as client:
        reply = await client.post(
            f"{gateway}/v1/completions",
            json={"model": "random", "prompt": prompt, "max_tokens": 4, "temperature": 0},
            headers={"Authorization": f"Bearer {key}"},
        )
    assert reply.status_code == 200, reply.text
    return reply.json()  # type: ignore[no-any-return]


async def served_by(replicas: list[Served], tenant: str) -> list[int]:
    """Requests each replica answered for ``tenant`` (its own metrics)."""
    counts = []
    for replica in replicas:
        metrics = await replica.metrics()
        counts.append(
            int(
                sum(
                    value
                    for name, value in metrics.items()
                    if name.startswith("kvd_requests_total{") and f'tenant="{tenant}"' in name
                )
            )
        )
    return counts


@pytest.mark.parametrize("policy", ["cache_aware", "round_robin"])
async def test_two_replicas_behind_smg(tmp_path: Path, policy: str) -> None:
    async with AsyncExitStack() as stack:
        replicas = []
        for name in ("a", "b"):
            (tmp_path / name).mkdir()
            replicas.append(
                await stack.enter_async_context(serving(tmp_path / name, http_socket=True))
            )
        urls = [f"http://{r.address[0]}:{r.address[1]}" for r in replicas]
        port = free_port()
        gateway = f"http://127.0.0.1:{port}"
        log = stack.enter_context((tmp_path / "smg.log").open("wb"))
        smg = launch_smg(urls, policy, port, log)
        try:
            workers = await registered(gateway, 2)
            assert {w["url"] for w in workers} == set(urls), (tmp_path / "smg.log").read_text()
            first = await complete(gateway, ALICE, PROMPT + "bread?")
            again = await complete(gateway, ALICE, PROMPT + "cake?")
            bob = await complete(gateway, BOB, PROMPT + "pie?")
            assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
            if policy == "cache_aware":
                # The repeat went where its prefix was: served from the cache.
                assert cached >= 64, (again, await served_by(replicas, "alice"))
                assert sorted(await served_by(replicas, "alice")) == [0, 2]
            else:
                assert cached == 0  # the other replica: blind routing re-prefills
                assert await served_by(replicas, "alice") == [1, 1]
            # Bob's request ran as bob (his key was forwarded), and never
            # from alice's blocks, wherever the gateway sent it.
            assert bob["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            assert sum(await served_by(replicas, "bob")) == 1
            no_key = httpx.post(f"{gateway}/v1/completions", json={"model": "random"}, timeout=10)
            assert no_key.status_code == 401
            for replica in replicas:
                await replica.assert_whole()
        finally:
            smg.terminate()
            smg.wait(timeout=10)
