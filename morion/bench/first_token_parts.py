"""Where a measured request's time to first token went, by part, where the target tells (issue #24).

A morion server exports each part as a histogram (server/metrics.py): `prepare` in the front end (the
HTTP request's parsing, template, tokens and checks, to its hand-over to the engine), `to_engine` (the
hand-over's way to the engine: the inbox thread, the pipe, the engine loop), the engine's `queue` (to its
first admission) and `prefill` (to the step that sampled its first token), and `from_engine` (the first
token's way back: the rest of that step, the pipe, the front end's loop). Servers from before the two
legs were told apart export only their sum, `handoff` (LEGACY_PARTS), as results of that time hold it.
The offline target counts the engine's two parts from its step outputs (engine/outputs.py
`FirstTokenTimes`). A target keeps running sums and counts;
the bench reads them before and after a run, and the run's parts are the mean per request between the
two readings: exact for the prefill, ttft and turn workloads' runs of one request.
"""

from __future__ import annotations

import statistics
from typing import NamedTuple

from morion.engine.outputs import FirstTokenTimes

# In the order they happen; the offline target has only the engine's two.
PARTS = ("prepare_s", "to_engine_s", "queue_s", "prefill_s", "from_engine_s")
# What an older morion server has instead of the two hand-over legs: their sum.
LEGACY_PARTS = ("handoff_s",)
# Not parts of the time: how the engine's stepping thread spent the prefill part (`FirstTokenTimes`), on a
# CPU and runnable in a run queue; off a CPU the rest (`engine_thread`).
THREAD_PARTS = ("prefill_on_cpu_s", "prefill_runqueue_s")


class PartTotals(NamedTuple):
    """Running totals: per part, the seconds summed over the requests counted so far, and their count."""

    seconds: dict[str, float]
    counts: dict[str, int]


class EngineFirstTokens:
    """The offline target's running totals of the engine's parts, fed with each step's outputs."""

    def __init__(self) -> None:
        self._seconds = dict.fromkeys(("queue_s", "prefill_s", *THREAD_PARTS), 0.0)
        self._counts = dict.fromkeys(self._seconds, 0)

    def add(self, times: FirstTokenTimes) -> None:
        measured = {"queue_s": times.queued_s, "prefill_s": times.prefill_s}
        if times.prefill_on_cpu_s is not None and times.prefill_runqueue_s is not None:
            measured["prefill_on_cpu_s"] = times.prefill_on_cpu_s
            measured["prefill_runqueue_s"] = times.prefill_runqueue_s
        for part, seconds in measured.items():
            self._seconds[part] += seconds
            self._counts[part] += 1

    def totals(self) -> PartTotals:
        counted = [part for part, count in self._counts.items() if count]
        return PartTotals(
            {part: self._seconds[part] for part in counted}, {part: self._counts[part] for part in counted}
        )


def mean_parts(before: PartTotals | None, after: PartTotals | None) -> dict[str, float] | None:
    """Each part's mean seconds per request counted between two readings (in PARTS order, the parts that
    counted any); None without readings or without a request between them."""
    if before is None or after is None:
        return None
    means = {part: _mean(before, after, part) for part in PARTS + LEGACY_PARTS}
    return {part: mean for part, mean in means.items() if mean is not None} or None


def engine_thread(before: PartTotals | None, after: PartTotals | None) -> dict[str, float] | None:
    """The engine's stepping thread during the prefill part, mean seconds per request between two
    readings: on a CPU, runnable in a run queue, and off a CPU (the rest of the part: the GIL, a lock, a
    wait for the GPU); None where the target does not tell."""
    if before is None or after is None:
        return None
    prefill, on_cpu, runqueue = (_mean(before, after, part) for part in ("prefill_s", *THREAD_PARTS))
    if prefill is None or on_cpu is None or runqueue is None:
        return None
    return {"on_cpu_s": on_cpu, "runqueue_s": runqueue, "off_cpu_s": max(0.0, prefill - on_cpu - runqueue)}


def _mean(before: PartTotals, after: PartTotals, part: str) -> float | None:
    count = after.counts.get(part, 0) - before.counts.get(part, 0)
    if count <= 0:
        return None
    return (after.seconds[part] - before.seconds.get(part, 0.0)) / count


def median_parts(runs: list[dict[str, float] | None]) -> dict[str, float] | None:
    """Each part's median over the runs that have parts (in the order the first one lists them); None
    where none has."""
    measured = [parts for parts in runs if parts]
    if not measured:
        return None
    return {part: statistics.median(parts[part] for parts in measured) for part in measured[0]}


def parts_text(parts: dict[str, float] | None) -> str:
    """ ", in parts: prepare 3 ms, queue 0 ms, ..." for a progress line; "" without parts."""
    if not parts:
        return ""
    return ", in parts: " + ", ".join(
        f"{part[:-2]} {seconds * 1e3:.0f} ms" for part, seconds in parts.items()
    )
