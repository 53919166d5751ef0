"""Qwen3-Next through the engine: paged K/V + state slots, chunked prefill, batching, and prefix hits
that must resume from a state snapshot (design §3) and still equal a cold run."""

from __future__ import annotations

import random

import pytest
import torch

from morion.engine.sampling_params import SamplingParams
from morion.loader import load_model

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
# fp32; batched, chunked and single runs differ in summation order and in chunked-vs-recurrent delta rule.
TIE_GAP = 1e-3
PAGE = 8


@pytest.fixture(scope="module")
def loaded(qwen3_next_checkpoint):
    directory, _ = qwen3_next_checkpoint("odd")
    return load_model(str(directory), torch.float32, torch.device("cpu"))


def _prompts(count: int, seed: int, lengths: tuple[int, int], vocab_size: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(rng.randint(*lengths))] for _ in range(count)]


@pytest.fixture(scope="module")
def cold(loaded, engine_factory, engine_runner):
    """Each prompt alone, no prefix cache: the reference every other run must equal."""
    engine = engine_factory(loaded, page_size=PAGE, enable_prefix_cache=False)
    return lambda prompts, params=GREEDY: [engine_runner(engine, [p], params)[0] for p in prompts]


def test_cache_spec_reports_state(loaded, engine_factory):
    engine = engine_factory(loaded, page_size=PAGE)
    spec = engine.pool.spec
    assert [c.name for c in spec.state_components] == ["conv", "recurrent"]
    assert spec.bytes_per_slot > 0 and spec.bytes_per_token > 0
    assert engine.state_slots.num_slots == 4 * engine.config.max_running_requests


def test_batched_equals_single(loaded, engine_factory, engine_runner, cold, outputs_agree):
    prompts = _prompts(6, seed=0, lengths=(1, 50), vocab_size=loaded.model.config.vocab_size)
    batched = engine_runner(engine_factory(loaded, page_size=PAGE), prompts, GREEDY)
    outputs_agree(loaded.model, prompts, batched, cold(prompts), TIE_GAP)


@pytest.mark.parametrize("chunk", [12, 16, 64])  # 12: a budget that is no whole number of pages
def test_chunked_prefill_equals_unchunked(loaded, engine_factory, engine_runner, cold, chunk, outputs_agree):
    prompts = _prompts(3, seed=1, lengths=(30, 90), vocab_size=loaded.model.config.vocab_size)
    engine = engine_factory(loaded, page_size=PAGE, chunk_size=chunk)
    chunked = engine_runner(engine, prompts, GREEDY)
    outputs_agree(loaded.model, prompts, chunked, cold(prompts), TIE_GAP)
    engine.check_integrity()


def test_hit_at_a_snapshot_equals_cold(loaded, engine_factory, engine_runner, cold):
    engine = engine_factory(loaded, page_size=PAGE)
    prompt = _prompts(1, seed=2, lengths=(45, 45), vocab_size=loaded.model.config.vocab_size)[0]
    first = engine_runner(engine, [prompt], GREEDY)[0]
    second = engine_runner(engine, [prompt], GREEDY)[0]
    # Prefill stopped at the prompt's last page boundary (40) to leave a snapshot there.
    assert first.usage.cached_tokens == 0 and second.usage.cached_tokens == 40
    assert second.token_ids == first.token_ids == cold([prompt])[0].token_ids
    engine.check_integrity()


def test_hit_past_the_deepest_snapshot_resumes_from_it(loaded, engine_factory, engine_runner, cold):
    """Pages cached deeper than the last surviving snapshot (a tombstone) are not a valid hit: the
    request resumes from the snapshot and recomputes the rest."""
    engine = engine_factory(loaded, page_size=PAGE)
    cache = engine.prefix_cache
    prompt = _prompts(1, seed=3, lengths=(45, 45), vocab_size=loaded.model.config.vocab_size)[0]
    # 45 prompt tokens + 19 outputs computed = 64: the finished request donates its state at 64.
    twenty = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    first = engine_runner(engine, [prompt], twenty)[0]
    follow_up = prompt + first.token_ids + [5, 6, 7]
    assert cache.match_prefix(follow_up[:-1]).num_tokens == 64
    # Evict the snapshot at 64 only: lock the node at 40 so its own snapshot is spared.
    shallow = cache.match_prefix(prompt[:40])
    cache.lock(shallow.node)
    assert cache.evict_snapshots(1) == 1
    cache.unlock(shallow.node)
    assert cache.match_prefix(follow_up[:-1]).num_tokens == 40  # the node at 64 is a tombstone now
    assert cache.cached_pages >= 64 // PAGE  # its pages are still cached
    resumed = engine_runner(engine, [follow_up], GREEDY)[0]
    assert resumed.usage.cached_tokens == 40
    assert resumed.token_ids == cold([follow_up])[0].token_ids
    engine.check_integrity()


def test_pool_and_slot_pressure(loaded, engine_factory, engine_runner, cold, outputs_agree):
    prompts = _prompts(16, seed=4, lengths=(1, 40), vocab_size=loaded.model.config.vocab_size)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    engine = engine_factory(
        loaded, page_size=PAGE, kv_cache_tokens=128, max_running_requests=6, state_slots=8
    )
    pressured = engine_runner(engine, prompts, params)
    outputs_agree(loaded.model, prompts, pressured, cold(prompts, params), TIE_GAP)
    engine.check_integrity()
    engine.prefix_cache.evict(engine.pool.num_pages)
    assert engine.pool.num_free == engine.pool.num_pages
    assert engine.state_slots.num_free == engine.state_slots.num_slots
