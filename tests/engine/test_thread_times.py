"""The engine thread's scheduler times (engine/thread_times.py): read from the kernel, split of a wall
time."""

from __future__ import annotations

import sys
import time

import pytest

from morion.engine.thread_times import ThreadTimes, read_thread_times, split_wall


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="Linux keeps per-thread scheduler statistics"
)
def test_a_busy_thread_is_on_a_cpu_and_a_sleeping_one_off_it():
    before = read_thread_times()
    deadline = time.perf_counter() + 10
    busy = before
    while busy.on_cpu_s - before.on_cpu_s < 0.02 and time.perf_counter() < deadline:  # busy, however loaded
        busy = read_thread_times()
    assert busy.on_cpu_s - before.on_cpu_s >= 0.02
    started = time.perf_counter()
    time.sleep(0.2)
    slept = read_thread_times()
    assert slept.on_cpu_s - busy.on_cpu_s < 0.05
    assert split_wall(busy, slept, time.perf_counter() - started)["off_cpu_s"] > 0.1


def test_the_split_adds_up_and_needs_both_readings():
    split = split_wall(ThreadTimes(1.0, 0.5), ThreadTimes(1.2, 0.6), 0.4)
    assert split == pytest.approx({"on_cpu_s": 0.2, "runqueue_s": 0.1, "off_cpu_s": 0.1})
    assert split_wall(None, ThreadTimes(1.0, 0.0), 0.4) is None
    assert split_wall(ThreadTimes(1.0, 0.0), ThreadTimes(1.5, 0.0), 0.4)["off_cpu_s"] == 0.0  # never negative
