"""The kernels of a speculative step's CUDA graphs on one request, by name: the plain decode graph (1 token),
the verify graph (width + 1 tokens) and the MTP draft graph, each replayed under the torch profiler (CUPTI
records the kernels a graph launches). Prints, per graph, GPU microseconds per replay and kernel launches
per replay for the top kernel names, then the names whose time grows most from decode to verify, then the
kernels of one eager speculative step by the module type that launched them.
MTP drafts at a forced mean accepted length of 2.58 (profile_spec.py's engine).
Usage: python scripts/profile_kernels.py [MODEL] [WIDTH]."""

from __future__ import annotations

import sys
from collections import defaultdict
from collections.abc import Callable

import torch
from profile_spec import speculating_engine  # scripts/ is on sys.path when this runs as a script
from torch.profiler import ProfilerActivity, profile

_REPLAYS = 20


def _kernels(replay: Callable[[], object]) -> dict[str, tuple[float, float]]:
    """Kernel name -> (GPU us per replay, launches per replay)."""
    for _ in range(3):
        replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(_REPLAYS):
            replay()
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.device_time > 0:
            totals[event.name[:90]][0] += event.device_time / _REPLAYS
            totals[event.name[:90]][1] += 1 / _REPLAYS
    return {name: (us, count) for name, (us, count) in totals.items()}


def _kernels_by_module(model: torch.nn.Module, step: Callable[[], object]) -> dict[str, tuple[float, float]]:
    """Module class name -> (GPU us, launches) of one eager `step`: every module's forward runs inside a
    profiler range, and each kernel counts for the innermost range around the op that launched it
    ("(outside the model)" for the engine's own ops: sampling, acceptance)."""
    ranges: list[torch.profiler.record_function] = []

    def enter(module: torch.nn.Module, args: object) -> None:
        ranges.append(torch.profiler.record_function(f"module:{type(module).__name__}"))
        ranges[-1].__enter__()

    def leave(module: torch.nn.Module, args: object, output: object) -> None:
        ranges.pop().__exit__(None, None, None)

    handles = [
        h
        for m in model.modules()
        for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))
    ]
    try:
        step()  # warm: the same shapes compiled before the profile
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
    finally:
        for handle in handles:
            handle.remove()
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for event in prof.events():
        if not event.kernels:
            continue
        owner = event.cpu_parent
        while owner is not None and not owner.name.startswith("module:"):
            owner = owner.cpu_parent
        name = owner.name.removeprefix("module:") if owner is not None else "(outside the model)"
        totals[name][0] += sum(kernel.duration for kernel in event.kernels)
        totals[name][1] += len(event.kernels)
    return {name: (us, count) for name, (us, count) in totals.items()}


def _table(title: str, kernels: dict[str, tuple[float, float]], rows: int = 22) -> None:
    total = sum(us for us, _ in kernels.values())
    launches = sum(count for _, count in kernels.values())
    print(f"\n## {title}: {total:.0f} us of kernels, {launches:.0f} launches per replay")
    for name, (us, count) in sorted(kernels.items(), key=lambda item: -item[1][0])[:rows]:
        print(f"{us:9.1f} us {count:6.0f}x  {name}")


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else "preset:qwen3-next-80b-a3b"
    width = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    engine = speculating_engine(model, width, 2.58)
    decode = _kernels(engine.graphs._graphs[1].replay)
    verify = _kernels(engine.verify_graphs[width + 1]._graphs[1].replay)
    draft = _kernels(engine.speculative.drafter.graphs[width]._replays[1])
    _table("decode graph (1 token)", decode)
    _table(f"verify graph ({width + 1} tokens)", verify)
    _table(f"MTP draft graph (width {width})", draft, rows=12)
    growth = {name: verify.get(name, (0.0, 0))[0] - decode.get(name, (0.0, 0))[0] for name in verify | decode}
    print("\n## verify minus decode, by kernel name (us per replay)")
    for name, extra in sorted(growth.items(), key=lambda item: -abs(item[1]))[:15]:
        print(f"{extra:+9.1f} us  {name}")
    # Graphs off: one eager speculative step (verify forward and MTP draft), kernels by module type.
    engine.runner.decode_graphs, engine.runner.verify_graphs, engine.speculative.drafter.graphs = None, {}, {}
    _table(
        "one eager speculative step (verify + draft), by module",
        _kernels_by_module(engine.model, engine.step),
    )


if __name__ == "__main__":
    main()
