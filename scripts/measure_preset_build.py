"""Builds a full-size random-weight preset on the GPU and reports build time and memory, then runs a
few engine steps on it (a smoke check of the pure-torch path at real shapes, not a speed claim).

Usage: python scripts/measure_preset_build.py preset:qwen3-next-80b-a3b-12l [more presets...]
"""

from __future__ import annotations

import json
import sys
import time

import torch

from morion.engine.sampling_params import SamplingParams
from morion.llm import LLM


def measure(preset: str) -> dict:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    try:
        llm = LLM(model=preset, device="cuda", dtype="bfloat16", kv_cache_gb=8, max_running_requests=4)
    except torch.OutOfMemoryError as error:
        return {"preset": preset, "built": False, "error": str(error).splitlines()[0]}
    torch.cuda.synchronize()
    build_s = time.perf_counter() - started
    weights = sum(p.numel() * p.element_size() for p in llm.engine.model.parameters())
    result = {
        "preset": preset,
        "built": True,
        "build_s": round(build_s, 2),
        "parameters_b": round(sum(p.numel() for p in llm.engine.model.parameters()) / 1e9, 3),
        "weight_gib": round(weights / 2**30, 2),
        "allocated_gib": round(torch.cuda.memory_allocated() / 2**30, 2),
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
    }
    started = time.perf_counter()
    [out] = llm.generate([list(range(1, 65))], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    torch.cuda.synchronize()
    result["prefill64_plus_8_decode_s"] = round(time.perf_counter() - started, 2)
    result["finite_tokens"] = len(out.token_ids)
    del llm
    return result


if __name__ == "__main__":
    for name in sys.argv[1:]:
        print(json.dumps(measure(name)), flush=True)
