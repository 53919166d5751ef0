"""What one profiled run's Chrome trace says about its steps: time by part of the step, the kernels (CPU ops
on a CPU) per step, and where the device sat idle.

The trace is torch.profiler's (`export_chrome_trace`), read as JSON so that the same code reads a CPU run
and a CUDA run. The bench puts each engine step in a range `morion:step#<i>`; inside it the runner's
ranges (runner/profile_ranges.py) nest: the forward, model parts by kind, the LM head, sampling. Ranges
of one thread nest, so the step's wall time splits into segments, each labelled by the innermost range
over it: a part's host time is its own, without the parts inside it (the MoE block's without its shared
expert's), and the parts of a step add up to the step.

A CUDA kernel (or copy) belongs to the step and the part whose thread launched it (the runtime call with
the same `correlation` id), so a graph replay's kernels count for the step that launched the graph. On a
CPU the ops run where they are called: the "kernels" are the outermost CPU ops (aten::linear, not the
aten::addmm inside it), and there is no device timeline to find idle time on.
"""

from __future__ import annotations

import bisect
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from morion.runner.profile_ranges import ACCEPTANCE, DRAFT, FORWARD, LM_HEAD, MODULE_PREFIX, PREFIX, SAMPLING

STEP = f"{PREFIX}step#"
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
TOP_OPS = 12
_NAME_WIDTH = 100

PART_NAMES = {
    STEP: "engine, outside the forward (schedule, batch, bookkeeping)",
    FORWARD: "model, other ops (norms, residuals, graph replay)",
    LM_HEAD: "LM head",
    SAMPLING: "sampling",
    DRAFT: "drafting (speculative)",
    ACCEPTANCE: "acceptance (speculative)",
}


class Segment(NamedTuple):
    start: float  # microseconds, the trace's clock
    end: float
    label: str


class Op(NamedTuple):
    launch: float  # when its thread launched it (a CPU op: when it started)
    start: float
    duration: float
    name: str


def step_range(index: int) -> str:
    return f"{STEP}{index}"


def part_name(label: str) -> str:
    if label.startswith(MODULE_PREFIX):
        return label.removeprefix(MODULE_PREFIX)
    return PART_NAMES.get(label, label)


def innermost_segments(ranges: Iterable[tuple[float, float, str]]) -> list[Segment]:
    """Non-overlapping segments, each labelled by the innermost of the nested `ranges` over it; a range
    is clipped to its parent's end."""
    segments: list[Segment] = []
    stack: list[tuple[float, str]] = []  # (end, label), innermost last
    position = 0.0

    def advance(to: float) -> None:
        nonlocal position
        if stack and to > position:
            segments.append(Segment(position, to, stack[-1][1]))
        position = max(position, to)

    for start, end, label in sorted(ranges, key=lambda r: (r[0], -r[1])):
        while stack and stack[-1][0] <= start:
            advance(stack[-1][0])
            stack.pop()
        advance(start)
        position = start
        stack.append((min(end, stack[-1][0]) if stack else end, label))
    while stack:
        advance(stack[-1][0])
        stack.pop()
    return segments


def summarize(trace: dict[str, Any], step_kinds: list[str], kind: str) -> dict[str, Any] | None:
    """Per-step means over the steps of `kind` ("decode" or "prefill"; `step_kinds[i]` is step i's);
    None when the run had no such step."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    steps = {
        int(e["name"].removeprefix(STEP)): e
        for e in events
        if e.get("cat") == "user_annotation" and e["name"].startswith(STEP)
    }
    chosen = [steps[i] for i in sorted(steps) if i < len(step_kinds) and step_kinds[i] == kind]
    if not chosen:
        return None
    thread = (chosen[0]["pid"], chosen[0]["tid"])

    def on_thread(event: dict[str, Any]) -> bool:
        return (event.get("pid"), event.get("tid")) == thread

    ranges = [
        (e["ts"], e["ts"] + e["dur"], STEP if e["name"].startswith(STEP) else e["name"])
        for e in events
        if e.get("cat") == "user_annotation" and e["name"].startswith(PREFIX) and on_thread(e)
    ]
    segments = innermost_segments(ranges)
    windows = sorted((e["ts"], e["ts"] + e["dur"]) for e in chosen)
    in_step = _window_finder(windows)
    count = len(windows)
    on_device = any(e.get("cat") in DEVICE_CATEGORIES for e in events)
    ops = _device_ops(events, on_thread) if on_device else _outermost_cpu_ops(events, on_thread)
    ops = [op for op in ops if in_step(op.launch) is not None]
    label_at = _label_finder(segments)

    host: dict[str, float] = defaultdict(float)
    for segment in segments:
        if in_step(segment.start) is not None:
            host[segment.label] += segment.end - segment.start
    device: dict[str, float] = defaultdict(float)
    launches: dict[str, int] = defaultdict(int)
    for op in ops:
        label = label_at(op.launch) or STEP
        device[label] += op.duration
        launches[label] += 1
    parts = [
        {
            "part": part_name(label),
            "host_ms": host.get(label, 0.0) / count / 1e3,
            "device_ms": device.get(label, 0.0) / count / 1e3 if on_device else None,
            "ops": launches.get(label, 0) / count,
        }
        for label in sorted(
            set(host) | set(device), key=lambda lb: -(device if on_device else host).get(lb, 0.0)
        )
    ]
    forward_us = sum(
        end - start for start, end, label in ranges if label == FORWARD and in_step(start) is not None
    )
    wall_us = sum(end - start for start, end in windows)
    return {
        "step_kind": kind,
        "steps": count,
        "step_ms": wall_us / count / 1e3,
        "ops_are": "CUDA kernels and copies" if on_device else "CPU ops (outermost)",
        "ops_per_step": len(ops) / count,
        "op_ms_per_step": sum(op.duration for op in ops) / count / 1e3,
        "top_ops": _top_ops(ops, count),
        "by_part": parts,
        "host": {
            "outside_forward_ms": (wall_us - forward_us) / count / 1e3,
            **(_device_idle(ops, windows, segments) if on_device else {"device_idle": None}),
        },
    }


def _window_finder(windows: list[tuple[float, float]]) -> Callable[[float], int | None]:
    starts = [start for start, _ in windows]

    def find(ts: float) -> int | None:
        index = bisect.bisect_right(starts, ts) - 1
        return index if index >= 0 and ts < windows[index][1] else None

    return find


def _label_finder(segments: list[Segment]) -> Callable[[float], str | None]:
    starts = [segment.start for segment in segments]

    def find(ts: float) -> str | None:
        index = bisect.bisect_right(starts, ts) - 1
        return segments[index].label if index >= 0 and ts < segments[index].end else None

    return find


def _device_ops(events: list[dict[str, Any]], on_thread: Callable[[dict[str, Any]], bool]) -> list[Op]:
    """Kernels, copies and memsets, each at the time its launching call on the step's thread began."""
    launched = {
        e["args"]["correlation"]: e["ts"]
        for e in events
        if e.get("cat") in LAUNCH_CATEGORIES and on_thread(e) and "correlation" in e.get("args", {})
    }
    return [
        Op(launched[e["args"]["correlation"]], e["ts"], e["dur"], e["name"][:_NAME_WIDTH])
        for e in events
        if e.get("cat") in DEVICE_CATEGORIES and e.get("args", {}).get("correlation") in launched
    ]


def _outermost_cpu_ops(events: list[dict[str, Any]], on_thread: Callable[[dict[str, Any]], bool]) -> list[Op]:
    ops = sorted(
        (e for e in events if e.get("cat") == "cpu_op" and on_thread(e)), key=lambda e: (e["ts"], -e["dur"])
    )
    outermost, covered_until = [], float("-inf")
    for e in ops:
        if e["ts"] >= covered_until:
            outermost.append(Op(e["ts"], e["ts"], e["dur"], e["name"][:_NAME_WIDTH]))
            covered_until = e["ts"] + e["dur"]
    return outermost


def _top_ops(ops: list[Op], steps: int) -> list[dict[str, Any]]:
    """The ops with the most device time a step that is theirs alone (`_own_times`), their count and
    their whole spans a step beside it."""
    spans: dict[str, list[float]] = defaultdict(list)
    owned: dict[str, float] = defaultdict(float)
    for op, own in zip(ops, _own_times(ops), strict=True):
        spans[op.name].append(op.duration)
        owned[op.name] += own
    ranked = sorted(spans, key=lambda name: -owned[name])[:TOP_OPS]
    return [
        {
            "name": name,
            "per_step": len(spans[name]) / steps,
            "ms_per_step": sum(spans[name]) / steps / 1e3,
            "own_ms_per_step": owned[name] / steps / 1e3,
        }
        for name in ranked
    ]


def _own_times(ops: list[Op]) -> list[float]:
    """Each op's own time: from its start, or from the end of the ops that started before it if that is
    later, to its end (0 if they outlast it). With programmatic dependent launch a kernel starts while the
    one before it runs and waits for it, so its span counts its predecessor's time again; own times do not
    overlap, and they add up to the time the device was busy."""
    own = [0.0] * len(ops)
    cursor = float("-inf")
    for index in sorted(range(len(ops)), key=lambda i: ops[i].start):
        op = ops[index]
        end = op.start + op.duration
        own[index] = max(0.0, end - max(op.start, cursor))
        cursor = max(cursor, end)
    return own


def _device_idle(
    ops: list[Op], windows: list[tuple[float, float]], segments: list[Segment]
) -> dict[str, Any]:
    """Within each step: the device's busy time (the union of its kernels and copies), its idle time before
    the first, between them and after the last, and the idle time by the host part that ran meanwhile."""
    before, between, after, busy = [], [], [], []
    starts = [segment.start for segment in segments]
    idle_by_part: dict[str, float] = defaultdict(float)
    for start, end in windows:
        intervals = sorted(
            (max(op.start, start), min(op.start + op.duration, end))
            for op in ops
            if op.start < end and op.start + op.duration > start
        )
        gaps, cursor, busy_us = [], start, 0.0
        for begin, finish in intervals:
            if begin > cursor:
                gaps.append((cursor, begin))
            busy_us += max(0.0, finish - max(begin, cursor))
            cursor = max(cursor, finish)
        if end > cursor:
            gaps.append((cursor, end))
        busy.append(busy_us)
        first = intervals[0][0] if intervals else end
        last = cursor if intervals else end
        before.append(first - start)
        after.append(end - last if intervals else 0.0)
        between.append(end - start - busy_us - before[-1] - after[-1])
        for gap_start, gap_end in gaps:
            index = max(0, bisect.bisect_right(starts, gap_start) - 1)
            while index < len(segments) and segments[index].start < gap_end:
                segment = segments[index]
                overlap = min(gap_end, segment.end) - max(gap_start, segment.start)
                if overlap > 0:
                    idle_by_part[segment.label] += overlap
                index += 1
    steps = len(windows)
    ranked = sorted(idle_by_part.items(), key=lambda item: -item[1])
    return {
        "device_idle": {
            "busy_ms": statistics.fmean(busy) / 1e3,
            "idle_ms": statistics.fmean(b + m + a for b, m, a in zip(before, between, after, strict=True))
            / 1e3,
            "before_first_ms": statistics.fmean(before) / 1e3,
            "between_ms": statistics.fmean(between) / 1e3,
            "after_last_ms": statistics.fmean(after) / 1e3,
            "by_part": [{"part": part_name(label), "ms": us / steps / 1e3} for label, us in ranked],
        }
    }
