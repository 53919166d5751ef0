"""Qwen3.8-Flash-Next (qwen4_exp) through the engine: chunked prefill, batching, and prefix hits on the
device and from the host tier must equal cold runs. A hit is only right if every component came back:
K/V, QSA's raw index keys (paged with them), the Gated DeltaNet state and PLE's conv window and n-gram
history (in the state snapshot). Seeded random weights of the tiny config (model-architecture.md §5; QSA
budget 16, below every prompt here), with the n-gram table drawn as FP8 with a scale, as in the release.
"""

from __future__ import annotations

import pytest
import torch

from morion.engine.sampling_params import SamplingParams
from tests.models.conftest import QWEN4_EXP_EOS as EOS
from tests.models.conftest import qwen4_exp_prompts

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PAGE = 8


@pytest.fixture(scope="module")
def cold(qwen4_exp_tiny, engine_factory, engine_runner):
    """Each prompt alone, whole, without a prefix cache: what every other run must equal."""
    engine = engine_factory(qwen4_exp_tiny, page_size=PAGE, enable_prefix_cache=False)
    return lambda prompt: engine_runner(engine, [prompt], GREEDY)[0].token_ids


def test_cache_spec_has_every_component(qwen4_exp_tiny, engine_factory):
    spec = engine_factory(qwen4_exp_tiny, page_size=PAGE).pool.spec
    assert [c.name for c in spec.token_components] == ["kv", "qsa_index_keys", "qsa_block_keys"]
    assert [c.name for c in spec.state_components] == ["conv", "recurrent", "ple_conv", "ple_ngram"]
    (table,) = qwen4_exp_tiny.model.host_tables()
    assert table.dtype == torch.float8_e4m3fn and table.scale is not None  # drawn on the host, FP8


def test_batched_equals_single(qwen4_exp_tiny, engine_factory, engine_runner, cold):
    prompts = qwen4_exp_prompts(5, seed=0, lengths=(1, 60))
    batched = engine_runner(engine_factory(qwen4_exp_tiny, page_size=PAGE), prompts, GREEDY)
    assert [output.token_ids for output in batched] == [cold(prompt) for prompt in prompts]


@pytest.mark.parametrize("chunk", [12, 16])  # 12: a budget that is no whole number of pages
def test_chunked_prefill_equals_unchunked(qwen4_exp_tiny, engine_factory, engine_runner, cold, chunk):
    prompts = qwen4_exp_prompts(2, seed=1, lengths=(40, 70))
    engine = engine_factory(qwen4_exp_tiny, page_size=PAGE, chunk_size=chunk)
    assert [output.token_ids for output in engine_runner(engine, prompts, GREEDY)] == [
        cold(p) for p in prompts
    ]
    engine.check_integrity()


def test_device_prefix_hit_equals_cold(qwen4_exp_tiny, engine_factory, engine_runner, cold):
    engine = engine_factory(qwen4_exp_tiny, page_size=PAGE, chunk_size=16)
    (prompt,) = qwen4_exp_prompts(1, seed=2, lengths=(45, 45))
    first = engine_runner(engine, [prompt], GREEDY)[0]
    follow_up = prompt + first.token_ids + [7, 8, EOS, 9, 10]
    second = engine_runner(engine, [follow_up], GREEDY)[0]
    # The finished request left its state at 56 (45 prompt + 11 computed outputs), a page boundary.
    assert first.token_ids == cold(prompt)
    assert second.usage.cached_tokens == 56 and second.token_ids == cold(follow_up)
    engine.check_integrity()


def test_host_tier_hit_equals_cold(qwen4_exp_tiny, engine_factory, engine_runner, cold):
    """After the device cache is evicted, the hit comes back from host memory: pages of K/V and index
    keys, and the snapshot with the Gated DeltaNet and PLE states."""
    engine = engine_factory(qwen4_exp_tiny, page_size=PAGE, chunk_size=16, host_cache_gb=8 / 1024)
    (prompt,) = qwen4_exp_prompts(1, seed=3, lengths=(45, 45))
    first = engine_runner(engine, [prompt], GREEDY)[0]
    follow_up = prompt + first.token_ids + [7, 8, 9]
    assert engine.evict_device_cache() > 0 and engine.prefix_cache.cached_snapshots == 0
    resumed = engine_runner(engine, [follow_up], GREEDY)[0]
    stats = engine.cache_stats
    assert resumed.usage.cached_tokens == 56 and stats.host_hit_tokens == 56 and stats.restored_snapshots == 1
    assert resumed.token_ids == cold(follow_up)
    engine.check_integrity()
    engine.close()
