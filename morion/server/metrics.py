"""Prometheus metrics, all named `morion_*`.

Counters and histograms are updated as requests finish and tokens arrive; engine load and pool usage
are read from the engine's latest stats when /metrics is scraped, so they cost nothing per step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from morion.engine.messages import EngineInfo, EngineStats
from morion.engine.outputs import Usage

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5)
_LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

# The *_created series (a timestamp per counter) only add noise to every scrape.
disable_created_metrics()

EngineSnapshot = Callable[[], tuple[EngineInfo | None, EngineStats | None]]


class ServerMetrics:
    def __init__(self, engine_snapshot: EngineSnapshot) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        self.http_requests = Counter(
            "morion_http_requests",
            "HTTP requests by endpoint and status",
            ["endpoint", "status"],
            registry=registry,
        )
        self.finished = Counter(
            "morion_requests_finished", "Engine requests by finish reason", ["reason"], registry=registry
        )
        self.prompt_tokens = Counter(
            "morion_prompt_tokens", "Prompt tokens of finished requests", registry=registry
        )
        self.cached_tokens = Counter(
            "morion_cached_prompt_tokens", "Prompt tokens served from the prefix cache", registry=registry
        )
        self.generation_tokens = Counter("morion_generation_tokens", "Generated tokens", registry=registry)
        self.time_to_first_token = Histogram(
            "morion_time_to_first_token_seconds",
            "From the HTTP request's arrival to its first generated token",
            buckets=_TTFT_BUCKETS,
            registry=registry,
        )
        self.inter_token_latency = Histogram(
            "morion_inter_token_latency_seconds",
            "Between consecutive tokens of one request",
            buckets=_ITL_BUCKETS,
            registry=registry,
        )
        self.request_latency = Histogram(
            "morion_request_latency_seconds",
            "From the HTTP request's arrival to its engine request's end",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        registry.register(_EngineCollector(engine_snapshot))

    def request_finished(self, reason: str, usage: Usage | None, latency: float) -> None:
        self.finished.labels(reason).inc()
        self.request_latency.observe(latency)
        if usage is not None:
            self.prompt_tokens.inc(usage.prompt_tokens)
            self.cached_tokens.inc(usage.cached_tokens)
            self.generation_tokens.inc(usage.completion_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    def __init__(self, snapshot: EngineSnapshot) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        info, stats = self._snapshot()
        yield GaugeMetricFamily(
            "morion_engine_ready", "1 once the engine has loaded the model", info is not None
        )
        if info is None or stats is None:
            return
        gauges = {
            "morion_requests_running": ("Requests in the running batch", stats.running),
            "morion_requests_waiting": ("Requests waiting for admission", stats.waiting),
            "morion_kv_pages_total": ("Pages in the KV pool", info.num_pages),
            "morion_kv_pages_free": ("Free pages", stats.pages_free),
            "morion_kv_pages_cached": ("Pages held by the prefix cache", stats.pages_cached),
            "morion_kv_pages_held": ("Pages owned by running requests", stats.pages_held),
            "morion_kv_cache_usage_ratio": ("Share of pages not free", 1 - stats.pages_free / info.num_pages),
        }
        for name, (documentation, value) in gauges.items():
            yield GaugeMetricFamily(name, documentation, value)
        yield CounterMetricFamily(
            "morion_retractions", "Running requests sent back to the queue for memory", stats.retractions
        )
