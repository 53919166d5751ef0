"""Prometheus metrics, all named `morion_*`.

Counters and histograms are updated as requests finish and tokens arrive; engine load and pool usage
are read from the engine's latest stats when /metrics is scraped, so they cost nothing per step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from morion.cache.tier_stats import CacheStats
from morion.engine.outputs import FirstTokenTimes, Usage
from morion.engine.step_timing import StepTimes
from morion.server.engine_messages import EngineInfo, EngineStats, SpecSnapshot

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5)
_LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# The time to first token's parts: the front end's and the hand-over's are a few milliseconds.
_PART_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

_FIRST_TOKEN_PARTS = {
    "prepare": "From the HTTP request's arrival to its engine requests' hand-over (parsing, chat template, "
    "tokens, checks)",
    "queue": "In the engine, from the request's arrival there to its first admission to the running batch",
    "prefill": "In the engine, from the request's first admission to the step that sampled its first token",
    "handoff": "From the hand-over to the engine to the first token's arrival in the front end, less the "
    "engine's queue and prefill: the pipes both ways and both processes' loops (to_engine + from_engine)",
    "to_engine": "The hand-over's first leg: to the request's arrival in the engine (the inbox thread, the "
    "pipe, the engine loop's wake and unpickling)",
    "from_engine": "The hand-over's second leg: from the engine's first token to its arrival in the front "
    "end (the rest of that step, the pipe, the front end's event loop)",
    # Not parts that add up to the time to first token: how the engine thread spent the prefill part.
    "prefill_on_cpu": "Of the engine's prefill part, the seconds its stepping thread was on a CPU (Linux)",
    "prefill_runqueue": "Of the engine's prefill part, the seconds its stepping thread was runnable but "
    "waiting for a CPU (Linux); the rest of the part it was off a CPU (the GIL, a lock, a wait for the GPU)",
}

# The *_created series (a timestamp per counter) only add noise to every scrape.
disable_created_metrics()

EngineSnapshot = Callable[[], tuple[EngineInfo | None, EngineStats | None]]


class ServerMetrics:
    def __init__(self, engine_snapshot: EngineSnapshot, engine_pid: Callable[[], int | None]) -> None:
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
        # The time to first token in parts, which add up to it for a request of one choice (`morion bench
        # --url` reads their sums per run): morion_request_{part}_seconds; and the engine thread's split
        # of the prefill part (prefill_on_cpu, prefill_runqueue), where the engine measured it.
        self.first_token_part = {
            part: Histogram(
                f"morion_request_{part}_seconds", documentation, buckets=_PART_BUCKETS, registry=registry
            )
            for part, documentation in _FIRST_TOKEN_PARTS.items()
        }
        registry.register(_EngineCollector(engine_snapshot))
        # process_* series (resident memory, CPU, open files) of both processes, read from /proc when
        # scraped: the front end's own, and the engine's as morion_engine_process_* (none before it runs).
        ProcessCollector(registry=registry)
        ProcessCollector(namespace="morion_engine", pid=engine_pid, registry=registry)

    def first_token_parts(self, times: FirstTokenTimes, submitted: float, arrived: float) -> None:
        """An engine request handed over at `submitted` had its first token arrive at `arrived` (both the
        front end's perf_counter seconds, the clock of `times.added_at`: module docstring of outputs)."""
        parts = self.first_token_part
        parts["queue"].observe(times.queued_s)
        parts["prefill"].observe(times.prefill_s)
        if times.prefill_on_cpu_s is not None and times.prefill_runqueue_s is not None:
            parts["prefill_on_cpu"].observe(times.prefill_on_cpu_s)
            parts["prefill_runqueue"].observe(times.prefill_runqueue_s)
        handoff = max(0.0, arrived - submitted - times.queued_s - times.prefill_s)
        to_engine = min(handoff, max(0.0, times.added_at - submitted))
        parts["handoff"].observe(handoff)
        parts["to_engine"].observe(to_engine)
        parts["from_engine"].observe(handoff - to_engine)

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
            "morion_engine_cache_memory_bytes": (
                "Host memory the caches hold by design, bounded by their capacity: index entries of the "
                "device, host and disk tiers, resident bytes of preallocated pools and arenas; as of the "
                "engine's last idle moment",
                stats.cache_memory_bytes,
            ),
            "morion_engine_cuda_memory_allocated_bytes": (
                "CUDA memory torch has allocated in the engine process",
                stats.cuda_allocated_bytes,
            ),
        }
        yield from _unlabelled(GaugeMetricFamily, gauges)
        yield CounterMetricFamily(
            "morion_retractions", "Running requests sent back to the queue for memory", stats.retractions
        )
        yield from _cache_metrics(stats.cache)
        yield from _spec_metrics(stats.spec)
        yield from _step_metrics(stats.step_times)
        forwards = CounterMetricFamily(
            "morion_engine_forwards",
            "The engine's forwards by kind (decode, short: a prompt's tail, prefill, verify) and path "
            "(graph: a CUDA graph replayed it, eager)",
            labels=["kind", "path"],
        )
        for (kind, path), count in stats.forwards.items():
            forwards.add_metric([kind, path], count)
        yield forwards


def _step_metrics(times: StepTimes) -> Iterator[Metric]:
    """The engine's own time (engine/step_timing.py): steps and their seconds by kind, and the busy loop
    around them; seconds per step over a window is the engine's share of a client's inter-token time."""
    yield _counter_by_label(
        "morion_engine_steps",
        "Engine steps by kind: decode (one token per request) or other (with prefill work)",
        "kind",
        {"decode": times.decode_steps, "other": times.other_steps},
    )
    yield _counter_by_label(
        "morion_engine_step_seconds",
        "Wall seconds inside the engine's steps, by kind",
        "kind",
        {"decode": times.decode_seconds, "other": times.other_seconds},
    )
    yield CounterMetricFamily(
        "morion_engine_busy_seconds",
        "Wall seconds the engine loop worked: inbox, steps, stats and sending the outputs",
        times.busy_seconds,
    )


def _unlabelled(
    family: type[CounterMetricFamily | GaugeMetricFamily], series: dict[str, tuple[str, float]]
) -> Iterator[Metric]:
    """One family of the type `family` per `name: (documentation, value)` of `series`."""
    for name, (documentation, value) in series.items():
        yield family(name, documentation, value)


def _counter_by_label(name: str, documentation: str, label: str, values: dict[str, float]) -> Metric:
    family = CounterMetricFamily(name, documentation, labels=[label])
    for value_label, value in values.items():
        family.add_metric([value_label], value)
    return family


def _cache_metrics(cache: CacheStats) -> Iterator[Metric]:
    """The cache tiers (device / host / disk): hits and restored tokens, traffic, latency and faults."""
    hits = {
        "hits": "Requests whose cached prefix came from each tier (counted at first admission)",
        "hit_tokens": "Prompt tokens served from each tier (their sum is the reported cached_tokens)",
    }
    for field, documentation in hits.items():
        values = {tier: getattr(cache, f"{tier}_{field}") for tier in ("device", "host", "disk")}
        yield _counter_by_label(f"morion_cache_{field}", documentation, "tier", values)
    yield _counter_by_label(
        "morion_cache_bytes_moved",
        "Bytes copied between the tiers",
        "direction",
        {
            "device_to_host": cache.bytes_device_to_host,
            "host_to_device": cache.bytes_host_to_device,
            "disk_to_host": cache.bytes_disk_read,
            "host_to_disk": cache.bytes_disk_written,
        },
    )
    yield _counter_by_label(
        "morion_cache_evictions",
        "Pages or objects evicted from each lower tier",
        "tier",
        {"host": cache.host_evictions, "disk": cache.disk_evictions},
    )
    counters = {
        "morion_cache_restores": ("Load-backs from host memory into the device", cache.restores),
        "morion_cache_restored_tokens": (
            "Tokens restored into the device from host memory",
            cache.restored_tokens,
        ),
        "morion_cache_restored_snapshots": (
            "State snapshots restored into the device",
            cache.restored_snapshots,
        ),
        "morion_cache_restore_seconds": (
            "Time from finding a lower-tier hit to its copies being done (disk prefetch included)",
            cache.restore_seconds_total,
        ),
        "morion_cache_checksum_failures": (
            "Disk objects that failed their checksum on read (each was a miss, never an answer)",
            cache.checksum_failures,
        ),
        "morion_cache_disk_read_errors": (
            "Disk objects that could not be read (misses)",
            cache.disk_read_errors,
        ),
        "morion_cache_disk_write_errors": ("Disk writes that failed (disk full...)", cache.disk_write_errors),
    }
    yield from _unlabelled(CounterMetricFamily, counters)
    gauges = {
        "morion_cache_restore_seconds_max": ("Longest restore so far", cache.restore_seconds_max),
        "morion_host_cache_pages_used": ("Host-tier page rows in use", cache.host_pages_used),
        "morion_host_cache_pages_capacity": ("Host-tier page rows", cache.host_pages_capacity),
        "morion_host_cache_bytes": ("Host-tier memory", cache.host_bytes),
        "morion_disk_cache_enabled": ("1 when the disk tier is in use", cache.disk_enabled),
        "morion_disk_cache_objects": ("Objects in the disk tier", cache.disk_objects),
        "morion_disk_cache_bytes_used": ("Bytes in the disk tier", cache.disk_bytes_used),
        "morion_disk_cache_bytes_budget": ("The disk tier's budget", cache.disk_bytes_budget),
    }
    yield from _unlabelled(GaugeMetricFamily, gauges)


# What the speculative decoding series read while it is off: zeros, and no draft positions.
_SPEC_OFF = SpecSnapshot("off", 0, 0, 0, 0, (), (), 0, 0, 0.0)


def _spec_metrics(spec: SpecSnapshot | None) -> Iterator[Metric]:
    """Speculative decoding. Present whether it is on or not (zero when off, as the cache tiers' are), so a
    dashboard needs no special case. The per-position series exist for positions 1 to the policy's widest
    (none when off) and read zero until drafted, so accepted / drafted per position is a rate from the
    start; the windowed mean accepted length is rate(emitted) / (rate(emitted) - rate(accepted))."""
    yield GaugeMetricFamily("morion_spec_enabled", "1 when speculative decoding is on", spec is not None)
    spec = spec or _SPEC_OFF
    counters = {
        "morion_spec_verify_steps": ("Verify forwards (steps that verified drafts)", spec.verify_steps),
        "morion_spec_drafted_tokens": ("Draft tokens proposed", spec.drafted_tokens),
        "morion_spec_accepted_tokens": ("Draft tokens accepted", spec.accepted_tokens),
        "morion_spec_emitted_tokens": (
            "Tokens verify steps gave requests: accepted drafts + one target token per request and step",
            spec.emitted_tokens,
        ),
    }
    yield from _unlabelled(CounterMetricFamily, counters)
    positions = range(1, spec.max_width + 1)
    for outcome, values in (("drafted", spec.drafted_by_position), ("accepted", spec.accepted_by_position)):
        yield _counter_by_label(
            f"morion_spec_{outcome}_by_position",
            f"Draft tokens {outcome} at each draft position (1: a step's first draft)",
            "position",
            {str(p): values[p - 1] if p <= len(values) else 0 for p in positions},
        )
    gauges = {
        "morion_spec_active_width": ("Draft width the policy chose last", spec.active_width),
        "morion_spec_mean_accepted_length": (
            "Tokens a request gained per verify step since start (accepted drafts + the target's own)",
            spec.mean_accepted_length,
        ),
    }
    yield from _unlabelled(GaugeMetricFamily, gauges)
