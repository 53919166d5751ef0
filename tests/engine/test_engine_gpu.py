"""The engine on a CUDA device against the same engine on the CPU (skipped where there is no GPU)."""

from __future__ import annotations

import copy
import json
import random

import pytest
import torch
import transformers

from morion.engine.sampling_params import SamplingParams
from morion.loader import load_model

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
TIE_GAP = 1e-3  # fp32 on both devices: only summation order differs


def _llama_dir(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    directory = tmp_path_factory.mktemp("gpu_llama")
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def _qwen3_next_dir(tmp_path_factory):
    config = dict(
        model_type="qwen3_next",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        full_attention_interval=2,
        max_position_embeddings=512,
    )
    directory = tmp_path_factory.mktemp("gpu_qwen3_next")
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize("make_dir", [_llama_dir, _qwen3_next_dir], ids=["llama", "qwen3_next"])
def test_cuda_equals_cpu(
    make_dir, tmp_path_factory, engine_factory, engine_runner, greedy_checker, prefill_logits
):
    directory = make_dir(tmp_path_factory)
    load_format = "auto" if (directory / "model.safetensors").exists() else "dummy"
    on_cpu = load_model(str(directory), torch.float32, torch.device("cpu"), load_format)
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


def test_bf16_on_cuda_runs(tmp_path_factory, engine_factory, engine_runner):
    loaded = load_model(str(_llama_dir(tmp_path_factory)), torch.bfloat16, torch.device("cuda"))
    engine = engine_factory(loaded, device="cuda")
    assert engine.pool.storage("kv").dtype == torch.bfloat16
    outputs = engine_runner(engine, [[1, 2, 3], list(range(40))], GREEDY)
    assert all(len(o.token_ids) == 16 for o in outputs)
