"""Where the device waits for the host in a speculative step (CUDA): one request on the MTP drafter at a
forced acceptance (scripts/profile_spec.py's engine), 10 engine steps under the torch profiler with the
host phases marked (schedule, propose, build the batch, verify replay, acceptance, the next drafts'
launch, commit, the step's outputs). Prints per step the wall time, the time some kernel or copy ran,
and every gap of the device longer than 20 us with the host phases that ran during it; writes the
Chrome trace.
Usage: python scripts/profile_spec_timeline.py [MODEL] [WIDTH] [MEAN_ACCEPTED] [TRACE_PATH]."""

from __future__ import annotations

import functools
import gzip
import json
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from morion.engine import engine as engine_module
from morion.engine.scheduler import Scheduler
from morion.runner.cuda_graph import DecodeGraphRunner
from morion.spec import speculative as speculative_module
from morion.spec.mtp import MtpDrafter

sys.path.insert(0, str(Path(__file__).parent))
from profile_spec import speculating_engine

GAP_US = 20.0


def _marked(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with torch.profiler.record_function(name):
            return function(*args, **kwargs)

    return wrapper


def mark_phases() -> None:
    """Wraps the host phases of a step in profiler ranges (this process only)."""
    spec = speculative_module.SpeculativeDecoding
    for owner, attribute, name in [
        (engine_module.Engine, "step", "engine.step"),
        (engine_module.Engine, "_append_token", "append_token"),
        (Scheduler, "schedule", "schedule"),
        (spec, "_verify", "verify"),
        (engine_module.Engine, "_commit", "commit"),
        (spec, "_launch_drafts", "launch_drafts"),
        (MtpDrafter, "propose", "propose"),
        (MtpDrafter, "after_verify", "mtp.after_verify"),
        (DecodeGraphRunner, "run", "graph.run"),
    ]:
        setattr(owner, attribute, _marked(name, getattr(owner, attribute)))
    speculative_module.decide_acceptance = _marked("acceptance", speculative_module.decide_acceptance)
    speculative_module.build_forward_batch = _marked(
        "build_forward_batch", speculative_module.build_forward_batch
    )


def _intervals(events: list[dict], categories: set[str]) -> list[tuple[float, float]]:
    return sorted((e["ts"], e["ts"] + e.get("dur", 0.0)) for e in events if e.get("cat") in categories)


def analyse(trace: dict) -> list[str]:
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    device = _intervals(events, {"kernel", "gpu_memcpy", "gpu_memset"})
    marks = [e for e in events if e.get("cat") == "user_annotation"]
    steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in marks if e["name"] == "engine.step")
    lines = []
    idle_by_phase: dict[str, float] = defaultdict(float)
    for index, (begin, end) in enumerate(steps):
        busy, gaps, cursor = 0.0, [], begin
        for start, stop in device:
            if stop <= cursor or start >= end:
                continue
            start = max(start, cursor)
            if start - cursor > GAP_US:
                gaps.append((cursor, start))
            busy += min(stop, end) - start
            cursor = max(cursor, min(stop, end))
        if end - cursor > GAP_US:
            gaps.append((cursor, end))
        lines.append(f"step {index}: wall {(end - begin) / 1e3:.2f} ms, device busy {busy / 1e3:.2f} ms")
        for gap_start, gap_end in gaps:
            during = sorted(
                (
                    m
                    for m in marks
                    if m["name"] != "engine.step" and m["ts"] < gap_end and m["ts"] + m["dur"] > gap_start
                ),
                key=lambda m: m["ts"],
            )
            innermost = during[-1]["name"] if during else "(outside marked phases)"
            idle_by_phase[innermost] += gap_end - gap_start
            lines.append(
                f"  idle {(gap_end - gap_start):7.1f} us during {', '.join(m['name'] for m in during) or '-'}"
            )
    if steps:
        lines.append("device idle by innermost host phase, us per step:")
        for phase, total in sorted(idle_by_phase.items(), key=lambda item: -item[1]):
            lines.append(f"  {phase:24s} {total / len(steps):8.1f}")
    return lines


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else "preset:qwen3-next-80b-a3b"
    width = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    mean = float(sys.argv[3]) if len(sys.argv) > 3 else 2.58
    trace_path = Path(sys.argv[4] if len(sys.argv) > 4 else "spec-timeline.json.gz")
    engine = speculating_engine(model, width, mean)
    mark_phases()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profiler:
        for _ in range(10):
            engine.step()
        torch.cuda.synchronize()
    raw = trace_path.with_suffix("")
    profiler.export_chrome_trace(str(raw))
    trace = json.loads(raw.read_text())
    with gzip.open(trace_path, "wt") as compressed:
        json.dump(trace, compressed)
    raw.unlink()
    print("\n".join(analyse(trace)))


if __name__ == "__main__":
    main()
