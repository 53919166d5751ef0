"""The engine's step counters (engine/step_timing.py): what `morion bench` and `validate perf` divide."""

from __future__ import annotations

import pytest

from morion.engine.step_timing import StepTimes


def test_since_divides_the_differences():
    earlier = StepTimes(
        decode_steps=10, decode_seconds=0.1, other_steps=2, other_seconds=0.5, busy_seconds=0.7
    )
    later = StepTimes(
        decode_steps=14, decode_seconds=0.14, other_steps=3, other_seconds=0.6, busy_seconds=0.85
    )
    figures = later.since(earlier)
    assert figures["decode_steps"] == 4 and figures["other_steps"] == 1
    assert figures["decode_step_ms"] == pytest.approx(10.0)  # 0.04 s over 4 steps
    # Busy 0.15 s around 0.14 s of steps (0.04 decode + 0.1 other), over 5 steps.
    assert figures["loop_overhead_ms_per_step"] == pytest.approx(2.0)


def test_no_decode_step_and_no_loop_give_none():
    earlier = StepTimes(other_steps=1, other_seconds=0.2)
    later = StepTimes(other_steps=2, other_seconds=0.5)
    figures = later.since(earlier)
    assert figures["decode_step_ms"] is None and figures["loop_overhead_ms_per_step"] is None


def test_record_counts_by_kind_and_snapshot_is_a_copy():
    times = StepTimes()
    times.record(True, 0.01)
    times.record(False, 0.2)
    copy = times.snapshot()
    times.record(True, 0.03)
    assert (copy.decode_steps, copy.other_steps) == (1, 1)
    assert (times.decode_steps, times.decode_seconds) == (2, pytest.approx(0.04))
