"""Where a decode step's time goes on CUDA: graph replay alone, a whole engine step, and the kernels of one
eager step (torch profiler, top entries by CUDA time).
Usage: python scripts/profile_decode.py [MODEL] [MOE_KERNEL (auto|grouped|triton, as --moe-kernel)]."""

from __future__ import annotations

import sys
import time

import torch

from morion.config import EngineConfig
from morion.engine.engine import Engine
from morion.engine.sampling_params import SamplingParams


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else "preset:qwen3-next-80b-a3b-12l"
    moe_kernel = sys.argv[2] if len(sys.argv) > 2 else "auto"
    engine = Engine(
        EngineConfig(
            model=model, load_format="dummy", weight_dtype="fp8", kv_cache_dtype="fp8",
            max_running_requests=4, cuda_graph_max_batch=4, kv_cache_tokens=65536, moe_kernel=moe_kernel,
        )
    )  # fmt: skip
    engine.add_request(list(range(1000, 2024)), SamplingParams(max_tokens=400, ignore_eos=True))
    for _ in range(40):
        engine.step()
    torch.cuda.synchronize()
    started = time.perf_counter()
    steps = 50
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - started) / steps * 1e3
    graphs = engine.graphs
    graph = graphs._graphs[1]
    started = time.perf_counter()
    for _ in range(steps):
        graph.replay()
    torch.cuda.synchronize()
    replay_ms = (time.perf_counter() - started) / steps * 1e3
    print(f"moe kernel {moe_kernel}: engine step {step_ms:.2f} ms, graph replay {replay_ms:.2f} ms")
    engine.runner.decode_graphs = None  # eager steps for the profile
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]
    ) as prof:
        for _ in range(3):
            engine.step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
    engine.runner.decode_graphs = graphs
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            engine.step()
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main()
