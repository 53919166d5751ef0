"""Where a speculative decoding step's time goes on CUDA, one request, MTP drafts at a forced acceptance:
whole engine steps (ms per step, tokens per step) beside the plain decode graph's replay, the verify
graph's replay and the MTP draft graph's replay alone; then the host side of five steps (torch profiler,
CPU ops by self time: syncs show up as aten::item / _local_scalar_dense / cudaStreamSynchronize).
Usage: python scripts/profile_spec.py [MODEL] [WIDTH] [MEAN_ACCEPTED]."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch

from morion.config import EngineConfig
from morion.engine.engine import Engine
from morion.engine.sampling_params import SamplingParams
from morion.spec.forced import ForcedAcceptance
from morion.spec.synthetic import acceptance_for_mean_accepted


def _ms_per_call(function: Callable[[], object], calls: int = 50) -> float:
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(calls):
        function()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / calls * 1e3


def speculating_engine(model: str, width: int, mean: float) -> Engine:
    """One request (1,024-token prompt) 30 steps into MTP speculation at a forced acceptance: every graph
    captured and warm. FP8 weights and K/V."""
    config = EngineConfig(
        model=model, load_format="dummy", weight_dtype="fp8", kv_cache_dtype="fp8", max_running_requests=1,
        cuda_graph_max_batch=1, kv_cache_tokens=65536, enable_prefix_cache=False, speculative="mtp",
        spec_width=width,
    )  # fmt: skip
    forced = ForcedAcceptance(acceptance_for_mean_accepted(mean, width), seed=0)
    engine = Engine(config, forced_acceptance=forced)
    engine.add_request(list(range(1000, 2024)), SamplingParams(max_tokens=4000, ignore_eos=True))
    for _ in range(30):
        engine.step()
    return engine


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else "preset:qwen3-next-80b-a3b"
    width = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    mean = float(sys.argv[3]) if len(sys.argv) > 3 else 2.58
    engine = speculating_engine(model, width, mean)
    steps, tokens = 50, 0
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        tokens += sum(len(output.new_token_ids) for output in engine.step())
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - started) / steps * 1e3
    verify = engine.verify_graphs[width + 1]._graphs[1]
    draft = engine.speculative.drafter.graphs[width]._replays[1]
    decode = engine.graphs._graphs[1]
    print(
        f"width {width}, mean accepted {mean}: engine step {step_ms:.2f} ms, {tokens / steps:.2f} tokens per "
        f"step ({tokens / steps / step_ms * 1e3:.1f} tok/s); replays alone: decode "
        f"{_ms_per_call(decode.replay):.2f} ms, verify {_ms_per_call(verify.replay):.2f} ms, MTP draft "
        f"{_ms_per_call(draft):.2f} ms"
    )
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            engine.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))


if __name__ == "__main__":
    main()
