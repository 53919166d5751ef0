"""Qwen3.8-Flash-Next (qwen4_exp) on a CUDA device (skipped where there is none): the n-gram table in
page-locked host memory, its rows copied on a side stream, and the engine on the GPU against the CPU."""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import save_file

from morion.cache.page_pool import PagePool
from morion.cache.state_slots import StateSlots
from morion.engine.forward_batch import PagedAttentionBackend, build_forward_batch
from morion.engine.sampling_params import SamplingParams
from morion.layers.host_table import HostRowTable, shard_name
from morion.loader import load_model

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
TIE_GAP = 1e-3
CONFIG = {
    "model_type": "qwen4_exp_text",
    "vocab_size": 1024,
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 6,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25},
    "hc_count": 4,
    "hc_lowrank": 32,
    "ple_layer_ids": [2],
    "heads_per_ngram": 2,
    "ngram_vocab_size_base": 1000,
    "make_ngram_vocab_size_divisible_by": 8,
    "split_ngram_parts": 4,
    "ple_embedding_dtype": "float8_e4m3fn",
    "indexer_n_heads": 2,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 64,
    "indexer_budget": 16,
    "indexer_compress_ratio": 4,
    "output_gate_type": "sigmoid",
    "eos_token_id": 5,
}


def test_table_rows_reach_the_device_from_page_locked_memory():
    table = HostRowTable(num_rows=1000, dim=16, parts=3)
    table.place("ram", pin_memory=True, model_dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    for index in range(table.num_shards):
        table.load(
            shard_name(index),
            torch.randn(table.shard_shape(index), generator=generator).to(torch.float8_e4m3fn),
        )
    table.load("weight_scale", torch.tensor([0.5], dtype=torch.bfloat16))
    assert all(shard.is_pinned() for shard in table.shards)
    rows = torch.tensor([0, 999, 333, 334, 667, 5, 5])
    fetched = table.fetch(rows, torch.device("cuda"))
    assert fetched.ready is not None and fetched.staging.is_pinned()
    on_device = fetched.wait(torch.float32)
    assert on_device.is_cuda and torch.equal(on_device.cpu(), table.gather(rows).float() * 0.5)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """Seeded random weights drawn on the CPU, saved, so both devices load the same ones."""
    directory = tmp_path_factory.mktemp("qwen4_exp_gpu")
    (directory / "config.json").write_text(json.dumps(CONFIG))
    model = load_model(str(directory), torch.float32, torch.device("cpu"), "dummy", seed=1).model
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, directory / "model.safetensors")
    return directory


@torch.inference_mode()
def _logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    spec = model.cache_spec(8, torch.float32)
    pages = -(-len(tokens) // 8)
    slots = StateSlots(spec, 1)
    slots.alloc()
    batch = build_forward_batch([(tokens, list(range(pages)), 0, len(tokens))], [0], 8, torch.device("cpu"))
    hidden = model(
        batch.input_ids, batch.positions, PagedAttentionBackend(PagePool(spec, pages), batch, slots)
    )
    return model.compute_logits(hidden)


def test_cuda_equals_cpu(checkpoint, engine_factory, engine_runner, greedy_checker, monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # the PLE conv: fp32 on both devices
    on_cpu = load_model(str(checkpoint), torch.float32, torch.device("cpu"))
    on_cuda = load_model(str(checkpoint), torch.float32, torch.device("cuda"))
    (table,) = on_cuda.model.host_tables()
    assert table.pin_memory and all(shard.is_pinned() and not shard.is_cuda for shard in table.shards)
    rng = random.Random(0)
    prompts = [[rng.randrange(1024) for _ in range(rng.randint(1, 80))] for _ in range(5)]
    cpu_out = engine_runner(engine_factory(on_cpu, page_size=8), prompts, GREEDY)
    engine = engine_factory(on_cuda, page_size=8, device="cuda", chunk_size=32, host_cache_gb=0.05)
    assert engine.graphs is None  # capture refused (host-side PLE and QSA): decode runs eagerly
    cuda_out = engine_runner(engine, prompts, GREEDY)
    for prompt, a, b in zip(prompts, cuda_out, cpu_out, strict=True):
        greedy_checker(
            a.token_ids,
            b.token_ids,
            lambda s, p=prompt, r=b: _logits(on_cpu.model, p + r.token_ids[:s])[-1],
            TIE_GAP,
        )
    again = engine_runner(engine, prompts, GREEDY)  # device prefix-cache hits
    assert [o.token_ids for o in again] == [o.token_ids for o in cuda_out]
    engine.evict_device_cache()
    restored = engine_runner(engine, prompts, GREEDY)  # host-tier hits: copies on the copy stream
    assert [o.token_ids for o in restored] == [o.token_ids for o in cuda_out]
    assert engine.cache_stats.restored_snapshots > 0
    engine.check_integrity()
    engine.close()


def test_bf16_with_fp8_kv_runs(checkpoint, engine_factory, engine_runner):
    loaded = load_model(str(checkpoint), torch.bfloat16, torch.device("cuda"))
    engine = engine_factory(loaded, device="cuda", kv_cache_dtype="fp8", cuda_graph=False)
    outputs = engine_runner(engine, [[1, 2, 3], list(range(6, 90))], GREEDY)
    assert all(len(o.token_ids) == 16 for o in outputs)
