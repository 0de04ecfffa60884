"""What a request must be to be queued: the one place prompts are checked.

The API checks a body with these before it queues anything (so a client gets
its 400 or 413 without waiting), and the scheduler checks again at submit
(so a caller that is not the API cannot slip past them).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvd.engine.sampling_params import SamplingParams
from kvd.sched.core import SchedulerCore
from kvd.sched.ratelimit import RateLimited
from kvd.sched.requests import Rejection, Request


def prompt_problem(prompt: Sequence[int], vocab_size: int, max_model_len: int) -> Rejection | None:
    """Why ``prompt`` cannot run on a model of this vocabulary and context, or None."""
    if not prompt:
        return Rejection(400, "empty_prompt", "the prompt is empty")
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        bad = next(t for t in prompt if not 0 <= t < vocab_size)
        return Rejection(
            400, "bad_token", f"token id {bad} is outside the vocabulary (0 to {vocab_size - 1})"
        )
    if len(prompt) >= max_model_len:
        return Rejection(
            413,
            "prompt_too_long",
            f"the prompt has {len(prompt)} tokens; this model's context is {max_model_len} "
            "tokens, and at least one must be left for the completion",
        )
    return None


def total_tokens(prompt_len: int, max_tokens: int, max_model_len: int) -> int:
    """The length at which a request's sequence ends: its prompt and max_tokens,
    or the whole context if that is shorter."""
    return prompt_len + min(max_tokens, max_model_len - prompt_len)


class Admission(SchedulerCore):
    def submit(
        self,
        request_id: str,
        tenant: str,
        prompt: list[int],
        params: SamplingParams,
        *,
        tier: str | None = None,
        deadline_s: float | None = None,
        cache_salt: str | None = None,
    ) -> Request:
        """Queue a request, or raise Rejection (400/413/429/503) saying why."""
        config = self.tenants.get(tenant)
        if config is None:
            raise Rejection(401, "unknown_tenant", f"unknown tenant {tenant!r}")
        if request_id in self.requests:
            raise Rejection(400, "duplicate_id", f"request {request_id!r} already exists")
        limit = self.limits.max_model_len
        problem = prompt_problem(prompt, self.limits.vocab_size, limit)
        if problem is not None:
            raise problem
        stop_length = total_tokens(len(prompt), params.max_tokens, limit)
        # Chunks shrink to the pages a tenant may take, so what a request needs
        # is what it holds computed a block at a time.
        pages = self.kv.layout.pages_for_tokens(stop_length)
        most, limited_by = self.kv.ledger.most(tenant)
        if pages > most:
            raise Rejection(
                413,
                "too_large",
                f"prompt plus max_tokens need {pages} KV pages; {limited_by} allows "
                f"{most}: lower max_tokens or shorten the prompt",
            )
        tier_name = tier or config.tier
        if tier_name not in self.config.tiers:
            raise Rejection(400, "bad_tier", f"unknown priority tier {tier_name!r}")
        queue = self.queues[tenant]
        if len(queue) >= config.max_queue:
            raise Rejection(
                429, "queue_full", f"tenant queue is full ({config.max_queue} waiting)", 1.0
            )
        now = self.clock()
        try:
            self.limiters[tenant].admit(stop_length, now)
        except RateLimited as exc:
            if exc.retry_after is None:  # larger than a whole minute's allowance
                raise Rejection(
                    400, "exceeds_rate_limit", f"{exc}: lower max_tokens or the prompt"
                ) from None
            self.tenant_stats[tenant].rate_limited += 1
            raise Rejection(429, "rate_limited", str(exc), exc.retry_after) from None
        tier_index = self.config.tiers.index(tier_name)
        request = Request(
            request_id=request_id,
            tenant=tenant,
            stop_length=stop_length,
            prompt_len=len(prompt),
            params=params,
            prompt=list(prompt),
            tier=tier_index,
            arrival=now,
            deadline=None if deadline_s is None else now + deadline_s,
            cache_salt=cache_salt,
            order_key=(tier_index, now, next(self._serials)),
            arrival_step=self.steps,
        )
        if not queue and not self._backlogged(tenant):
            self.counters.activate(tenant, self._active_tenants())
        queue.append(request)
        self.requests[request_id] = request
        return request
