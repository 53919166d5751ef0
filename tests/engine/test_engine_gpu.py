"""The engine on a CUDA device against the same engine on the CPU (skipped where there is no GPU)."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from morion.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
TIE_GAP = 1e-3  # fp32 on both devices: only summation order differs


@pytest.mark.parametrize("model", ["small_llama", "tiny_qwen3_next"])
def test_cuda_equals_cpu(model, request, engine_factory, engine_runner, greedy_checker, prefill_logits):
    on_cpu = request.getfixturevalue(model)
    # The same weights on the GPU (dummy weights drawn on each device would differ).
    on_cuda = on_cpu._replace(model=copy.deepcopy(on_cpu.model).to("cuda"))
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(1, 80))] for _ in range(6)]
    cpu_out = engine_runner(engine_factory(on_cpu, page_size=8), prompts, GREEDY)
    cuda_engine = engine_factory(on_cuda, page_size=8, device="cuda", chunk_size=32)
    cuda_out = engine_runner(cuda_engine, prompts, GREEDY)
    for prompt, a, b in zip(prompts, cuda_out, cpu_out, strict=True):
        greedy_checker(
            a.token_ids,
            b.token_ids,
            lambda s, p=prompt, r=b: prefill_logits(on_cpu.model, p + r.token_ids[:s])[-1],
            TIE_GAP,
        )
    again = engine_runner(cuda_engine, prompts, GREEDY)  # prefix-cache hits on the GPU
    assert [o.token_ids for o in again] == [o.token_ids for o in cuda_out]
    assert sum(o.usage.cached_tokens for o in again) > 0
    cuda_engine.check_integrity()


def test_bf16_on_cuda_runs(small_llama, engine_factory, engine_runner):
    loaded = small_llama._replace(model=copy.deepcopy(small_llama.model).to("cuda", torch.bfloat16))
    engine = engine_factory(loaded, device="cuda")
    assert engine.pool.storage("kv").dtype == torch.bfloat16
    outputs = engine_runner(engine, [[1, 2, 3], list(range(40))], GREEDY)
    assert all(len(o.token_ids) == 16 for o in outputs)
