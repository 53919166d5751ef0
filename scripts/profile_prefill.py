"""Where a cold prefill's time goes on CUDA: the wall time of one fresh prompt (max_tokens 1) after a
warm-up prompt, then the torch profiler's top ops of another, by CUDA time and by CPU self time (host
syncs show up as aten::item / _local_scalar_dense / cudaStreamSynchronize).
Usage: python scripts/profile_prefill.py [MODEL] [PROMPT_TOKENS]."""

from __future__ import annotations

import sys
import time

import torch

from morion.config import EngineConfig
from morion.engine.engine import Engine
from morion.engine.sampling_params import SamplingParams

ONE_TOKEN = SamplingParams(max_tokens=1, ignore_eos=True)


def _prefill(engine: Engine, first_id: int, length: int) -> float:
    """Seconds until a fresh prompt of `length` ids from `first_id` on has its first token."""
    torch.cuda.synchronize()
    started = time.perf_counter()
    engine.add_request([first_id + i % 20000 for i in range(length)], ONE_TOKEN)
    while engine.has_unfinished():
        engine.step()
    torch.cuda.synchronize()
    return time.perf_counter() - started


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else "preset:qwen3.8-flash-next-12l"
    length = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
    config = EngineConfig(
        model=model, load_format="dummy", weight_dtype="fp8", kv_cache_dtype="fp8", max_running_requests=2,
        cuda_graph_max_batch=2, kv_cache_tokens=65536, enable_prefix_cache=False,
    )  # fmt: skip
    engine = Engine(config)
    _prefill(engine, 1000, length)  # compiles the prefill kernels at these shapes
    seconds = _prefill(engine, 3000, length)
    print(f"{model}: prefill of {length} tokens {seconds * 1e3:.0f} ms ({length / seconds:.0f} tok/s)")
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        _prefill(engine, 5000, length)
    averages = prof.key_averages()
    print(averages.table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
    print(averages.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main()
