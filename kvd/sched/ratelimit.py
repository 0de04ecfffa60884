"""Per-tenant rate limits: requests per minute and tokens per minute.

Each limit is a token bucket: it holds up to one minute's allowance, refills
continuously, and a request is admitted only if every bucket can pay for it
now. A refusal says how long until a retry would succeed (the API's
Retry-After), and costs the tenant nothing. The token bucket is paid the
request's most (prompt + max_tokens) up front, as OpenAI does, and refunded
what it did not use when it ends: a chat without max_tokens costs what it
generated, not the whole context.
"""

from __future__ import annotations

import msgspec


class RateLimits(msgspec.Struct, frozen=True):
    requests_per_minute: float | None = None  # None: unlimited
    # Prompt + max_tokens of each request at admission; what it did not
    # generate goes back when it ends.
    tokens_per_minute: float | None = None


class TokenBucket:
    __slots__ = ("capacity", "level", "rate", "stamp")

    def __init__(self, per_minute: float, now: float) -> None:
        self.capacity = per_minute
        self.rate = per_minute / 60.0  # refill per second
        self.level = per_minute
        self.stamp = now

    def _refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def wait_for(self, amount: float, now: float) -> float | None:
        """Seconds until ``amount`` can be paid (0.0 if now); None if never (over capacity)."""
        self._refill(now)
        if amount > self.capacity:
            return None
        if amount <= self.level:
            return 0.0
        return (amount - self.level) / self.rate

    def pay(self, amount: float, now: float) -> None:
        self._refill(now)
        self.level -= amount

    def refund(self, amount: float, now: float) -> None:
        self._refill(now)
        self.level = min(self.capacity, self.level + amount)


class RateLimited(Exception):
    def __init__(self, message: str, retry_after: float | None) -> None:
        super().__init__(message)
        self.retry_after = retry_after  # None: the request can never pass this limit


class TenantLimiter:
    """The buckets of one tenant. ``admit`` checks every bucket, then pays."""

    def __init__(self, limits: RateLimits, now: float) -> None:
        self.limits = limits
        self.requests = (
            TokenBucket(limits.requests_per_minute, now) if limits.requests_per_minute else None
        )
        self.tokens = (
            TokenBucket(limits.tokens_per_minute, now) if limits.tokens_per_minute else None
        )
        self.rejected = 0

    def admit(self, tokens: int, now: float) -> None:
        waits = []
        for bucket, amount, what in (
            (self.requests, 1.0, "requests per minute"),
            (self.tokens, float(tokens), "tokens per minute"),
        ):
            if bucket is None:
                continue
            wait = bucket.wait_for(amount, now)
            if wait is None:
                self.rejected += 1
                raise RateLimited(
                    f"the request needs {amount:g} {what}; the limit is {bucket.capacity:g}", None
                )
            waits.append((wait, what))
        worst, what = max(waits, default=(0.0, ""))
        if worst > 0:
            self.rejected += 1
            raise RateLimited(f"rate limit of {what} reached; retry in {worst:.1f}s", worst)
        if self.requests is not None:
            self.requests.pay(1.0, now)
        if self.tokens is not None:
            self.tokens.pay(float(tokens), now)

    def refund(self, tokens: int, now: float) -> None:
        """Give back tokens paid for at admission and not used (a request
        that stopped before max_tokens, or never ran)."""
        if self.tokens is not None and tokens > 0:
            self.tokens.refund(float(tokens), now)
