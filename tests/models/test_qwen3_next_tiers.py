"""Host and disk tiers with a hybrid model: a hit is valid only with the state snapshot at its end, the
restore brings both back, and every hit equals a cold run (design §3).

Prompt P of 45 tokens, page 8, chunk 16, 12 greedy tokens: prefill leaves snapshots at 16, 32 and 40 (the
prompt's last page boundary), the finished request one at 56 (45 + 11 computed). The follow-up F = P +
output + 5 tokens (62) can reuse up to 56 tokens.
"""

from __future__ import annotations

import random

import pytest
import torch

from morion.cache.disk_format import BLOCK, KIND_PAGE, KIND_SNAPSHOT, object_path
from morion.cache.disk_store import LOW_WATERMARK
from morion.cache.page_keys import page_keys
from morion.cache.testing import InFlightCopyEngine, flood
from morion.engine.sampling_params import SamplingParams
from morion.loader import load_model

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PAGE = 8
CHUNK = 16
HOST_GB = 2 / 1024  # 2 MiB: a quarter for snapshots (about 11 of 45 KiB), the rest for 4 KiB pages


@pytest.fixture(scope="module")
def loaded(qwen3_next_checkpoint):
    directory, _ = qwen3_next_checkpoint("odd")
    return load_model(str(directory), torch.float32, torch.device("cpu"))


@pytest.fixture(scope="module")
def conversation(loaded):
    rng = random.Random(0)
    return [rng.randrange(loaded.model.config.vocab_size) for _ in range(45)]


@pytest.fixture(scope="module")
def cold(loaded, engine_factory, engine_runner):
    engine = engine_factory(loaded, page_size=PAGE, enable_prefix_cache=False)
    done: dict[tuple[int, ...], list[int]] = {}

    def run(prompt: list[int]) -> list[int]:
        if tuple(prompt) not in done:
            done[tuple(prompt)] = engine_runner(engine, [prompt], GREEDY)[0].token_ids
        return done[tuple(prompt)]

    return run


@pytest.fixture
def tiered(loaded, engine_factory, tmp_path):
    engines = []

    def make(disk: bool = True, **options):
        options = {"page_size": PAGE, "chunk_size": CHUNK, "host_cache_gb": HOST_GB, **options}
        if disk:
            options = {"disk_cache_dir": str(tmp_path / "disk"), "disk_cache_gb": 1.0, **options}
        engine = engine_factory(loaded, **options)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()


def _follow_up(conversation, cold):
    return conversation + cold(conversation) + [5, 6, 7, 8, 9]


def _evict_device(engine) -> None:
    engine.prefix_cache.evict(engine.pool.num_pages)
    assert engine.prefix_cache.cached_pages == 0 and engine.prefix_cache.cached_snapshots == 0


def test_host_hit_needs_the_snapshot_at_its_end(tiered, engine_runner, conversation, cold):
    engine = tiered(disk=False)
    assert engine_runner(engine, [conversation], GREEDY)[0].token_ids == cold(conversation)
    follow_up = _follow_up(conversation, cold)
    _evict_device(engine)
    resumed = engine_runner(engine, [follow_up], GREEDY)[0]
    # Pages from several prefill chunks and the generation, and the state after token 56.
    assert resumed.usage.cached_tokens == 56 and resumed.token_ids == cold(follow_up)
    stats = engine.cache_stats
    assert stats.host_hit_tokens == 56 and stats.restored_snapshots == 1

    # Without the snapshot at 56 the pages up to 56 are no hit: it resumes from the one at 40.
    _evict_device(engine)
    engine.tiers.snapshots.drop(page_keys(follow_up, PAGE)[56 // PAGE - 1])
    fallback = engine_runner(engine, [follow_up], GREEDY)[0]
    assert fallback.usage.cached_tokens == 40 and fallback.token_ids == cold(follow_up)
    engine.check_integrity()


def test_disk_hit_after_restart_and_a_corrupted_snapshot(tiered, engine_runner, conversation, cold):
    follow_up = _follow_up(conversation, cold)
    first = tiered()
    engine_runner(first, [conversation], GREEDY)
    first.close()

    restarted = tiered()
    resumed = engine_runner(restarted, [follow_up], GREEDY)[0]
    assert resumed.usage.cached_tokens == 56 and resumed.token_ids == cold(follow_up)
    stats = restarted.cache_stats
    assert stats.disk_hit_tokens == 56 and stats.restored_snapshots == 1
    restarted.close()

    # A damaged snapshot at 56: a counted miss, and the hit falls back to the snapshot at 40.
    snapshot = object_path(
        restarted.tiers.disk.dir, KIND_SNAPSHOT, page_keys(follow_up, PAGE)[56 // PAGE - 1]
    )
    data = bytearray(snapshot.read_bytes())
    data[BLOCK + 1000] ^= 0x01
    snapshot.write_bytes(bytes(data))
    again = tiered()
    fallback = engine_runner(again, [follow_up], GREEDY)[0]
    assert fallback.usage.cached_tokens == 40 and fallback.token_ids == cold(follow_up)
    assert again.cache_stats.checksum_failures == 1
    again.check_integrity()


def test_a_smaller_disk_budget_at_restart_trims_conversations_from_their_end(
    tiered, engine_runner, conversation, cold
):
    follow_up = _follow_up(conversation, cold)
    first = tiered()
    engine_runner(first, [conversation], GREEDY)
    first.close()
    keys = page_keys(follow_up, PAGE)
    disk = first.tiers.disk.dir

    def size(kind: int, page: int) -> int:
        return object_path(disk, kind, keys[page]).stat().st_size

    # On disk: pages 0-6 and the snapshots at 16, 32, 40 and 56 tokens (pages 1, 3, 4, 6). A budget whose
    # low watermark holds all but the pages after 40 and the snapshot at 56 (half of page 5 to spare).
    total = sum(f.stat().st_size for f in disk.glob("objects/*/*") if f.is_file())
    tail = size(KIND_SNAPSHOT, 6) + size(KIND_PAGE, 6) + size(KIND_PAGE, 5)
    budget = (total - tail + size(KIND_PAGE, 5) // 2) / LOW_WATERMARK
    restarted = tiered(disk_cache_gb=budget / 2**30)
    assert restarted.cache_stats.disk_evictions == 3
    resumed = engine_runner(restarted, [follow_up], GREEDY)[0]
    # What the trim left is a prefix ending at a snapshot: still a disk hit, as deep as that snapshot.
    assert resumed.usage.cached_tokens == 40 and resumed.token_ids == cold(follow_up)
    assert restarted.cache_stats.disk_hit_tokens == 40
    restarted.check_integrity()


def test_host_eviction_during_an_in_flight_restore(tiered, engine_runner, conversation, cold):
    """Copy rules 1 and 4 for pages and state: host pressure while the restore is in flight cannot touch
    its source rows, and a second request that copies the restored snapshot in the same step (a device
    hit on the node the first one just inserted) copies it only after the restore."""
    engine = tiered(disk=False)
    tiers = engine.tiers
    floods = []
    tiers.copy_engine = InFlightCopyEngine(
        lambda: floods.append((flood(tiers.host, b"junk"), flood(tiers.snapshots, b"junk")))
    )
    engine_runner(engine, [conversation], GREEDY)
    follow_up = _follow_up(conversation, cold)
    _evict_device(engine)
    outputs = engine_runner(engine, [follow_up, follow_up], GREEDY)
    assert floods and all(count > 0 for count in floods[0])
    assert [o.usage.cached_tokens for o in outputs] == [56, 56]
    assert [o.token_ids for o in outputs] == [cold(follow_up)] * 2
    assert engine.cache_stats.host_hit_tokens == 56 and engine.cache_stats.device_hit_tokens == 56
    engine.check_integrity()
