"""Prometheus metrics: the scheduler's counters, and latency as clients see it.

Pool and tenant figures are read from the engine task's latest snapshot when
scraped (a collector, so nothing is updated per step). Latency histograms
(TTFT, inter-token) are observed per tenant by the engine task when it hands
a step's tokens to their requests, a whole step at a time (one bucket search
per tenant and step, not a labelled observation per token).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from kvd.server.runtime import Runtime
from kvd.server.status import ServerStatus, Status

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class SchedulerCollector(Collector):
    """Reads the runtime when scraped; nothing while the model is loading."""

    def __init__(self, runtime: Callable[[], Runtime | None], status: ServerStatus) -> None:
        self.runtime = runtime
        self.status = status

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
            (
                "kvd_draining",
                int(self.status.status is Status.DRAINING),
                "1 while draining (kvctl drain, or for shutdown)",
            ),
        ):
            yield GaugeMetricFamily(name, text, value=value)
        yield CounterMetricFamily("kvd_engine_steps", "Scheduler steps run", value=stats.steps)
        failed_copies = CounterMetricFamily(
            "kvd_copy_failures",
            "Device-to-host copies that failed and were recovered from (swap_out: the "
            "sequence is recomputed; offload: the host-tier blocks are dropped)",
            labels=["kind"],
        )
        for kind in ("swap_out", "offload"):
            failed_copies.add_metric([kind], runtime.copy_failures.get(kind, 0))
        yield failed_copies
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
        by_tier = CounterMetricFamily(
            "kvd_prefix_hit_tokens_by_tier",
            "Prompt tokens found in the prefix cache, by the tier that held them",
            labels=["tier"],
        )
        by_tier.add_metric(["device"], stats.prefix_hit_tokens - stats.host_hit_tokens)
        by_tier.add_metric(["host"], stats.host_hit_tokens)
        yield by_tier
        host = GaugeMetricFamily(
            "kvd_host_pages",
            "Host budget pages (prefix cache tier and swap) by use",
            labels=["use"],
        )
        host.add_metric(["cached"], stats.host_cached_pages)
        host.add_metric(["swap"], stats.host_swap_pages)
        yield host
        yield GaugeMetricFamily(
            "kvd_host_capacity_pages",
            "Host budget in pages (0: no host tier)",
            value=stats.host_pages,
        )
        yield CounterMetricFamily(
            "kvd_host_offloads", "Cached blocks copied to the host tier", value=stats.host_offloads
        )
        yield CounterMetricFamily(
            "kvd_host_evictions",
            "Blocks dropped from the host tier",
            value=stats.host_evictions,
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
            "host_swap_pages": "Host pages the tenant's swapped-out sequences hold",
            "host_cached_pages": "Host-tier pages the tenant's cached blocks hold",
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


class TenantHistogram(Collector):
    """A per-tenant latency histogram observed in bulk: each call files a
    whole array of values with one bucket search."""

    def __init__(self, name: str, text: str, buckets: Sequence[float]) -> None:
        self.name, self.text = name, text
        self.bounds = np.asarray(buckets, np.float64)
        self._counts: dict[str, np.ndarray[Any, Any]] = {}
        self._sums: dict[str, float] = {}

    def observe(self, tenant: str, values: Sequence[float]) -> None:
        if not len(values):
            return
        array = np.asarray(values, np.float64)
        counts = self._counts.get(tenant)
        if counts is None:
            counts = self._counts[tenant] = np.zeros(len(self.bounds) + 1, np.int64)
            self._sums[tenant] = 0.0
        # Prometheus buckets are "<= bound": the first bound not below the value.
        counts += np.bincount(
            np.searchsorted(self.bounds, array, side="left"), minlength=len(counts)
        )
        self._sums[tenant] += float(array.sum())

    def collect(self) -> Iterator[Any]:
        family = HistogramMetricFamily(self.name, self.text, labels=["tenant"])
        labels = [*(floatToGoString(b) for b in self.bounds), "+Inf"]
        for tenant, counts in list(self._counts.items()):
            cumulative = np.cumsum(counts).tolist()
            family.add_metric(
                [tenant],
                list(zip(labels, cumulative, strict=True)),
                sum_value=self._sums[tenant],
            )
        yield family


class Metrics:
    def __init__(self, runtime: Callable[[], Runtime | None], status: ServerStatus) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(SchedulerCollector(runtime, status))
        self.ttft = TenantHistogram(
            "kvd_time_to_first_token_seconds",
            "Arrival to the first token, when the engine hands it to the request's stream",
            LATENCY_BUCKETS,
        )
        self.itl = TenantHistogram(
            "kvd_inter_token_latency_seconds",
            "Time between a request's tokens, as the engine hands them to its stream",
            LATENCY_BUCKETS,
        )
        self.registry.register(self.ttft)
        self.registry.register(self.itl)
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

        self.engine_failures = Counter(
            "kvd_engine_failures",
            "Engine failures (a step raised or hung, an invariant broke): the daemon "
            "answers every request in flight with an error and exits non-zero",
            registry=self.registry,
        )

    def observe_latencies(self, tenant: str, ttft: list[float], itl: list[float]) -> None:
        self.ttft.observe(tenant, ttft)
        self.itl.observe(tenant, itl)

    def render(self) -> bytes:
        return generate_latest(self.registry)
