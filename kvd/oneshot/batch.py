"""Whole prompts run to completion through the scheduler, for one-shot use:
``kvd generate``, benchmarks and tests. There is no second scheduler: this is
the multi-tenant one with a single tenant of this generator's own, in
``free`` mode, stepped until every request is done."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from kvd.kv.ledger import BudgetMode
from kvd.kv.manager import KVManager
from kvd.sched.executor import Executor
from kvd.sched.requests import Rejection
from kvd.sched.sampling_params import SamplingParams
from kvd.sched.scheduler import Scheduler
from kvd.sched.settings import SchedulerConfig, TenantConfig


class GenerationError(ValueError):
    """A prompt the generator refuses (empty, too long, outside the vocabulary...)."""


@dataclass
class Generation:
    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    # Per token, the most likely tokens with their logprobs (``top_logprobs``).
    alternatives: list[tuple[tuple[int, float], ...] | None] = field(default_factory=list)
    finish_reason: str | None = None
    cached_tokens: int = 0
    first_token_s: float | None = None


class BatchGenerator:
    def __init__(
        self,
        executor: Executor,
        *,
        kv: KVManager | None = None,
        tenant: str = "batch",
        overlap: bool = True,
    ) -> None:
        self.scheduler = Scheduler(
            executor, SchedulerConfig(mode=BudgetMode.FREE, overlap=overlap), kv=kv
        )
        self.tenant = tenant
        self.scheduler.set_tenant(TenantConfig(tenant, max_queue=1 << 30))
        self.kv = self.scheduler.kv
        self._ids = itertools.count()

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[Generation]:
        """Run every prompt to completion, batched together; raises
        GenerationError (changing nothing) if any prompt is refused."""
        scheduler = self.scheduler
        if len(prompts) != len(params):
            raise GenerationError(f"{len(prompts)} prompts but {len(params)} sampling parameters")
        ids = [f"g{next(self._ids)}" for _ in prompts]
        handles = {}
        try:
            for request_id, prompt, p in zip(ids, prompts, params, strict=True):
                handles[request_id] = scheduler.submit(request_id, self.tenant, prompt, p)
        except Rejection as exc:
            for request_id in handles:
                scheduler.cancel(request_id)
            raise GenerationError(str(exc)) from None
        results = {i: Generation(list(prompt)) for i, prompt in zip(ids, prompts, strict=True)}
        start = time.perf_counter()
        while scheduler.has_work():
            events = scheduler.step().events
            if not events and scheduler.stalled:
                raise GenerationError("the KV pool is too small for these prompts")
            for event in events:
                result = results[event.request_id]
                if event.token is not None:
                    if result.first_token_s is None:
                        result.first_token_s = time.perf_counter() - start
                        result.cached_tokens = handles[event.request_id].cached_tokens
                    result.completion_ids.append(event.token)
                    result.logprobs.append(event.logprob)
                    result.alternatives.append(event.top)
                if event.finished:
                    result.finish_reason = event.finish_reason
        return [results[i] for i in ids]
