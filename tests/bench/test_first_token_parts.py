"""bench/first_token_parts.py: a run's time-to-first-token parts from two readings of running totals."""

from __future__ import annotations

import pytest

from morion.bench.first_token_parts import (
    EngineFirstTokens,
    PartTotals,
    engine_thread,
    mean_parts,
    median_parts,
    parts_text,
)
from morion.engine.outputs import FirstTokenTimes


def test_the_mean_per_request_between_two_readings_in_the_order_parts_happen():
    before = PartTotals({"from_engine_s": 1.0, "prepare_s": 2.0}, {"from_engine_s": 4, "prepare_s": 4})
    after = PartTotals(
        {"from_engine_s": 1.3, "prepare_s": 2.1, "queue_s": 0.5, "to_engine_s": 0.2},
        {"from_engine_s": 6, "prepare_s": 6, "queue_s": 2, "to_engine_s": 2},
    )
    means = mean_parts(before, after)
    expected = {"prepare_s": 0.05, "to_engine_s": 0.1, "queue_s": 0.25, "from_engine_s": 0.15}
    assert means == pytest.approx(expected)
    assert list(means) == ["prepare_s", "to_engine_s", "queue_s", "from_engine_s"]
    # An older server's hand-over, both legs in one sum, is kept as it came.
    legacy = PartTotals({"handoff_s": 0.3, "prepare_s": 0.1}, {"handoff_s": 2, "prepare_s": 2})
    assert list(mean_parts(PartTotals({}, {}), legacy)) == ["prepare_s", "handoff_s"]
    # No request between the readings, or a target that keeps none: no parts.
    assert mean_parts(after, after) is None
    assert mean_parts(None, after) is None and mean_parts(before, None) is None


def test_the_offline_totals_and_the_progress_text():
    totals = EngineFirstTokens()
    before = totals.totals()
    totals.add(FirstTokenTimes(0.002, 0.1, 5.0))
    totals.add(FirstTokenTimes(0.004, 0.3, 6.0))
    parts = mean_parts(before, totals.totals())
    assert parts == pytest.approx({"queue_s": 0.003, "prefill_s": 0.2})
    assert parts_text(parts) == ", in parts: queue 3 ms, prefill 200 ms"
    assert parts_text(None) == ""


def test_the_median_of_each_part_over_the_runs_that_have_parts():
    runs = [{"queue_s": 0.001, "prefill_s": 0.3}, None, {"queue_s": 0.003, "prefill_s": 0.1}, {}]
    runs.append({"queue_s": 0.002, "prefill_s": 0.2})
    assert median_parts(runs) == {"queue_s": 0.002, "prefill_s": 0.2}
    assert median_parts([None, {}]) is None


def test_the_engine_thread_during_the_prefill_where_the_engine_measured_it():
    totals = EngineFirstTokens()
    before = totals.totals()
    totals.add(FirstTokenTimes(0.002, 0.1, 5.0))  # off Linux: no split
    assert engine_thread(before, totals.totals()) is None
    middle = totals.totals()
    totals.add(FirstTokenTimes(0.002, 0.1, 6.0, 0.06, 0.01))
    totals.add(FirstTokenTimes(0.002, 0.3, 7.0, 0.28, 0.03))  # on a CPU and queued for more than all of it
    thread = engine_thread(middle, totals.totals())
    assert thread == pytest.approx({"on_cpu_s": 0.17, "runqueue_s": 0.02, "off_cpu_s": 0.01})
    # The split is no part of the time to the first token: the parts stay the engine's two.
    assert list(mean_parts(middle, totals.totals())) == ["queue_s", "prefill_s"]
    assert engine_thread(None, totals.totals()) is None
