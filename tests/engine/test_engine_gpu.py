"""The engine on a CUDA device (skipped where there is none)."""

from __future__ import annotations

import pytest
import torch

from morion import LLM, SamplingParams

pytestmark = pytest.mark.gpu

QUESTIONS = [
    "What is the capital of France? Answer in one word.",
    "Name a primary colour.",
    "Hi",
    "What is 2+2?",
]


@pytest.fixture(scope="module")
def cpu_and_cuda(smollm2_gguf):
    return (
        LLM(model=str(smollm2_gguf), device="cpu", dtype="float32", kv_cache_tokens=8192),
        LLM(model=str(smollm2_gguf), device="cuda", dtype="float32", kv_cache_tokens=8192),
    )


def test_cuda_fp32_matches_cpu(cpu_and_cuda, greedy_checker, prefill_logits):
    cpu, cuda = cpu_and_cuda
    prompts = [cpu.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    on_cpu = cpu.generate(prompts, params)
    on_cuda = cuda.generate(prompts, params)
    for prompt, a, b in zip(prompts, on_cuda, on_cpu, strict=True):
        greedy_checker(
            a.token_ids,
            b.token_ids,
            lambda s, p=prompt, r=b: prefill_logits(cpu.engine.model, p + r.token_ids[:s])[-1],
            1e-3,
        )
    assert "Paris" in on_cuda[0].text
    cuda.engine.check_integrity()


def test_bf16_default_answers(smollm2_gguf):
    llm = LLM(model=str(smollm2_gguf), device="cuda", kv_cache_tokens=8192)
    assert llm.engine.model.model.embed_tokens.weight.dtype == torch.bfloat16
    prompt = llm.encode_chat([{"role": "user", "content": QUESTIONS[0]}])
    [out] = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0))
    assert "Paris" in out.text
