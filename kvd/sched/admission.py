"""What a request must be to be queued: the one place prompts are checked.

The API checks a body with these before it queues anything (so a client gets
its 400 or 413 without waiting), and the scheduler checks again at submit
(so a caller that is not the API cannot slip past them).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from kvd.kv.manager import KVManager
from kvd.sched.book import RequestBook
from kvd.sched.constraint import Constraint
from kvd.sched.executor import ExecutorSizes
from kvd.sched.ratelimit import RateLimited
from kvd.sched.requests import Rejection, Request
from kvd.sched.sampling_params import SamplingParams
from kvd.sched.settings import SchedulerConfig, TenantConfig
from kvd.sched.stopping import StopCondition


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


def choice_id(request_id: str, choice: int, n: int) -> str:
    """The scheduler's id of one choice of a request (the request's own, if n = 1)."""
    return request_id if n == 1 else f"{request_id}#{choice}"


def total_tokens(prompt_len: int, max_tokens: int, max_model_len: int) -> int:
    """The length at which a request's sequence ends: its prompt and max_tokens,
    or the whole context if that is shorter."""
    return prompt_len + min(max_tokens, max_model_len - prompt_len)


class Admission:
    """Changes, through the book's methods (``enqueue``, ``rate_limited``):
    the queues, the live requests, the tenants' ``rate_limited`` counts and
    the fair-share counters (a tenant becoming active); and the tenants'
    limiters, which charge a request's tokens on arrival."""

    def __init__(
        self,
        book: RequestBook,
        kv: KVManager,
        config: SchedulerConfig,
        limits: ExecutorSizes,
    ) -> None:
        self.book = book
        self.kv = kv
        self.config = config
        self.limits = limits

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
        n: int = 1,
        constraint: Constraint | None = None,
        stop: StopCondition | None = None,
    ) -> Request:
        """Queue a request, or raise Rejection (400/413/429/503) saying why.

        ``n`` > 1: that many choices, each its own sequence (events say which
        in ``choice``; ``cancel`` of ``request_id`` ends them all). The first
        prefills the prompt; the others start once it has, and find its full
        blocks in the prefix cache (one tenant, one salt: one scope), so the
        prompt is computed and held once, and each is charged only for the
        pages of its own. Seeded, choice i samples with seed + i (vLLM's
        rule, modulo 2**32). ``constraint``: the grammar every choice's output
        follows (each gets its own copy); ``stop``: the watch on its stop
        strings (likewise). Returns the first choice's request."""
        config = self._check_request(request_id, tenant, params, n, stop)
        max_length = self._max_length(tenant, prompt, params)
        tier_index = self._tier(config, tier)
        self._check_queue(tenant, config)
        now = self.book.clock()
        # The prompt once, each choice's completion.
        self._charge(tenant, max_length + (n - 1) * (max_length - len(prompt)), now)
        choices = [
            Request(
                request_id=choice_id(request_id, choice, n),
                reply_id=request_id,
                choice=choice,
                tenant=tenant,
                max_length=max_length,
                prompt_len=len(prompt),
                params=_choice_params(params, choice),
                prompt=list(prompt),
                tier=tier_index,
                arrival=now,
                deadline=None if deadline_s is None else now + deadline_s,
                cache_salt=cache_salt,
                order_key=(tier_index, now, next(self.book.serials)),
                arrival_step=self.book.steps,
                # Each choice follows its own copy of the grammar and the stop watch.
                constraint=None
                if constraint is None
                else constraint.fork()
                if choice
                else constraint,
                stop=None if stop is None else stop.fork() if choice else stop,
            )
            for choice in range(n)
        ]
        first = choices[0]
        first.other_choices = choices[1:]
        for other in first.other_choices:
            other.first_choice = first
        self.book.enqueue(first, choices)
        return first

    def _check_request(
        self,
        request_id: str,
        tenant: str,
        params: SamplingParams,
        n: int,
        stop: StopCondition | None,
    ) -> TenantConfig:
        """Who asks, and whether the request can be told apart and watched."""
        config = self.book.tenants.get(tenant)
        if config is None:
            raise Rejection(401, "unknown_tenant", f"unknown tenant {tenant!r}")
        if n < 1:
            raise Rejection(400, "bad_n", "n must be at least 1")
        if params.stop and stop is None:
            # The scheduler cannot decode: stop strings it was not given a
            # watch for would be silently ignored.
            raise Rejection(
                400, "unwatched_stop", "stop strings need a StopCondition to watch them"
            )
        if request_id in self.book.requests or request_id in self.book.choices:
            raise Rejection(400, "duplicate_id", f"request {request_id!r} already exists")
        return config

    def _max_length(self, tenant: str, prompt: list[int], params: SamplingParams) -> int:
        """The request's most tokens, if the model and the tenant's pages allow them."""
        limit = self.limits.max_model_len
        problem = prompt_problem(prompt, self.limits.vocab_size, limit)
        if problem is not None:
            raise problem
        max_length = total_tokens(len(prompt), params.max_tokens, limit)
        # Chunks shrink to the pages a tenant may take, so what a request needs
        # is what it holds computed a block at a time.
        pages = self.kv.layout.pages_for_tokens(max_length)
        most, limited_by = self.kv.most_pages(tenant)
        if pages > most:
            raise Rejection(
                413,
                "too_large",
                f"prompt plus max_tokens need {pages} KV pages; {limited_by} allows "
                f"{most}: lower max_tokens or shorten the prompt",
            )
        return max_length

    def _tier(self, config: TenantConfig, tier: str | None) -> int:
        tier_name = tier or config.tier
        if tier_name not in self.config.tiers:
            raise Rejection(400, "bad_tier", f"unknown priority tier {tier_name!r}")
        return self.config.tiers.index(tier_name)

    def _check_queue(self, tenant: str, config: TenantConfig) -> None:
        # A request's choices count as one queued request (they start together).
        if len({r.reply_id for r in self.book.queues[tenant]}) >= config.max_queue:
            raise Rejection(
                429, "queue_full", f"tenant queue is full ({config.max_queue} waiting)", 1.0
            )

    def _charge(self, tenant: str, tokens: int, now: float) -> None:
        """Charge ``tokens`` to the tenant's rate limits, or refuse the request."""
        try:
            self.book.limiters[tenant].admit(tokens, now)
        except RateLimited as exc:
            if exc.retry_after is None:  # larger than a whole minute's allowance
                raise Rejection(
                    400, "exceeds_rate_limit", f"{exc}: lower max_tokens or the prompt"
                ) from None
            self.book.rate_limited(tenant)
            raise Rejection(429, "rate_limited", str(exc), exc.retry_after) from None


def _choice_params(params: SamplingParams, choice: int) -> SamplingParams:
    """Seeded, choice i samples with seed + i (vLLM's rule, modulo 2**32)."""
    if choice and params.seed is not None:
        return msgspec.structs.replace(params, seed=(params.seed + choice) % 2**32)
    return params
