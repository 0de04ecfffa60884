"""Question 3, the prefix-cache hit rate under a realistic multi-tenant
workload (workload.py: shapes from published production traces).

Two runs of the same trace shape, each under the `isolated`, `public` and
`shared` policies and under `public` with a cache salt per end user:

- the real daemon on the embedded 270M here, over HTTP: prompt and cached
  tokens from each response's usage, TTFT from the stream (lengths scaled
  down to what this CPU prefills in minutes);
- the KV core alone at Gemma 4 12B's geometry in the seed's 3.8 GiB pool
  (replay.py), at full length, TTFT in a notional device's virtual time.

Each run is set against the ideal: an unbounded cache under the same policy,
keeping every full block of every earlier prompt and of every finished
prompt + reply, forever.
"""

from __future__ import annotations

import hashlib
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import msgspec

from kvd.bench.daemon import QUICK_DAEMON, Completion, DaemonShape, LoggedDaemon, stream_completion
from kvd.bench.http import percentile
from kvd.experiments.replay import (
    CacheEvent,
    ReplaySettings,
    ideal_hits,
    platform_ids,
    replay,
    unbounded_hits,
)
from kvd.experiments.results import ExperimentResult, Say, new_result, pct, pyplot, save_plot, timed
from kvd.experiments.seed import seed_geometry, seed_pool_bytes
from kvd.experiments.workload import (
    Session,
    WorkloadShape,
    default_shape,
    generate,
    platform_segment,
    segment_text,
    total_requests,
)
from kvd.kv.scope import SharingPolicy

QUESTION = (
    "prefix cache hit rate under a realistic multi-tenant workload: a large win or a "
    "rounding error?"
)
RUNS = (("isolated", False), ("public", False), ("shared", False), ("public", True))


class PolicyFigures(msgspec.Struct):
    where: str  # "daemon" or "kv-core"
    policy: str
    salts: bool
    requests: int
    prompt_tokens: int
    cached_tokens: int
    hit_rate: float
    ideal_hit_rate: float
    ttft_p50_s: dict[str, float]  # per tenant
    ttft_p99_s: dict[str, float]
    failed: int = 0


def hit_verdict(hit_rate: float) -> str:
    """The seed's framing: "a large win or a rounding error"."""
    if hit_rate >= 0.2:
        return "a large win"
    return "a modest win" if hit_rate >= 0.05 else "a rounding error"


def _label(policy: str, salts: bool) -> str:
    return f"{policy}+salts" if salts else policy


def _ttfts(samples: dict[str, list[float]]) -> tuple[dict[str, float], dict[str, float]]:
    p50 = {t: round(percentile(v, 0.5), 3) for t, v in sorted(samples.items()) if v}
    p99 = {t: round(percentile(v, 0.99), 3) for t, v in sorted(samples.items()) if v}
    return p50, p99


def kv_core_run(sessions: list[Session], policy: str, salts: bool) -> PolicyFigures:
    settings = ReplaySettings(
        seed_geometry(), seed_pool_bytes(), policy=SharingPolicy(policy), salts=salts
    )
    replayed = replay(sessions, settings)
    users = {s.session_id: s.user for s in sessions}
    salt_of = {r.request_id: users[r.session] if salts else None for r in replayed.requests}
    ideal = ideal_hits(
        replayed, settings.policy, settings.block_size, platform_ids(sessions), salt_of
    )
    served = [r for r in replayed.requests if r.start_step >= 0]
    prompt = sum(r.prompt_tokens for r in served)
    cached = sum(r.cached_tokens for r in served)
    samples: dict[str, list[float]] = {}
    for r in served:
        if r.ttft_s is not None:
            samples.setdefault(r.tenant, []).append(r.ttft_s)
    p50, p99 = _ttfts(samples)
    return PolicyFigures(
        "kv-core",
        policy,
        salts,
        len(served),
        prompt,
        cached,
        cached / prompt if prompt else 0.0,
        sum(ideal.values()) / prompt if prompt else 0.0,
        p50,
        p99,
        failed=len(replayed.requests) - len(served),
    )


# -- the real daemon ---------------------------------------------------------------


def _key(tenant: str) -> str:
    return f"kvd-exp-{tenant}"


def _daemon_config(
    model: str, tenants: list[str], policy: str, platform: str, sock: str, shape: DaemonShape
) -> str:
    lines = [
        "[server]",
        'listen = "127.0.0.1:0"',
        'metrics_listen = "127.0.0.1:0"',
        f'admin_socket = "{sock}"',
        f'state_file = "{sock}.state.json"',
        "queue_timeout = 3600",
        "",
        "[model]",
        f'source = "{model}"',
        'name = "exp"',
        shape.toml(),
        "[pool]",
        f'size = "{shape.pool}"',
        "",
        "[sharing]",
        f'policy = "{policy}"',
        "",
        "[[prefixes]]",
        'name = "platform"',
        f"text = {msgspec.json.encode(platform).decode()}",
    ]
    for tenant in tenants:
        digest = hashlib.sha256(_key(tenant).encode()).hexdigest()
        lines += [
            "",
            "[[tenants]]",
            f'name = "{tenant}"',
            f'api_key_sha256 = "{digest}"',
            "max_queue = 256",
        ]
    return "\n".join(lines) + "\n"


class _Played(msgspec.Struct):
    tenant: str
    salt: str | None
    prompt_text: str
    reply_text: str
    started: float  # when it was sent (the ideal cache's order)
    finished: float
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    error: str | None = None


def play(url: str, sessions: list[Session], salts: bool, time_scale: float) -> list[_Played]:
    """Every session in its own thread, on the trace's clock (``time_scale``
    shrinks arrival and think times)."""
    played: list[_Played] = []
    lock = threading.Lock()
    begin = time.monotonic()

    def one(session: Session) -> None:
        time.sleep(max(0.0, session.arrival_s * time_scale - (time.monotonic() - begin)))
        history = "".join(segment_text(seg) for seg in session.head)
        for turn in session.turns:
            time.sleep(turn.think_s * time_scale)
            prompt = history + segment_text(turn.user)
            body: dict[str, Any] = {"model": "exp", "prompt": prompt, "max_tokens": turn.max_tokens}
            if salts:
                body["cache_salt"] = session.user
            sent = time.monotonic()
            error = None
            try:
                done = stream_completion(url, _key(session.tenant), body)
            except Exception as exc:  # recorded, and the session ends as a client's would
                done, error = Completion("", float("nan")), str(exc)[:200]
            with lock:
                played.append(
                    _Played(
                        session.tenant,
                        body.get("cache_salt"),
                        prompt,
                        done.text,
                        sent,
                        time.monotonic(),
                        done.prompt_tokens,
                        done.cached_tokens,
                        done.ttft_s,
                        error,
                    )
                )
            if error is not None:
                return
            history = prompt + done.text + "\n"

    threads = [threading.Thread(target=one, args=(s,)) for s in sessions]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return played


def daemon_ideal(
    played: list[_Played], tokenizer: Any, policy: SharingPolicy, platform: str, block: int = 16
) -> int:
    """Hit tokens of an unbounded cache over what the daemon was sent: prompts
    tokenized as the daemon does, each looked up when it was sent and its
    blocks cached from then on (the daemon caches a prompt's chunks as they
    are computed, which a client cannot see: this errs generous), and its
    prompt + reply's once finished."""
    events = []
    for i, p in enumerate(played):
        if p.error is not None:
            continue
        rid = str(i)
        prompt = tokenizer.encode(p.prompt_text)
        full = tokenizer.encode(p.prompt_text + p.reply_text)
        events += [
            CacheEvent(p.started, False, rid, p.tenant, p.salt, prompt, (len(prompt) - 1) // block),
            CacheEvent(p.started, True, rid, p.tenant, p.salt, prompt, len(prompt) // block),
            CacheEvent(p.finished, True, rid, p.tenant, p.salt, full, (len(full) - 1) // block),
        ]
    public = tokenizer.encode(platform) if policy is not SharingPolicy.ISOLATED else None
    return sum(unbounded_hits(events, policy, block, public).values())


def daemon_runs(
    model: str,
    sessions: list[Session],
    time_scale: float,
    say: Say,
    shape: DaemonShape,
) -> list[PolicyFigures]:
    """One daemon, every policy in turn: set live over the admin socket, as an
    operator would, with the cache flushed between runs."""
    from kvctl.admin import Client
    from kvd.engine.loader import embedded_tokenizer

    if model not in ("random", "gemma3-270m"):
        raise ValueError(
            f"the prefix experiment runs the embedded model or 'random', not {model!r}"
        )
    tokenizer = embedded_tokenizer()  # both speak the embedded model's vocabulary
    platform = segment_text(platform_segment(sessions))
    tenants = sorted({s.tenant for s in sessions})
    figures = []
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "prefix.toml"
        sock = f"{tmp}/a.sock"
        config.write_text(_daemon_config(model, tenants, "public", platform, sock, shape))
        say(f"  starting kvd serve ({model})")
        daemon = LoggedDaemon(config)
        try:
            url = daemon.wait_ready()
            admin = Client(sock)
            for policy, salts in RUNS:
                say(f"  {_label(policy, salts)}")
                admin.request("PUT", "/v1/sharing", {"policy": policy})
                admin.request("POST", "/v1/flush")
                played = play(url, sessions, salts, time_scale)
                figures.append(_daemon_figures(played, tokenizer, policy, salts, platform))
        finally:
            daemon.stop()
    return figures


def _daemon_figures(
    played: list[_Played], tokenizer: Any, policy: str, salts: bool, platform: str
) -> PolicyFigures:
    ok = [p for p in played if p.error is None]
    prompt = sum(p.prompt_tokens for p in ok)
    cached = sum(p.cached_tokens for p in ok)
    samples: dict[str, list[float]] = {}
    for p in ok:
        samples.setdefault(p.tenant, []).append(p.ttft_s)
    p50, p99 = _ttfts(samples)
    ideal = daemon_ideal(played, tokenizer, SharingPolicy(policy), platform)
    return PolicyFigures(
        "daemon",
        policy,
        salts,
        len(ok),
        prompt,
        cached,
        cached / prompt if prompt else 0.0,
        ideal / prompt if prompt else 0.0,
        p50,
        p99,
        failed=len(played) - len(ok),
    )


def daemon_shape(quick: bool) -> WorkloadShape:
    """The trace at a quarter of its lengths (replies at most 32 tokens): what
    this CPU serves in a couple of minutes per policy."""
    shape = default_shape(sessions=6 if quick else 36, duration_s=3 if quick else 90, scale=0.25)
    return msgspec.structs.replace(
        shape, max_reply=8 if quick else 32, think_s=0.5 if quick else 3.0
    )


def run(out: Path, quick: bool, say: Say, model: str | None = None) -> ExperimentResult:
    result = new_result(
        "prefix",
        QUESTION,
        quick,
        [
            "where",
            "policy",
            "requests",
            "prompt tok",
            "cached tok",
            "hit rate",
            "ideal",
            "TTFT p50 by tenant",
            "TTFT p99 by tenant",
        ],
    )
    with timed(result):
        model = model or ("random" if quick else "gemma3-270m")
        live_sessions = generate(daemon_shape(quick))
        engine_shape = QUICK_DAEMON if quick else DaemonShape(4096)
        core_shape = default_shape(sessions=16, duration_s=40) if quick else default_shape()
        core_sessions = generate(core_shape)
        figures: list[PolicyFigures] = []
        say(f"the KV core at Gemma 4 12B, 3.8 GiB: {total_requests(core_sessions)} requests")
        for policy, salts in RUNS:
            figures.append(kv_core_run(core_sessions, policy, salts))
        say(f"the real daemon ({model}): {total_requests(live_sessions)} requests per policy")
        figures += daemon_runs(model, live_sessions, 1.0, say, engine_shape)
        for f in figures:
            result.rows.append(
                [
                    f.where,
                    _label(f.policy, f.salts),
                    str(f.requests) + (f" ({f.failed} failed)" if f.failed else ""),
                    f"{f.prompt_tokens:,}",
                    f"{f.cached_tokens:,}",
                    pct(f.hit_rate),
                    pct(f.ideal_hit_rate),
                    " ".join(f"{t}:{v:.2f}" for t, v in f.ttft_p50_s.items()),
                    " ".join(f"{t}:{v:.2f}" for t, v in f.ttft_p99_s.items()),
                ]
            )
        result.data = {
            "daemon_model": model,
            "daemon_shape": msgspec.to_builtins(daemon_shape(quick)),
            "daemon_engine": msgspec.to_builtins(engine_shape),
            "kv_core_shape": msgspec.to_builtins(core_shape),
            "runs": msgspec.to_builtins(figures),
        }
        core = {(_label(f.policy, f.salts)): f for f in figures if f.where == "kv-core"}
        live = {(_label(f.policy, f.salts)): f for f in figures if f.where == "daemon"}
        hit = live["public"].hit_rate
        verdict = (
            "a large win" if hit >= 0.2 else "a modest win" if hit >= 0.05 else "a rounding error"
        )
        result.answer = (
            f"{verdict}: under the default `public` policy {pct(live['public'].hit_rate)} of "
            f"prompt tokens came from the cache on the real daemon "
            f"({pct(live['public'].ideal_hit_rate)} ideal), {pct(core['public'].hit_rate)} at "
            f"Gemma 4 12B in 3.8 GiB ({pct(core['public'].ideal_hit_rate)} ideal); "
            f"`isolated` {pct(live['isolated'].hit_rate)}/{pct(core['isolated'].hit_rate)}, "
            f"`shared` {pct(live['shared'].hit_rate)}/{pct(core['shared'].hit_rate)}, "
            f"per-user salts {pct(live['public+salts'].hit_rate)}/"
            f"{pct(core['public+salts'].hit_rate)} (daemon/KV core)"
        )
        result.notes += [
            "hit rate = cached prompt tokens / prompt tokens, over requests that ran; ideal = an "
            "unbounded cache under the same policy (every earlier prompt's full blocks, and every "
            "finished prompt + reply's), 16-token blocks",
            "daemon TTFT is wall time on this machine; KV-core TTFT is virtual time on a notional "
            "device (15 ms + 40 us per token per step), for comparing policies only",
        ]
        _plot(result, figures, out)
    return result


def _plot(result: ExperimentResult, figures: list[PolicyFigures], out: Path) -> None:
    plt = pyplot()
    figure, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for axis, where, title in (
        (axes[0], "daemon", f"real daemon ({result.data['daemon_model']}), this machine"),
        (axes[1], "kv-core", "KV core, Gemma 4 12B, 3.8 GiB pool"),
    ):
        rows = [f for f in figures if f.where == where]
        x = range(len(rows))
        axis.bar([i - 0.2 for i in x], [f.hit_rate for f in rows], 0.4, label="kvd")
        axis.bar(
            [i + 0.2 for i in x],
            [f.ideal_hit_rate for f in rows],
            0.4,
            label="unbounded cache",
            alpha=0.6,
        )
        axis.set_xticks(list(x), [_label(f.policy, f.salts) for f in rows])
        axis.set_ylim(0, 1)
        axis.set_ylabel("prompt tokens from the cache")
        axis.set_title(title, fontsize=9)
        axis.legend(fontsize=8)
    save_plot(figure, result, out)
