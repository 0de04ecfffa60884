"""A workload trace replayed through the real scheduler and KV core, with no
model: the simulated executor stands in for the device (its "model" is a
hash of the context, and it checks every page it reads), and time is virtual,
advanced by a notional device's step time. Any geometry and pool size runs,
the seed's Gemma 4 12B in 3.8 GiB included.

What comes out: per request its prompt, cached (prefix-hit) tokens and TTFT
in virtual seconds; per step, the bytes that hold live KV against the bytes
the pool has handed out (fragmentation); and the order requests started and
finished in, from which the ideal unbounded cache is computed.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

import msgspec
import numpy as np

from kvd.experiments.workload import Session, platform_segment, segment_tokens
from kvd.kv.geometry import KVGeometry
from kvd.kv.layout import PageLayout, build_layout
from kvd.kv.ledger import BudgetMode
from kvd.kv.scope import PublicPrefixes, SharingPolicy, chain_hashes, resolve_scope
from kvd.sched.costmodel import Rates
from kvd.sched.executor import ExecutorSizes
from kvd.sched.requests import Rejection
from kvd.sched.sampling_params import SamplingParams
from kvd.sched.scheduler import Scheduler
from kvd.sched.settings import SchedulerConfig, TenantConfig
from kvd.sched.simulated import SimulatedExecutor

VOCAB = (10, 60_000)
PLATFORM = "platform"


class ReplaySettings(msgspec.Struct, frozen=True):
    geometry: KVGeometry
    pool_bytes: int
    block_size: int = 16
    policy: SharingPolicy = SharingPolicy.PUBLIC
    salts: bool = False  # each end user's requests carry their own cache_salt
    max_model_len: int = 32768
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # A notional accelerator for virtual time (not a measurement): a step costs
    # 15 ms plus 40 us per token of its bucket.
    step_fixed_s: float = 0.015
    step_token_s: float = 40e-6
    sample_every: int = 1  # fragmentation samples: every this many steps
    # The contiguous baseline reserves prompt + this (a client's max_tokens cap:
    # the seed's "might generate 2,000 tokens but actually generates 100").
    reserve_tokens: int = 2000


class RequestRecord(msgspec.Struct):
    request_id: str
    session: str
    tenant: str
    turn: int
    sent_s: float
    prompt_tokens: int
    cached_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float | None = None
    rejected: str | None = None
    start_step: int = -1  # the step it started in (its prompt's blocks enter the cache)
    finish_step: int = -1  # the step it finished in (its output's blocks enter the cache)


class FragmentationSample(msgspec.Struct, frozen=True):
    step: int
    sequences: int  # running, holding pages
    live_bytes: int  # K/V bytes a future query can still read, shared pages once
    allocated_bytes: int  # pages held by live sequences (shared once), whole pages
    referenced_bytes: int  # pages the pool counts referenced (public-prefix pins too)
    # The same sequences in a contiguous allocator: nothing shared, each holding
    # its K/V unpaged (live), and reserving up front either its own bound
    # (prompt + max_tokens) or the model's context; windows reserve at most
    # the window.
    contiguous_live_bytes: int
    contiguous_bytes: int
    context_bytes: int


class ReplayResult(msgspec.Struct):
    requests: list[RequestRecord]
    samples: list[FragmentationSample]
    steps: int
    virtual_s: float
    prompts: dict[str, list[int]]  # request id -> prompt ids (for the ideal cache)
    finished_tokens: dict[str, list[int]]  # request id -> prompt + output ids


def prompt_ids(session: Session, turn: int, history: list[int]) -> list[int]:
    """The turn's prompt: the session's head, then every earlier turn with its
    reply (``history``), then this turn's user segment."""
    if turn == 0:
        head = [2]  # BOS, as the tokenizer adds it
        for segment in session.head:
            head += segment_tokens(segment, VOCAB)
        return head + segment_tokens(session.turns[0].user, VOCAB)
    return history + segment_tokens(session.turns[turn].user, VOCAB)


def platform_ids(sessions: list[Session]) -> list[int]:
    return [2, *segment_tokens(platform_segment(sessions), VOCAB)]


def notional_rates(layout: PageLayout, settings: ReplaySettings) -> Rates:
    return Rates(
        prefill_fixed_s=settings.step_fixed_s,
        prefill_s_per_token=settings.step_token_s,
        copy_fixed_s=1e-4,
        copy_s_per_page=layout.page_bytes / 10e9,  # a 10 GB/s host link
        page_bytes=layout.page_bytes,
        pages_per_token=len(layout.groups) / layout.block_size,
        chunk_tokens=settings.max_num_batched_tokens,
    )


class VirtualClock:
    """The replay's time: it moves by each step's predicted duration."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def build_scheduler(
    settings: ReplaySettings, tenants: list[str], mode: BudgetMode, clock: VirtualClock
) -> Scheduler:
    layout = build_layout(settings.geometry, settings.block_size)
    pages = layout.pool_tokens(settings.pool_bytes) // settings.block_size * layout.num_groups
    buckets = tuple(2**i for i in range(1, 20) if 2**i <= settings.max_num_batched_tokens)
    limits = ExecutorSizes(
        max_model_len=settings.max_model_len,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        vocab_size=VOCAB[1] + 10,
        token_buckets=buckets,
    )
    executor = SimulatedExecutor(layout, pages + 1, limits, frozenset())
    scheduler = Scheduler(
        executor,
        SchedulerConfig(mode=mode, policy=settings.policy, preemption="recompute"),
        rates=notional_rates(layout, settings),
        clock=clock,
    )
    for name in tenants:
        scheduler.set_tenant(TenantConfig(name, max_queue=100_000))
    return scheduler


def replay(
    sessions: list[Session],
    settings: ReplaySettings,
    *,
    mode: BudgetMode = BudgetMode.FREE,
    on_step: Callable[[Scheduler], None] | None = None,
) -> ReplayResult:
    tenants = sorted({s.tenant for s in sessions})
    clock = VirtualClock()
    scheduler = build_scheduler(settings, tenants, mode, clock)
    kv = scheduler.kv
    if settings.policy is not SharingPolicy.ISOLATED:
        kv.add_public_prefix(PLATFORM, platform_ids(sessions))
    now = 0.0
    pending: list[tuple[float, int, int]] = [(s.arrival_s, i, 0) for i, s in enumerate(sessions)]
    heapq.heapify(pending)
    history: dict[str, list[int]] = {}
    records: dict[str, RequestRecord] = {}
    outputs: dict[str, list[int]] = {}
    index_of = {s.session_id: i for i, s in enumerate(sessions)}
    out = ReplayResult([], [], 0, 0.0, {}, {})
    sampler = _Sampler(kv.layout, settings)
    while pending or scheduler.has_work():
        if not scheduler.has_work() and pending:
            now = max(now, pending[0][0])
        clock.now = now
        while pending and pending[0][0] <= now:
            arrived, index, turn = heapq.heappop(pending)
            session = sessions[index]
            rid = f"{session.session_id}-{turn}"
            prompt = prompt_ids(session, turn, history.get(session.session_id, []))
            record = RequestRecord(
                rid, session.session_id, session.tenant, turn, arrived, len(prompt)
            )
            records[rid] = record
            out.prompts[rid] = prompt
            params = SamplingParams(temperature=0.0, max_tokens=session.turns[turn].max_tokens)
            try:
                scheduler.submit(
                    rid,
                    session.tenant,
                    prompt,
                    params,
                    cache_salt=session.user if settings.salts else None,
                )
            except Rejection as exc:
                record.rejected = exc.code  # the session ends here, as a client would give up
        result = scheduler.step()
        now += scheduler.last_step_predicted_s or settings.step_fixed_s
        out.steps = scheduler.steps
        for started in result.started:
            record = records[started.request_id]
            if record.start_step < 0:
                record.start_step = scheduler.steps
                record.cached_tokens = started.cached_tokens
        for event in result.events:
            record = records[event.request_id]
            if event.token is not None:
                outputs.setdefault(event.request_id, []).append(event.token)
                record.output_tokens += 1
                if record.ttft_s is None:
                    record.ttft_s = now - record.sent_s
            if event.finished:
                record.finish_step = scheduler.steps
                session = sessions[index_of[record.session]]
                full = out.prompts[event.request_id] + outputs.pop(event.request_id, [])
                out.finished_tokens[event.request_id] = full
                history[session.session_id] = full
                if record.turn + 1 < len(session.turns):
                    think = session.turns[record.turn + 1].think_s
                    heapq.heappush(
                        pending, (now + think, index_of[session.session_id], record.turn + 1)
                    )
        if on_step is not None:
            on_step(scheduler)
        if settings.sample_every and scheduler.steps % settings.sample_every == 0:
            out.samples.append(sampler.sample(scheduler))
    kv.check_invariants()
    out.requests = list(records.values())
    out.virtual_s = now
    return out


class _Sampler:
    """Live K/V bytes against allocated pages, over the live sequences."""

    def __init__(self, layout: PageLayout, settings: ReplaySettings) -> None:
        geometry = layout.geometry
        self.block = layout.block_size
        self.page_bytes = layout.page_bytes
        self.groups = [
            (g.index, g.window, len(g.layers) * geometry.bytes_per_token_per_layer(g.kind))
            for g in layout.groups
        ]
        self.token_bytes = geometry.bytes_per_token_total()
        self.window = geometry.window
        self.sliding_token_bytes = sum(b for _, w, b in self.groups if w is not None)
        self.global_token_bytes = self.token_bytes - self.sliding_token_bytes
        self.context = settings.max_model_len
        self.reserve = settings.reserve_tokens

    def sample(self, scheduler: Scheduler) -> FragmentationSample:
        live = 0
        pages_held = 0
        contiguous = 0
        block = self.block
        for g, window, token_bytes in self.groups:
            valid: dict[int, int] = {}
            for request in scheduler.book.running.values():
                seq = request.seq
                if seq is None or not seq.tables[g]:
                    continue
                computed = seq.num_computed
                first = 0 if window is None else max(0, computed - window + 1)
                table = np.asarray(seq.tables[g], np.int64)
                starts = np.arange(len(table)) * block
                counts = np.clip(
                    np.minimum(starts + block, computed) - np.maximum(starts, first), 0, block
                )
                held = table != 0
                for page, count in zip(table[held].tolist(), counts[held].tolist(), strict=True):
                    if count > valid.get(page, -1):
                        valid[page] = count
            live += sum(valid.values()) * token_bytes
            pages_held += len(valid)
        contiguous_live = context = sequences = 0
        for request in scheduler.book.running.values():
            if request.seq is None:
                continue
            sequences += 1
            # Live as the pages count it: a sliding layer's next query sees window - 1.
            contiguous_live += self._bytes(request.seq.num_computed, visible=True)
            contiguous += self._bytes(min(self.context, request.prompt_len + self.reserve))
            context += self._bytes(self.context)
        return FragmentationSample(
            scheduler.steps,
            sequences,
            live,
            pages_held * self.page_bytes,
            scheduler.kv.referenced_pages() * self.page_bytes,
            contiguous_live,
            contiguous,
            context,
        )

    def _bytes(self, tokens: int, visible: bool = False) -> int:
        window = (self.window - 1 if visible else self.window) if self.window else None
        sliding = min(tokens, window) if window else tokens
        return tokens * self.global_token_bytes + sliding * self.sliding_token_bytes


class CacheEvent(msgspec.Struct, frozen=True):
    """For the unbounded cache: at ``time`` a request looks its prompt up
    (``insert`` False), or full blocks of ``tokens`` become cached."""

    time: float
    insert: bool
    request_id: str
    tenant: str
    salt: str | None
    tokens: list[int]
    blocks: int  # full blocks that count (inserted, or at most looked up)


def unbounded_hits(
    events: list[CacheEvent], policy: SharingPolicy, block_size: int, public: list[int] | None
) -> dict[str, int]:
    """Per lookup, the tokens an unbounded cache under ``policy`` serves: every
    block ever inserted before it (a lookup at the same time as an insert
    does not see it, as requests started in one step do not see each
    other's blocks), kept forever, in the scopes the KV core uses."""
    prefixes = PublicPrefixes()
    if public is not None and policy is not SharingPolicy.ISOLATED:
        prefixes.add(PLATFORM, public)
    seen: set[bytes] = set()
    hits: dict[str, int] = {}
    for e in sorted(events, key=lambda e: (e.time, e.insert)):
        scope = resolve_scope(policy, e.tenant, e.salt, e.tokens, block_size, prefixes)
        hashes = chain_hashes(e.tokens, block_size, scope, 0, e.blocks, None)
        if e.insert:
            seen.update(hashes)
            continue
        hit = 0
        while hit < e.blocks and hashes[hit] in seen:
            hit += 1
        hits[e.request_id] = hit * block_size
    return hits


def ideal_hits(
    result: ReplayResult,
    policy: SharingPolicy,
    block_size: int,
    public: list[int] | None,
    salt_of: dict[str, str | None],
) -> dict[str, int]:
    """The unbounded cache over a replay: a prompt's blocks cached from the
    step it started in, its output's from the step it finished in (the last
    sampled token has no K/V)."""
    events = []
    for r in result.requests:
        if r.start_step < 0:
            continue
        prompt = result.prompts[r.request_id]
        salt = salt_of[r.request_id]
        lookup = (len(prompt) - 1) // block_size
        events.append(CacheEvent(r.start_step, False, r.request_id, r.tenant, salt, prompt, lookup))
        events.append(
            CacheEvent(
                r.start_step, True, r.request_id, r.tenant, salt, prompt, len(prompt) // block_size
            )
        )
        if r.finish_step >= 0:
            full = result.finished_tokens[r.request_id]
            done = (len(full) - 1) // block_size
            events.append(CacheEvent(r.finish_step, True, r.request_id, r.tenant, salt, full, done))
    return unbounded_hits(events, policy, block_size, public)
