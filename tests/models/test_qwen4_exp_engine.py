"""Qwen3.8-Flash-Next (qwen4_exp) through the engine: chunked prefill, batching, and prefix hits on the
device and from the host tier must equal cold runs. A hit is only right if every component came back:
K/V, QSA's raw index keys (paged with them), the Gated DeltaNet state and PLE's conv window and n-gram
history (in the state snapshot). Seeded random weights of the tiny config (model-architecture.md §5; QSA
budget 16, below every prompt here), with the n-gram table drawn as FP8 with a scale, as in the release.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from morion.engine.sampling_params import SamplingParams
from morion.loader import load_model

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PAGE = 8
EOS = 5
CONFIG = {
    "model_type": "qwen4_exp_text",
    "vocab_size": 4096,
    "hidden_size": 256,
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
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 128,
    "max_position_embeddings": 4096,
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
    "eos_token_id": EOS,
}


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen4_exp_config")
    (directory / "config.json").write_text(json.dumps(CONFIG))
    return load_model(str(directory), torch.float32, torch.device("cpu"), "dummy")


def _prompts(count: int, seed: int, lengths: tuple[int, int]) -> list[list[int]]:
    """Random prompts with an EOS here and there (PLE's n-gram context stops at one)."""
    rng = random.Random(seed)
    return [
        [
            EOS if rng.random() < 0.05 else rng.randrange(CONFIG["vocab_size"])
            for _ in range(rng.randint(*lengths))
        ]
        for _ in range(count)
    ]


@pytest.fixture(scope="module")
def cold(loaded, engine_factory, engine_runner):
    """Each prompt alone, whole, without a prefix cache: what every other run must equal."""
    engine = engine_factory(loaded, page_size=PAGE, enable_prefix_cache=False)
    return lambda prompt: engine_runner(engine, [prompt], GREEDY)[0].token_ids


def test_cache_spec_has_every_component(loaded, engine_factory):
    spec = engine_factory(loaded, page_size=PAGE).pool.spec
    assert [c.name for c in spec.token_components] == ["kv", "qsa_index_keys", "qsa_block_keys"]
    assert [c.name for c in spec.state_components] == ["conv", "recurrent", "ple_conv", "ple_ngram"]
    (table,) = loaded.model.host_tables()
    assert table.dtype == torch.float8_e4m3fn and table.scale is not None  # drawn on the host, FP8


def test_batched_equals_single(loaded, engine_factory, engine_runner, cold):
    prompts = _prompts(5, seed=0, lengths=(1, 60))
    batched = engine_runner(engine_factory(loaded, page_size=PAGE), prompts, GREEDY)
    assert [output.token_ids for output in batched] == [cold(prompt) for prompt in prompts]


@pytest.mark.parametrize("chunk", [7, 16])
def test_chunked_prefill_equals_unchunked(loaded, engine_factory, engine_runner, cold, chunk):
    prompts = _prompts(2, seed=1, lengths=(40, 70))
    engine = engine_factory(loaded, page_size=PAGE, chunk_size=chunk)
    assert [output.token_ids for output in engine_runner(engine, prompts, GREEDY)] == [
        cold(p) for p in prompts
    ]
    engine.check_integrity()


def test_device_prefix_hit_equals_cold(loaded, engine_factory, engine_runner, cold):
    engine = engine_factory(loaded, page_size=PAGE, chunk_size=16)
    (prompt,) = _prompts(1, seed=2, lengths=(45, 45))
    first = engine_runner(engine, [prompt], GREEDY)[0]
    follow_up = prompt + first.token_ids + [7, 8, EOS, 9, 10]
    second = engine_runner(engine, [follow_up], GREEDY)[0]
    # The finished request left its state at 56 (45 prompt + 11 computed outputs), a page boundary.
    assert first.token_ids == cold(prompt)
    assert second.usage.cached_tokens == 56 and second.token_ids == cold(follow_up)
    engine.check_integrity()


def test_host_tier_hit_equals_cold(loaded, engine_factory, engine_runner, cold):
    """After the device cache is evicted, the hit comes back from host memory: pages of K/V and index
    keys, and the snapshot with the Gated DeltaNet and PLE states."""
    engine = engine_factory(loaded, page_size=PAGE, chunk_size=16, host_cache_gb=8 / 1024)
    (prompt,) = _prompts(1, seed=3, lengths=(45, 45))
    first = engine_runner(engine, [prompt], GREEDY)[0]
    follow_up = prompt + first.token_ids + [7, 8, 9]
    assert engine.evict_device_cache() > 0 and engine.prefix_cache.cached_snapshots == 0
    resumed = engine_runner(engine, [follow_up], GREEDY)[0]
    stats = engine.cache_stats
    assert resumed.usage.cached_tokens == 56 and stats.host_hit_tokens == 56 and stats.restored_snapshots == 1
    assert resumed.token_ids == cold(follow_up)
    engine.check_integrity()
    engine.close()
