"""Prometheus metrics: the scheduler's counters, and latency as clients see it.

Pool and tenant figures are read from the engine task's latest snapshot when
scraped (a collector, so nothing is updated per step). Latency histograms
(TTFT, inter-token, queue time) are observed by the HTTP handlers, per
tenant, at the moment a client is sent its tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvd.server.runtime import Runtime

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class SchedulerCollector(Collector):
    """Reads the runtime when scraped; nothing while the model is loading."""

    def __init__(self, runtime: Callable[[], Runtime | None]) -> None:
        self.runtime = runtime

    def collect(self) -> Iterator[Any]:
        runtime = self.runtime()
        if runtime is None:
            return
        stats = runtime.snapshot
        kv = runtime.scheduler.kv
        pool = GaugeMetricFamily("kvd_pool_pages", "KV pool pages by state", labels=["state"])
        pool.add_metric(["free"], stats.free_pages)
        pool.add_metric(["cached"], stats.cached_pages)
        pool.add_metric(["used"], stats.used_pages)
        yield pool
        yield GaugeMetricFamily(
            "kvd_pool_capacity_pages", "Allocatable KV pool pages", value=kv.pool.capacity
        )
        yield GaugeMetricFamily("kvd_page_bytes", "Bytes per KV page", value=kv.layout.page_bytes)
        for name, value, text in (
            ("kvd_requests_running", stats.running, "Requests being computed"),
            ("kvd_requests_waiting", stats.waiting, "Requests in tenant queues"),
            ("kvd_requests_swapped", stats.swapped, "Requests swapped out to host memory"),
            ("kvd_requests_in_flight", runtime.in_flight, "Requests with a client"),
            ("kvd_draining", int(runtime.draining), "1 while draining for shutdown"),
        ):
            yield GaugeMetricFamily(name, text, value=value)
        yield CounterMetricFamily("kvd_engine_steps", "Scheduler steps run", value=stats.steps)
        yield CounterMetricFamily(
            "kvd_prefix_query_tokens",
            "Prompt tokens looked up in the prefix cache",
            value=stats.prefix_query_tokens,
        )
        yield CounterMetricFamily(
            "kvd_prefix_hit_tokens",
            "Prompt tokens found in the prefix cache",
            value=stats.prefix_hit_tokens,
        )
        if stats.prefill_tokens_per_s is not None:
            yield GaugeMetricFamily(
                "kvd_measured_prefill_tokens_per_second",
                "Prefill rate measured at start-up (recompute cost)",
                value=stats.prefill_tokens_per_s,
            )
        if stats.copy_bytes_per_s is not None:
            yield GaugeMetricFamily(
                "kvd_measured_copy_bytes_per_second",
                "Device<->host copy rate measured at start-up (swap cost)",
                value=stats.copy_bytes_per_s,
            )
        if stats.crossover_tokens is not None:
            yield GaugeMetricFamily(
                "kvd_preempt_crossover_tokens",
                "Sequence length above which swapping beats recompute",
                value=stats.crossover_tokens,
            )
        yield from self._tenants(stats.tenants)

    def _tenants(self, tenants: dict[str, Any]) -> Iterator[Any]:
        gauges = {
            "running": "Tenant requests being computed",
            "waiting": "Tenant requests queued",
            "swapped": "Tenant requests swapped out",
            "pages_used": "KV pages charged to the tenant",
            "pages_reserved": "KV pages reserved for the tenant",
            "surplus_pages": "Pages the tenant holds beyond its reservation",
            "service": "Weighted tokens served (fair-share virtual counter)",
        }
        counters = {
            "prompt_tokens": "Prompt tokens admitted",
            "completion_tokens": "Tokens generated",
            "cached_tokens": "Prompt tokens served from the prefix cache",
            "rate_limited": "Requests refused by rate limits",
            "finished": "Requests ended (any outcome)",
        }
        for key, text in gauges.items():
            family = GaugeMetricFamily(f"kvd_tenant_{key}", text, labels=["tenant"])
            for name, stats in tenants.items():
                family.add_metric([name], getattr(stats, key))
            yield family
        for key, text in counters.items():
            counter = CounterMetricFamily(f"kvd_tenant_{key}", text, labels=["tenant"])
            for name, stats in tenants.items():
                counter.add_metric([name], getattr(stats, key))
            yield counter
        preempted = CounterMetricFamily(
            "kvd_tenant_preemptions", "Preemptions by kind", labels=["tenant", "kind"]
        )
        for name, stats in tenants.items():
            preempted.add_metric([name, "recompute"], stats.preempted_recompute)
            preempted.add_metric([name, "swap"], stats.preempted_swap)
        yield preempted


class Metrics:
    def __init__(self, runtime: Callable[[], Runtime | None]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(SchedulerCollector(runtime))
        self.ttft = Histogram(
            "kvd_time_to_first_token_seconds",
            "Arrival to first token sent",
            ["tenant"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "kvd_inter_token_latency_seconds",
            "Time between tokens sent to a client",
            ["tenant"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.http = Counter(
            "kvd_http_requests",
            "HTTP responses by route and status",
            ["route", "status"],
            registry=self.registry,
        )
        self.outcomes = Counter(
            "kvd_requests",
            "Inference requests by tenant and outcome",
            ["tenant", "outcome"],
            registry=self.registry,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
