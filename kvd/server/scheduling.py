"""The scheduler the daemon serves with, over whichever executor computes
(the engine, or the simulated one in tests), built from the config or the
persisted admin state; and the tenant entries and public prefixes in its
terms: budgets in pages of the pool in force. Pure Python: the loader, the
admin API and the in-process tests share it, none of them through JAX."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvd.engine.tokenizer import Tokenizer
from kvd.sched.executor import Executor
from kvd.sched.ratelimit import RateLimits
from kvd.sched.scheduler import Scheduler, SchedulerConfig
from kvd.sched.settings import TenantConfig
from kvd.server.config import Config, ConfigError, pages_of, read_token_file
from kvd.server.state import LiveState, PrefixTokens
from kvd.units import parse_size


@dataclass
class Loaded:
    """What serving starts from: the scheduler over a warm executor."""

    scheduler: Scheduler
    tokenizer: Tokenizer
    vocab_size: int
    pool_pages: int
    page_bytes: int
    live: LiveState  # what the admin API changes, as applied
    weight_bytes: int = 0  # the model's parameters (int8 weights: values, scales, offsets)
    quantization: str = "none"  # as loaded: "none" or "int8"
    # Several processes: what stops the followers once the leader has drained.
    stop_followers: Callable[[], None] | None = None
    # Bytes of weights and pool on this host's devices (several hosts: each has its share).
    bytes_here: dict[str, int] = field(default_factory=dict)


def build_scheduler(
    config: Config, executor: Executor, live: LiveState, page_bytes: int, **kw: Any
) -> Scheduler:
    """The scheduler with ``live``'s mode, policy, prefixes and tenants;
    ConfigError (or BudgetError) if the pool cannot honour them."""
    scheduler = Scheduler(
        executor,
        SchedulerConfig(
            tiers=tuple(config.tiers),
            mode=live.mode,
            policy=live.policy,
            preemption=config.budget.preemption,
            target_step_ms=config.scheduler.target_step_ms,
            swap_pages=swap_space_pages(config, page_bytes),
            host_pages=host_cache_pages(config, page_bytes),
            overlap=config.scheduler.overlap,
        ),
        **kw,
    )
    pool_pages = executor.num_pages - 1  # the null page holds nothing
    for prefix in live.prefixes:
        try:
            scheduler.kv.add_public_prefix(prefix.name, prefix.tokens)
        except ValueError as exc:
            raise ConfigError(f"prefixes.{prefix.name}: {exc}") from None
    for entry in live.tenants:
        scheduler.set_tenant(tenant_config(config, entry, page_bytes, pool_pages))
    return scheduler


def swap_space_pages(config: Config, page_bytes: int) -> int:
    """The host swap in pages, and the base of a tenant's ``swap`` share:
    ``pool.host_size`` when a host cache is set (swap shares its budget),
    else ``scheduler.swap_space``."""
    return host_cache_pages(config, page_bytes) or (
        parse_size(config.scheduler.swap_space) // page_bytes
    )


def host_cache_pages(config: Config, page_bytes: int) -> int:
    """``pool.host_size`` in pages: the host cache's budget, shared with swap
    (0: no host cache), and the base of a tenant's ``host_quota`` share."""
    if config.pool.host_size.strip() == "0":
        return 0
    return parse_size(config.pool.host_size) // page_bytes


def tenant_config(config: Config, entry: Any, page_bytes: int, pool_pages: int) -> TenantConfig:
    where = f"tenants.{entry.name}"
    reservation = pages_of(f"{where}.reservation", entry.reservation, page_bytes, pool_pages)
    cap = None
    if entry.burst_cap is not None:
        cap = pages_of(f"{where}.burst_cap", entry.burst_cap, page_bytes, pool_pages)
    swap = None
    if entry.swap is not None:
        space = swap_space_pages(config, page_bytes)
        swap = pages_of(f"{where}.swap", entry.swap, page_bytes, space)
    host_quota = None
    if entry.host_quota is not None:
        host_cache = host_cache_pages(config, page_bytes)
        host_quota = pages_of(f"{where}.host_quota", entry.host_quota, page_bytes, host_cache)
    return TenantConfig(
        name=entry.name,
        reservation_pages=reservation,
        cap_pages=cap,
        tier=entry.tier or config.tiers[0],
        weight=entry.weight,
        limits=RateLimits(entry.requests_per_minute, entry.tokens_per_minute),
        max_queue=entry.max_queue,
        swap_pages=swap,
        host_quota_pages=host_quota,
    )


def config_prefixes(config: Config, tokenizer: Tokenizer, vocab: int) -> list[PrefixTokens]:
    """The config's public prefixes as token ids (text is tokenized like a prompt)."""
    out = []
    for prefix in config.prefixes:
        if prefix.text is not None:
            tokens = tokenizer.encode(prefix.text)
        elif prefix.chat_system is not None:
            tokens = tokenizer.chat_system_prefix(prefix.chat_system)
        else:
            assert prefix.token_file is not None
            tokens = read_token_file(config.path(prefix.token_file))
        if any(not 0 <= t < vocab for t in tokens):
            raise ConfigError(f"prefixes.{prefix.name}: token ids outside the vocabulary")
        out.append(PrefixTokens(prefix.name, tokens))
    return out
