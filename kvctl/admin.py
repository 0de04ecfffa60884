"""kvctl's live commands: a client of the daemon's admin API on its Unix socket.

Exit codes: 0 done; 1 the daemon refused (its message is printed); 2 bad
usage; 3 the daemon could not be reached (the socket path tried is printed).
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

import click
import httpx

from kvd.clikit import fail

DEFAULT_SOCKET = "/run/kvd/admin.sock"
EXIT_REFUSED = 1
EXIT_UNREACHABLE = 3


class Client:
    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path

    def request(self, method: str, path: str, body: Any = None) -> Any:
        transport = httpx.HTTPTransport(uds=self.socket_path)
        try:
            with httpx.Client(transport=transport, base_url="http://kvd", timeout=60) as http:
                response = http.request(method, path, json=body)
        except (httpx.TransportError, OSError) as exc:
            fail(
                f"cannot reach kvd at {self.socket_path}: {_reason(exc)}",
                code=EXIT_UNREACHABLE,
            )
        try:
            payload = response.json()
        except ValueError:
            fail(f"kvd answered {response.status_code} with a body that is not JSON", code=1)
        if response.status_code >= 400:
            message = payload.get("error") if isinstance(payload, dict) else None
            if isinstance(payload, dict) and "state" in payload:
                fail(_not_ready(payload), code=EXIT_REFUSED)
            fail(f"refused: {message or response.status_code}", code=EXIT_REFUSED)
        return payload


def _not_ready(payload: dict[str, Any]) -> str:
    """Why the daemon cannot answer (loading, draining, failed), and the
    failure that restarted it last, if any."""
    lines = [f"kvd is not ready ({payload['state']}): {payload['error']}"]
    last = payload.get("last_failure")
    if last:
        lines.append(_failures_line(last))
    return "\n".join(lines)


def _failures_line(failures: dict[str, Any]) -> str:
    return (
        f"engine failures recorded: {failures['count']}; the last at {failures['last_at']}: "
        f"{failures['last_cause']}"
    )


def _reason(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    if "No such file" in text or "[Errno 2]" in text:
        return "no such socket (is the daemon running? set --socket or KVD_ADMIN_SOCKET)"
    if "Permission denied" in text or "[Errno 13]" in text:
        return "permission denied (the socket's group must include you)"
    if "Connection refused" in text or "[Errno 111]" in text:
        return "connection refused (the daemon is not running)"
    return text


def client(ctx: click.Context) -> Client:
    return Client(ctx.find_root().params.get("socket") or DEFAULT_SOCKET)


def emit(data: Any, as_json: bool, render: Any) -> None:
    if as_json:
        click.echo(json.dumps(data, indent=2))
    else:
        click.echo(render(data))


def table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [headers] + [["-" if v is None else str(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(line.rstrip() for line in lines)


def _weights(model: dict[str, Any]) -> str:
    """``int8 312 MiB``: the weights' format and their bytes (older daemons: the dtype)."""
    held = model.get("weight_bytes")
    kind = model.get("quantization", "none")
    kind = model["dtype"] if kind == "none" else kind
    return kind if not held else f"{kind} {held / 2**20:.0f} MiB"


def _findable(pool: dict[str, Any]) -> str:
    """The prefix cache's findable blocks (a router's index holds the global ones)."""
    found = pool.get("findable_blocks")
    if not found:
        return ""
    return f"; findable blocks: {found['global']} full-attention, {found['sliding']} sliding"


def render_status(s: dict[str, Any]) -> str:
    pool = s["pool"]
    page_mib = pool["page_bytes"] / 2**20
    rates = s.get("rates") or {}
    prefix = s["prefix_cache"]
    lines = [
        f"kvd {s['version']} pid {s['pid']}, up {s['uptime_s']} s, device {s['device']}",
        f"model {s['model']['name']} ({s['model']['source']}, {s['model']['dtype']}, "
        f"weights {_weights(s['model'])}, "
        f"KV {s['model'].get('kv_dtype', s['model']['dtype'])}, "
        f"context {s['model']['max_model_len']})",
        f"pool {pool['pages']} pages x {page_mib:.3g} MiB: referenced {pool['referenced']}, "
        f"cached {pool['cached']}, free {pool['free']}, reserved {pool['reserved']}"
        + _findable(pool),
        f"budget {s['budget_mode']}, sharing {s['sharing_policy']}, "
        f"{'DRAINING' if s['draining'] else 'serving'}, {s['in_flight']} in flight "
        f"(running {s['requests']['running']}, waiting {s['requests']['waiting']}, "
        f"swapped {s['requests']['swapped']})",
        f"prefix cache: {prefix['hit_tokens']} of {prefix['query_tokens']} prompt tokens hit "
        f"({prefix['hit_rate']:.1%}; device {prefix.get('device_hit_tokens', 0)}, "
        f"host {prefix.get('host_hit_tokens', 0)})",
    ]
    hosts = s.get("hosts") or {}
    if hosts.get("processes", 1) > 1:
        lines.append(
            f"{hosts['processes']} hosts in lockstep; host 0's devices hold weights "
            f"{hosts['weight_bytes_per_host'] / 2**20:.0f} MiB and pool "
            f"{hosts['pool_bytes_per_host'] / 2**20:.0f} MiB (each host its share)"
        )
    host = s.get("host")
    if host and host["pages"]:
        lines.append(
            f"host cache {host['pages']} pages "
            f"({host['bytes'] / 2**30:.3g} GiB, shared with swap): "
            f"cached {host['cached_pages']}, swap {host['swap_pages']}, "
            f"offloaded {host['offloads']}, dropped {host['evictions']}"
        )
    restored = (s.get("state") or {}).get("restored")
    if restored and restored["overrides"]:
        lines.append(
            f"state file {restored['file']} overrides the config's "
            f"{', '.join(restored['overrides'])} (restored at start; remove it to use the config)"
        )
    elif restored:
        lines.append(f"state restored at start from {restored['file']} (same as the config)")
    if s.get("engine_failures"):
        lines.append(_failures_line(s["engine_failures"]))
    if rates:
        lines.append(
            f"measured: prefill {rates['prefill_tokens_per_s']} tok/s, copy "
            f"{rates['copy_bytes_per_s'] / 1e9:.3g} GB/s, swap beats recompute above "
            f"{rates['crossover_tokens']} tokens"
        )
    lines += ["", render_tenants(s["tenants"])]
    if s["prefixes"]:
        lines += ["", render_prefixes(s["prefixes"])]
    return "\n".join(lines)


def render_tenants(tenants: list[dict[str, Any]]) -> str:
    return table(
        ["TENANT", "TIER", "WEIGHT", "USED", "RESERVED", "CAP", "RUN", "WAIT", "SWAP",
         "HOST", "HOST QUOTA", "RPM", "TPM", "OUT TOKENS", "PREEMPT"],
        [
            [
                t["name"], t["tier"], t["weight"], t["charged_pages"], t["reservation_pages"],
                t["cap_pages"], t["running"], t["waiting"], t["swapped"],
                t.get("host_cached_pages", 0), t.get("host_quota_pages"),
                t["requests_per_minute"], t["tokens_per_minute"], t["completion_tokens"],
                t["preempted_recompute"] + t["preempted_swap"],
            ]
            for t in tenants
        ],
    )  # fmt: skip


def render_prefixes(prefixes: list[dict[str, Any]]) -> str:
    return table(
        ["PREFIX", "TOKENS", "REQUESTS", "HITS", "HIT TOKENS"],
        [[p["name"], p["tokens"], p["requests"], p["hits"], p["hit_tokens"]] for p in prefixes],
    )


def render_audit(entries: list[dict[str, Any]]) -> str:
    return table(
        ["AT", "CHANGE", "DETAIL"],
        [[e["at"], e["op"], json.dumps(e["detail"], sort_keys=True)] for e in entries],
    )


def done(result: dict[str, Any], as_json: bool, message: str) -> None:
    emit(result, as_json, lambda _: message)


def key_digest(key: str | None, key_sha256: str | None) -> str | None:
    if key is not None and key_sha256 is not None:
        fail("give --key or --key-sha256, not both")
    if key is not None:
        return hashlib.sha256(key.encode()).hexdigest()
    return key_sha256


def optional_number(value: str | None, option: str) -> float | None | str:
    """'unlimited' clears a limit (null); a number sets it; None leaves it."""
    if value is None:
        return "__unset__"
    if value == "unlimited":
        return None
    try:
        number = float(value)
    except ValueError:
        fail(f"{option} takes a number or 'unlimited', got {value!r}")
    if not math.isfinite(number) or number <= 0:
        fail(f"{option} must be a finite number > 0 (or 'unlimited'), got {value!r}")
    return number


def read_tokens(path: str) -> list[int]:
    """Token ids from a file, in the format the daemon's config reads."""
    from kvd.server.config import ConfigError, read_token_file

    try:
        return read_token_file(Path(path))
    except ConfigError as exc:
        fail(str(exc))


def wait_drained(c: Client, timeout: float | None) -> NoReturn:
    """Show in-flight requests counting down; exit 0 at zero, 1 on timeout."""
    start = time.monotonic()
    last = None
    while True:
        status = c.request("GET", "/v1/status")
        in_flight = status["in_flight"]
        if in_flight != last:
            click.echo(f"{in_flight} requests in flight", err=True)
            last = in_flight
        if in_flight == 0:
            click.echo("drained")
            sys.exit(0)
        if timeout is not None and time.monotonic() - start >= timeout:
            fail(f"{in_flight} requests still in flight after {timeout:g} s", code=EXIT_REFUSED)
        time.sleep(0.2)
