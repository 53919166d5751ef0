"""server/metrics.py: a first token's time in parts, the hand-over split at the request's arrival in the
engine (the engine's perf_counter, one clock with the front end's)."""

from __future__ import annotations

import pytest

from morion.engine.outputs import FirstTokenTimes
from morion.server.metrics import ServerMetrics


def _sums(metrics: ServerMetrics) -> dict[str, float]:
    parts = ("queue", "prefill", "handoff", "to_engine", "from_engine")
    return {part: metrics.registry.get_sample_value(f"morion_request_{part}_seconds_sum") for part in parts}


def test_the_hand_over_in_its_two_legs():
    metrics = ServerMetrics(lambda: (None, None), lambda: None)
    # Handed over at 10.000, in the engine at 10.001, queued 2 ms, prefilled 50 ms, back at 10.060.
    metrics.first_token_parts(FirstTokenTimes(0.002, 0.050, 10.001), submitted=10.0, arrived=10.060)
    assert _sums(metrics) == pytest.approx(
        {"queue": 0.002, "prefill": 0.050, "handoff": 0.008, "to_engine": 0.001, "from_engine": 0.007}
    )


@pytest.mark.parametrize(("added_at", "to_engine"), [(9.9, 0.0), (10.5, 0.008)])
def test_the_legs_stay_within_the_hand_over(added_at, to_engine):
    # An arrival stamped outside the hand-over (another clock, or an engine's clock step) cannot make a
    # leg negative or longer than the whole: each is clamped, and the two still add up to the hand-over.
    metrics = ServerMetrics(lambda: (None, None), lambda: None)
    metrics.first_token_parts(FirstTokenTimes(0.002, 0.050, added_at), submitted=10.0, arrived=10.060)
    sums = _sums(metrics)
    assert sums["to_engine"] == pytest.approx(to_engine)
    assert sums["to_engine"] + sums["from_engine"] == pytest.approx(sums["handoff"]) == pytest.approx(0.008)


def test_the_engine_thread_s_split_of_the_prefill_where_the_engine_measured_it():
    metrics = ServerMetrics(lambda: (None, None), lambda: None)
    registry = metrics.registry
    metrics.first_token_parts(FirstTokenTimes(0.002, 0.050, 10.001), submitted=10.0, arrived=10.060)
    assert registry.get_sample_value("morion_request_prefill_on_cpu_seconds_count") == 0  # not measured
    metrics.first_token_parts(
        FirstTokenTimes(0.002, 0.050, 10.001, 0.030, 0.004), submitted=10.0, arrived=10.060
    )
    assert registry.get_sample_value("morion_request_prefill_on_cpu_seconds_sum") == pytest.approx(0.030)
    assert registry.get_sample_value("morion_request_prefill_runqueue_seconds_sum") == pytest.approx(0.004)
    assert registry.get_sample_value("morion_request_prefill_seconds_count") == 2
