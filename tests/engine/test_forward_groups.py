"""A step's chunks split by kind into forwards (engine/forward_groups.py), and the chunking that makes a
prompt's tail a chunk of its own (scheduler.py): what lets a restored request recompute exactly what its
cold run computed, in a forward of the same kind."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from morion.engine import engine as engine_module
from morion.engine.forward_groups import forward_groups
from morion.engine.sampling_params import SamplingParams
from morion.engine.scheduler import ScheduledChunk
from morion.layers.hybrid_backend import SHORT_CHUNK_TOKENS
from morion.ops.paged_attention_triton import MAX_SPLIT_QUERY_LEN

PAGE = 8
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def _chunk(name: str, tokens: int) -> ScheduledChunk:
    return ScheduledChunk(SimpleNamespace(name=name), tokens)


def test_short_chunks_are_those_the_split_kv_attention_takes():
    assert SHORT_CHUNK_TOKENS == MAX_SPLIT_QUERY_LEN


def test_groups_hold_one_kind_each_decode_first_and_capped():
    chunks = [_chunk("long", 40), _chunk("d1", 1), _chunk("tail", 5), _chunk("d2", 1), _chunk("page", 16)]
    chunks += [_chunk(f"d{i}", 1) for i in range(3, 8)]
    groups = forward_groups(chunks, max_tokens=4)
    names = [[c.request.name for c in group] for group in groups]
    assert names == [["d1", "d2", "d3", "d4"], ["d5", "d6", "d7"], ["tail"], ["page"], ["long"]]
    assert forward_groups([], max_tokens=4) == []


def _recorded_groups(monkeypatch) -> list[list[tuple[str, int, int]]]:
    """Every forward of the engine as [(request id, first position, tokens)]."""
    groups: list[list[tuple[str, int, int]]] = []
    real = engine_module.forward_groups

    def recording(chunks, max_tokens):
        result = real(chunks, max_tokens)
        groups.extend(
            [(c.request.request_id, c.request.num_computed, c.num_tokens) for c in group] for group in result
        )
        return result

    monkeypatch.setattr(engine_module, "forward_groups", recording)
    return groups


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen3_next"])
def test_chunks_end_on_pages_and_tails_run_alone(model, request, engine_factory, monkeypatch):
    loaded = request.getfixturevalue(model)
    engine = engine_factory(loaded, page_size=PAGE, chunk_size=20)
    groups = _recorded_groups(monkeypatch)
    rng = random.Random(0)
    lengths = {}
    for length in (5, 8, 23, 40, 41):
        prompt = [rng.randrange(100) for _ in range(length)]
        lengths[engine.add_request(prompt, GREEDY)] = length
        engine.step()  # they arrive while the earlier ones prefill and decode
    while engine.has_unfinished():
        engine.step()
    assert groups
    for group in groups:
        sizes = {tokens for _, _, tokens in group}
        kinds = {1 if n == 1 else "short" if n <= SHORT_CHUNK_TOKENS else "long" for n in sizes}
        assert len(kinds) == 1, f"a forward mixes chunk kinds: {group}"
    for request_id, length in lengths.items():
        prompt_chunks = [(s, n) for g in groups for r, s, n in g if r == request_id and s < length]
        tail = (length - 1) // PAGE * PAGE
        assert prompt_chunks[-1] == (tail, length - tail), f"{length}-token prompt: {prompt_chunks}"
        assert all((s + n) % PAGE == 0 for s, n in prompt_chunks[:-1]), prompt_chunks
    engine.check_integrity()


def test_only_the_tails_snapshot_goes_to_the_host_tier(tiny_qwen3_next, engine_factory, engine_runner):
    """A 75-token prompt in chunks of 32: snapshots at 32, 64 and 72 on the device; on the host only the
    tail's (72) and the request's end (80, after decoding): a whole recurrent state per conversation
    position a returning conversation can use, not one per chunk."""
    engine = engine_factory(tiny_qwen3_next, page_size=PAGE, chunk_size=32, host_cache_gb=8 / 1024)
    prompt = list(range(75))
    engine_runner(engine, [prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    stats = engine.cache_stats
    assert stats.backed_up_snapshots == 2
    assert stats.backed_up_pages == 10  # every full page of the conversation, 80 tokens
    engine.evict_device_cache()
    [again] = engine_runner(engine, [prompt], GREEDY)
    assert again.usage.cached_tokens == 72 and engine.cache_stats.host_hit_tokens == 72
    engine.check_integrity()
