"""Prometheus metrics: the scheduler's counters, and latency as clients see it.

Pool and tenant figures are read from the step loop's latest snapshot when
scraped (a collector, so nothing is updated per step). Latency histograms
(TTFT, inter-token) are observed per tenant by the step loop when it hands
a step's tokens to their requests, a whole step at a time (one bucket search
per tenant and step, not a labelled observation per token).

Beside kvd's own names, the model-server protocol that gateways read (GAIE's
endpoint picker, llm-d's scorers, smg's load policies): vLLM's names, types
and labels (``model_name``, ``engine``) for queue depth, running requests,
KV-cache usage and geometry, prefix-cache queries and hits, and the TTFT and
inter-token histograms with vLLM's buckets.
"""

from __future__ import annotations

import bisect
from abc import abstractmethod
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from kvd.kv.manager import KVManager
from kvd.sched.stats import SchedulerStats
from kvd.server.kvevents import KVEventPublisher
from kvd.server.runtime import Runtime
from kvd.server.status import ServerStatus, Status

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# vLLM's own buckets, so a dashboard or a gateway built for vLLM reads these alike.
VLLM_TTFT_BUCKETS = (
    *(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0),
    *(2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
)
VLLM_ITL_BUCKETS = (
    *(0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0),
    *(2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0),
)
VLLM_LABELS = ["model_name", "engine"]


class RuntimeCollector(Collector):
    """Reads the runtime when scraped; nothing while the model is loading."""

    def __init__(self, runtime: Callable[[], Runtime | None]) -> None:
        self.runtime = runtime

    def collect(self) -> Iterator[Any]:
        runtime = self.runtime()
        if runtime is not None:
            yield from self.families(runtime, runtime.snapshot, runtime.scheduler.kv)

    @abstractmethod
    def families(self, runtime: Runtime, stats: SchedulerStats, kv: KVManager) -> Iterator[Any]:
        """The metric families, from the runtime's latest snapshot."""


class SchedulerCollector(RuntimeCollector):
    def __init__(self, runtime: Callable[[], Runtime | None], status: ServerStatus) -> None:
        super().__init__(runtime)
        self.status = status

    def families(self, runtime: Runtime, stats: SchedulerStats, kv: KVManager) -> Iterator[Any]:
        pool = GaugeMetricFamily("kvd_pool_pages", "KV pool pages by state", labels=["state"])
        pool.add_metric(["free"], stats.kv.free_pages)
        pool.add_metric(["cached"], stats.kv.cached_pages)
        pool.add_metric(["referenced"], stats.kv.referenced_pages)
        yield pool
        yield GaugeMetricFamily(
            "kvd_pool_capacity_pages", "Allocatable KV pool pages", value=stats.kv.capacity_pages
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
            "sequence is recomputed; offload: the host-cache blocks are dropped)",
            labels=["kind"],
        )
        for kind in ("swap_out", "offload"):
            failed_copies.add_metric([kind], runtime.copy_failures.get(kind, 0))
        yield failed_copies
        yield CounterMetricFamily(
            "kvd_prefix_query_tokens",
            "Prompt tokens looked up in the prefix cache",
            value=stats.kv.prefix_query_tokens,
        )
        yield CounterMetricFamily(
            "kvd_prefix_hit_tokens",
            "Prompt tokens found in the prefix cache",
            value=stats.kv.prefix_hit_tokens,
        )
        by_memory = CounterMetricFamily(
            "kvd_prefix_hit_tokens_by_memory",
            "Prompt tokens found in the prefix cache, by the memory that held them",
            labels=["memory"],
        )
        by_memory.add_metric(["device"], stats.kv.prefix_hit_tokens - stats.kv.host_hit_tokens)
        by_memory.add_metric(["host"], stats.kv.host_hit_tokens)
        yield by_memory
        host = GaugeMetricFamily(
            "kvd_host_pages",
            "Host budget pages (host cache and swap) by use",
            labels=["use"],
        )
        host.add_metric(["cached"], stats.kv.host_cached_pages)
        host.add_metric(["swap"], stats.kv.host_swap_pages)
        yield host
        yield GaugeMetricFamily(
            "kvd_host_capacity_pages",
            "Host budget in pages (0: no host cache)",
            value=stats.kv.host_pages,
        )
        yield CounterMetricFamily(
            "kvd_host_offloads",
            "Cached blocks copied to the host cache",
            value=stats.kv.host_offloads,
        )
        yield CounterMetricFamily(
            "kvd_host_evictions",
            "Blocks dropped from the host cache",
            value=stats.kv.host_evictions,
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
            "charged_pages": "KV pages charged to the tenant",
            "reserved_pages": "KV pages reserved for the tenant",
            "surplus_pages": "Pages the tenant holds beyond its reservation",
            "host_swap_pages": "Host pages the tenant's swapped-out sequences hold",
            "host_cached_pages": "Host-cache pages the tenant's cached blocks hold",
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


FEW_VALUES = 8  # values a histogram files one by one, without numpy


class BulkHistogram(Collector):
    """A labelled latency histogram observed in bulk: each call files a whole
    array of values with one bucket search."""

    def __init__(
        self, name: str, text: str, buckets: Sequence[float], labels: Sequence[str] = ("tenant",)
    ) -> None:
        self.name, self.text, self.labels = name, text, list(labels)
        self.bounds = np.asarray(buckets, np.float64)
        self._bound_list = self.bounds.tolist()
        self._counts: dict[tuple[str, ...], np.ndarray[Any, Any]] = {}
        self._sums: dict[tuple[str, ...], float] = {}

    def observe(self, key: tuple[str, ...], values: Sequence[float]) -> None:
        """``key``: the label values, in ``labels``' order."""
        if not len(values):
            return
        counts = self._counts.get(key)
        if counts is None:
            counts = self._counts[key] = np.zeros(len(self.bounds) + 1, np.int64)
            self._sums[key] = 0.0
        # Prometheus buckets are "<= bound": the first bound not below the value.
        if len(values) <= FEW_VALUES:
            # A step of a few streams: numpy's calls cost more than the search
            # (four histograms a step, at one stream a step a token).
            for value in values:
                counts[bisect.bisect_left(self._bound_list, value)] += 1
            self._sums[key] += float(sum(values))
            return
        array = np.asarray(values, np.float64)
        counts += np.bincount(
            np.searchsorted(self.bounds, array, side="left"), minlength=len(counts)
        )
        self._sums[key] += float(array.sum())

    def collect(self) -> Iterator[Any]:
        family = HistogramMetricFamily(self.name, self.text, labels=self.labels)
        labels = [*(floatToGoString(b) for b in self.bounds), "+Inf"]
        for key, counts in list(self._counts.items()):
            cumulative = np.cumsum(counts).tolist()
            family.add_metric(
                list(key), list(zip(labels, cumulative, strict=True)), sum_value=self._sums[key]
            )
        yield family


class ModelServerCollector(RuntimeCollector):
    """vLLM's model-server metrics, read from the runtime's snapshot when
    scraped. One engine: ``engine="0"``. The cache's geometry is in vLLM's
    terms: a block is ``block_size`` tokens of every layer (one page per
    page group here), so ``num_gpu_blocks`` is the pool's pages over its
    groups; usage counts the pages sequences hold (cached pages nobody holds
    are free to take, as vLLM's evictable blocks are)."""

    def __init__(self, runtime: Callable[[], Runtime | None], model_name: str) -> None:
        super().__init__(runtime)
        self.labels = [model_name, "0"]

    def families(self, runtime: Runtime, stats: SchedulerStats, kv: KVManager) -> Iterator[Any]:
        layout = kv.layout
        labels = self.labels

        def gauge(name: str, text: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, text, labels=VLLM_LABELS)
            family.add_metric(labels, value)
            return family

        def counter(name: str, text: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, text, labels=VLLM_LABELS)
            family.add_metric(labels, value)
            return family

        yield gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            stats.running,
        )
        yield gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed (queued, or preempted and swapped out).",
            stats.waiting + stats.swapped,
        )
        usage = stats.kv.referenced_pages / max(1, stats.kv.capacity_pages)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage)
        yield gauge(
            "vllm:gpu_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage (vLLM's older name).",
            usage,
        )
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=[
                "block_size",
                "num_gpu_blocks",
                "cache_dtype",
                "enable_prefix_caching",
                "engine",
            ],
        )
        info.add_metric(
            [
                str(layout.block_size),
                str(stats.kv.capacity_pages // layout.num_groups),
                layout.geometry.dtype,
                "True",
                "0",
            ],
            1,
        )
        yield info
        yield counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            stats.kv.prefix_query_tokens,
        )
        yield counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            stats.kv.prefix_hit_tokens,
        )
        yield counter(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            stats.preempted_recompute + stats.preempted_swap,
        )


class KVEventsCollector(Collector):
    """The KV-event publisher's counters, once one is attached."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Any]:
        publisher = self.metrics.kv_events
        if publisher is None:
            return
        log = publisher.events
        families = (
            ("kvd_kv_event_batches", "KV-event batches published", publisher.published),
            (
                "kvd_kv_event_overflows",
                "Step batches not queued for the publisher (its queue was full); "
                "each is followed by a resync of the whole cache",
                publisher.overflows,
            ),
            ("kvd_kv_event_replays", "Replay requests answered", publisher.replays),
        )
        for name, text, value in families:
            yield CounterMetricFamily(name, text, value=value)
        if log is not None:
            yield CounterMetricFamily(
                "kvd_kv_event_blocks_stored", "Blocks told stored (both media)", log.stored_blocks
            )
            yield CounterMetricFamily(
                "kvd_kv_event_blocks_removed",
                "Blocks told removed (both media)",
                log.removed_blocks,
            )
        yield GaugeMetricFamily(
            "kvd_kv_event_queue", "Batches waiting for the publisher thread", publisher.queued()
        )


class Metrics:
    def __init__(
        self,
        runtime: Callable[[], Runtime | None],
        status: ServerStatus,
        model_name: str = "kvd",
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(SchedulerCollector(runtime, status))
        self.registry.register(ModelServerCollector(runtime, model_name))
        self.kv_events: KVEventPublisher | None = None  # set by the daemon when publishing
        self.registry.register(KVEventsCollector(self))
        self._model_labels = (model_name, "0")
        self.vllm_ttft = BulkHistogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            VLLM_TTFT_BUCKETS,
            VLLM_LABELS,
        )
        self.vllm_itl = BulkHistogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            VLLM_ITL_BUCKETS,
            VLLM_LABELS,
        )
        self.registry.register(self.vllm_ttft)
        self.registry.register(self.vllm_itl)
        self.ttft = BulkHistogram(
            "kvd_time_to_first_token_seconds",
            "Arrival to the first token, when the engine hands it to the request's stream",
            LATENCY_BUCKETS,
        )
        self.itl = BulkHistogram(
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
        self.ttft.observe((tenant,), ttft)
        self.itl.observe((tenant,), itl)
        self.vllm_ttft.observe(self._model_labels, ttft)
        self.vllm_itl.observe(self._model_labels, itl)

    def render(self) -> bytes:
        return generate_latest(self.registry)
