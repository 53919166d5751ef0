"""Host and disk cache tiers on a tiny dense model (CPU): every hit equals a cold run, faults are misses.

Prompt of 45 tokens, page 8, 8 greedy tokens: a finished request leaves 52 computed tokens, 6 full pages,
in the radix tree and (write-through) in host memory and on disk. A repeat of the prompt can reuse at most
40 tokens (page aligned, one prompt token must run).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import os
import random
import signal
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path

import pytest
import torch

from morion.cache.copy_engine import CompletedTransfer, SyncCopyEngine, Transfer
from morion.cache.disk_format import BLOCK, KIND_PAGE, object_path, verify_object_file
from morion.cache.host_store import HostObjectStore
from morion.cache.page_keys import chain_root, page_keys
from morion.cache.testing import InFlightCopyEngine, flood
from morion.engine.sampling_params import SamplingParams
from morion.layers.moe import StackedExperts
from morion.loader import load_model

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PAGE = 8
PAGE_OBJECT_BYTES = 4096  # 2 layers x 8 tokens x (K, V) x 2 heads x 16 dims x fp32
HOST_GB = 64 * PAGE_OBJECT_BYTES / 2**30


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    return tiny_llama


def _prompt(seed: int, length: int = 45) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(128) for _ in range(length)]


@pytest.fixture(scope="module")
def cold(tiny, engine_factory, engine_runner):
    """`cold(prompt)`: the greedy tokens of a run without any cache (computed once per prompt)."""
    engine = engine_factory(tiny, page_size=PAGE, enable_prefix_cache=False)
    done: dict[tuple[int, ...], list[int]] = {}

    def run(prompt: list[int]) -> list[int]:
        if tuple(prompt) not in done:
            done[tuple(prompt)] = engine_runner(engine, [prompt], GREEDY)[0].token_ids
        return done[tuple(prompt)]

    return run


@pytest.fixture
def tiered(tiny, engine_factory, tmp_path):
    """`tiered(model=None, **options)`: an engine (of `tiny` unless another model is given) with a host tier
    and a disk tier in tmp_path (closed at the end)."""
    engines = []

    def make(model=None, **options):
        options = {"page_size": PAGE, "host_cache_gb": HOST_GB, **options}
        if options.get("disk_cache_dir", "") is not None:
            options.setdefault("disk_cache_dir", str(tmp_path / "disk"))
            options.setdefault("disk_cache_gb", 1.0)
        engine = engine_factory(model or tiny, **options)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()


def _run(engine, engine_runner, prompt):
    return engine_runner(engine, [prompt], GREEDY)[0]


def _evict_device(engine) -> None:
    engine.prefix_cache.evict(engine.pool.num_pages)
    assert engine.prefix_cache.cached_pages == 0


def test_device_host_and_disk_hits_equal_cold(tiered, engine_runner, cold):
    prompt = _prompt(0)
    expected = cold(prompt)
    engine = tiered()
    first = _run(engine, engine_runner, prompt)
    assert first.usage.cached_tokens == 0 and first.token_ids == expected
    device = _run(engine, engine_runner, prompt)
    assert device.usage.cached_tokens == 40 and device.token_ids == expected
    _evict_device(engine)
    host = _run(engine, engine_runner, prompt)
    assert host.usage.cached_tokens == 40 and host.token_ids == expected
    stats = engine.cache_stats
    assert (stats.device_hit_tokens, stats.host_hit_tokens, stats.disk_hit_tokens) == (40, 40, 0)
    assert stats.restores == 1 and stats.restored_tokens == 40
    assert stats.bytes_host_to_device == 5 * PAGE_OBJECT_BYTES
    assert stats.backed_up_pages == 6 and stats.bytes_device_to_host == 6 * PAGE_OBJECT_BYTES
    engine.check_integrity()
    engine.close()
    assert engine.cache_stats.disk_objects_written == 6

    # A restart: a new engine on the same directory finds the conversation on disk.
    restarted = tiered()
    assert restarted.cache_stats.disk_objects == 6
    disk = _run(restarted, engine_runner, prompt)
    assert disk.usage.cached_tokens == 40 and disk.token_ids == expected
    stats = restarted.cache_stats
    assert (stats.device_hit_tokens, stats.host_hit_tokens, stats.disk_hit_tokens) == (0, 0, 40)
    assert stats.disk_objects_read == 5 and stats.checksum_failures == 0
    assert stats.restore_seconds_total > 0
    restarted.check_integrity()


def test_a_conversation_s_next_turn_hashes_only_its_new_pages(tiered, engine_runner, monkeypatch):
    """The prefix cache hands a turn the keys of the pages it matched (they were the last turn's): the turn
    hashes only the pages after them, and every page it backs up is under its true content key."""
    from morion.engine import scheduler

    engine = tiered(disk_cache_dir=None)
    prompt = _prompt(3)
    first = _run(engine, engine_runner, prompt)
    turn = prompt + first.token_ids + _prompt(4, length=30)
    hashed_from = []
    hash_pages = scheduler.extend_page_keys

    def counting(keys, *args, **kwargs):
        hashed_from.append(len(keys))
        return hash_pages(keys, *args, **kwargs)

    monkeypatch.setattr(scheduler, "extend_page_keys", counting)
    answer = _run(engine, engine_runner, turn)
    assert answer.usage.cached_tokens == 48  # 45 + 8 computed tokens: 6 whole pages
    assert min(hashed_from) == 6  # never from page 0
    assert set(engine.tiers.host) == set(page_keys(turn + answer.token_ids[:-1], PAGE))
    engine.check_integrity()


def _record_calls(monkeypatch, calls: list[str], *targets: tuple[object, str]) -> None:
    """Appends each target method's name to `calls` when it is called (then calls it)."""
    for obj, name in targets:
        method = getattr(obj, name)
        monkeypatch.setattr(obj, name, lambda *a, _m=method, _n=name, **k: calls.append(_n) or _m(*a, **k))


def test_tier_jobs_retire_once_a_step_behind_its_forward_launch(tiered, engine_runner, cold, monkeypatch):
    """A step retires the tiers' finished copies and disk jobs once, right after its first forward is
    launched (the device computes meanwhile) and before that forward's backups; first of all only while a
    disk read is in flight, whose result may admit a waiting request. Answers are unchanged."""
    engine = tiered()
    calls: list[str] = []
    targets = ((engine.tiers, "poll"), (engine.runner, "forward"), (engine.scheduler, "after_forward"))
    _record_calls(monkeypatch, calls, *targets)
    prompt = _prompt(21)
    engine.add_request(prompt, GREEDY)
    steps = []
    while engine.has_unfinished():
        calls.clear()
        engine.step()
        steps.append(list(calls))
    assert len(steps) > 2 and all(step[:3] == ["forward", "poll", "after_forward"] for step in steps)
    assert all(step.count("poll") == 1 for step in steps)

    # A disk read in flight: retired before the scheduling, still once.
    monkeypatch.setattr(engine.tiers, "loads_in_flight", lambda: True)
    calls.clear()
    engine.add_request(_prompt(22), GREEDY)
    engine.step()
    assert calls[:2] == ["poll", "forward"] and calls.count("poll") == 1
    monkeypatch.undo()
    while engine.has_unfinished():
        engine.step()

    # A step with nothing to run retires them too.
    _record_calls(monkeypatch, calls, (engine.tiers, "poll"))
    calls.clear()
    engine.step()
    assert calls == ["poll"]
    assert _run(engine, engine_runner, prompt).token_ids == cold(prompt)
    engine.check_integrity()


def test_hit_across_chunk_boundaries(tiered, engine_runner, cold):
    """Pages cached by several prefill chunks (16 tokens each) and a generation come back as one hit, into
    an engine with another chunk size."""
    prompt = _prompt(1, 70)
    engine = tiered(chunk_size=16, disk_cache_dir=None)
    first = _run(engine, engine_runner, prompt)
    assert first.token_ids == cold(prompt)
    _evict_device(engine)
    follow_up = prompt + first.token_ids + [3, 1, 4, 1, 5]
    resumed = _run(engine, engine_runner, follow_up)
    assert resumed.usage.cached_tokens == 72  # 70 + 7 computed tokens: 9 full pages
    assert resumed.token_ids == cold(follow_up)
    assert engine.cache_stats.host_hit_tokens == 72


def test_two_requests_share_a_restore_in_one_step(tiered, engine_runner, cold):
    """The second sees the first's restored pages as a device hit in the same step, and reads them only
    after the restore (here kept in flight until the forward waits on it)."""
    prompt = _prompt(2)
    engine = tiered(disk_cache_dir=None)
    engine.tiers.copy_engine = InFlightCopyEngine()
    _run(engine, engine_runner, prompt)
    _evict_device(engine)
    outputs = engine_runner(engine, [prompt, prompt], GREEDY)
    assert [o.usage.cached_tokens for o in outputs] == [40, 40]
    assert [o.token_ids for o in outputs] == [cold(prompt)] * 2
    assert engine.tiers.copy_engine.restores_in_flight_seen == 1
    engine.check_integrity()


def _device_pages(engine, prompt):
    match = engine.prefix_cache.match_prefix(prompt[:-1])
    slots = engine.pool.token_slots(match.pages, match.num_tokens)
    return engine.pool.storage("kv")[:, slots].clone()


def test_host_eviction_during_an_in_flight_load_back(tiered, engine_runner, cold, monkeypatch):
    """Copy rule 1: while a restore is in flight, host pressure evicts and overwrites every row it can.
    The restore's source rows are pinned, so the answer is still the cold one. With pins switched off
    the same pressure corrupts the restored pages: the test can see the bug it guards against."""
    prompt = _prompt(3)
    engine = tiered(disk_cache_dir=None)
    host = engine.tiers.host
    overwritten = []
    engine.tiers.copy_engine = InFlightCopyEngine(lambda: overwritten.append(flood(host, b"junk")))
    _run(engine, engine_runner, prompt)
    original = _device_pages(engine, prompt)
    _evict_device(engine)
    restored = _run(engine, engine_runner, prompt)
    assert overwritten and overwritten[0] > 0 and engine.cache_stats.host_evictions > 0
    assert restored.usage.cached_tokens == 40 and restored.token_ids == cold(prompt)
    assert torch.equal(_device_pages(engine, prompt), original)

    # The control: the same run with pins that do nothing.
    broken = tiered(disk_cache_dir=None)
    broken.tiers.copy_engine = InFlightCopyEngine(lambda: flood(broken.tiers.host, b"junk"))
    _run(broken, engine_runner, prompt)
    _evict_device(broken)
    monkeypatch.setattr(HostObjectStore, "pin", lambda self, key: self.get(key))
    monkeypatch.setattr(HostObjectStore, "unpin", lambda self, key: None)
    _run(broken, engine_runner, prompt)
    assert not torch.equal(_device_pages(broken, prompt), original)


def _salted(salt: str | None) -> SamplingParams:
    return dataclasses.replace(GREEDY, cache_salt=salt)


def test_cache_salts_separate_every_tier(tiered, engine_runner, cold):
    """A salted request shares pages only with its own salt: on the device, in host memory (write-back
    keys an evicted node by its salt's chain too) and on disk after a restart."""
    prompt, salt = _prompt(7), "tenant-a"
    expected = cold(prompt)
    engine = tiered(host_cache_write_policy="write_back")

    def cached(salt_of_run: str | None) -> int:
        output = engine_runner(engine, [prompt], _salted(salt_of_run))[0]
        assert output.token_ids == expected
        return output.usage.cached_tokens

    assert [cached(None), cached(salt), cached("tenant-b"), cached(salt), cached(None)] == [0, 0, 0, 40, 40]
    _evict_device(engine)  # write-back: each chain goes to the host under its own keys
    assert [cached(salt), cached("tenant-c")] == [40, 0]
    assert engine.cache_stats.host_hit_tokens == 40
    engine.close()
    salted_key = page_keys(prompt, PAGE, chain_root(salt))[0]
    assert object_path(engine.tiers.disk.dir, KIND_PAGE, salted_key).exists()

    restarted = tiered()
    output = engine_runner(restarted, [prompt], _salted(salt))[0]
    assert output.usage.cached_tokens == 40 and output.token_ids == expected
    assert restarted.cache_stats.disk_hit_tokens == 40
    assert engine_runner(restarted, [prompt], _salted("tenant-d"))[0].usage.cached_tokens == 0
    restarted.check_integrity()


def test_write_back_copies_to_host_only_on_device_eviction(tiered, engine_runner, cold):
    prompt = _prompt(4)
    engine = tiered(host_cache_write_policy="write_back", disk_cache_dir=None)
    _run(engine, engine_runner, prompt)
    assert engine.cache_stats.backed_up_pages == 0
    _evict_device(engine)
    assert engine.cache_stats.backed_up_pages == 6
    again = _run(engine, engine_runner, prompt)
    assert again.usage.cached_tokens == 40 and again.token_ids == cold(prompt)


def test_host_budget_evicts_least_recently_used(tiered, engine_runner, cold):
    engine = tiered(host_cache_gb=10 * PAGE_OBJECT_BYTES / 2**30, disk_cache_dir=None)
    assert engine.tiers.host.num_rows == 10
    prompts = [_prompt(10 + i) for i in range(3)]
    for prompt in prompts:
        assert _run(engine, engine_runner, prompt).token_ids == cold(prompt)
    assert engine.cache_stats.host_evictions == 3 * 6 - 10
    _evict_device(engine)
    latest = _run(engine, engine_runner, prompts[-1])
    assert latest.usage.cached_tokens == 40 and latest.token_ids == cold(prompts[-1])
    oldest = _run(engine, engine_runner, prompts[0])
    assert oldest.usage.cached_tokens == 0 and oldest.token_ids == cold(prompts[0])
    engine.check_integrity()


class _StagedTransfer(CompletedTransfer):
    """A finished backup that holds a staging buffer until it is dropped, as a CUDA one holds its device
    staging."""

    def __init__(self, staging: torch.Tensor) -> None:
        self.staging = staging


class _StagingCopyEngine(SyncCopyEngine):
    """Backups as `_StagedTransfer`s; `staging` holds weak references to their buffers."""

    def __init__(self) -> None:
        self.staging: list[weakref.ref] = []

    def backup(self, *args, **kwargs) -> Transfer:
        super().backup(*args, **kwargs)
        buffer = torch.empty(1024)
        self.staging.append(weakref.ref(buffer))
        return _StagedTransfer(buffer)


def test_a_queued_disk_write_holds_none_of_its_backups_buffers(tiered, engine_runner):
    """A disk write waits for its backup's copy, and may queue behind others for a long while: what it
    keeps must not be the transfer (a CUDA backup's device staging, ~115 MiB per Flash-Next snapshot,
    would stay allocated until the write begins: on the H200 a burst of prompts ran out of memory)."""
    engine = tiered()
    engine.tiers.copy_engine = _StagingCopyEngine()
    queued = []  # the writes' waiters, held as a writer's queue holds them

    def queue_write(kind, key, payload, before) -> bool:
        queued.append(before)
        return False  # not written after all: the tier unpins the row

    engine.tiers.disk.submit_write = queue_write
    _run(engine, engine_runner, _prompt(21))
    assert queued and engine.tiers.copy_engine.staging, "no backup went to disk: nothing to check"
    gc.collect()
    assert all(ref() is None for ref in engine.tiers.copy_engine.staging)


def test_disk_budget_evicts_without_errors(tiered, engine_runner, cold):
    object_file = BLOCK + PAGE_OBJECT_BYTES
    engine = tiered(disk_cache_gb=10 * object_file / 2**30)
    for seed in range(20, 23):
        prompt = _prompt(seed)
        assert _run(engine, engine_runner, prompt).token_ids == cold(prompt)
        while engine.tiers.disk.busy():  # written before the next conversation: a full budget evicts
            engine.tiers.poll(0.05)
    engine.close()
    stats = engine.cache_stats
    assert stats.disk_evictions > 0 and stats.disk_write_errors == 0
    assert 0 < stats.disk_bytes_used <= stats.disk_bytes_budget


def _page_file(engine, prompt, index):
    key = page_keys(prompt, PAGE)[index]
    return object_path(engine.tiers.disk.dir, KIND_PAGE, key)


def test_corrupted_object_is_a_counted_miss(tiered, engine_runner, cold, caplog):
    prompt = _prompt(5)
    engine = tiered()
    _run(engine, engine_runner, prompt)
    engine.close()
    bad = _page_file(engine, prompt, 3)
    data = bytearray(bad.read_bytes())
    data[BLOCK + 10] ^= 0xFF  # one bit pattern inside the payload
    bad.write_bytes(bytes(data))
    restarted = tiered()
    with caplog.at_level(logging.WARNING, logger="morion.cache"):
        output = _run(restarted, engine_runner, prompt)
    assert output.token_ids == cold(prompt)
    assert output.usage.cached_tokens == 3 * PAGE  # the pages before the bad one
    assert restarted.cache_stats.checksum_failures == 1
    assert "checksum mismatch" in caplog.text
    # The bad file was removed, and this run's write-through (it computed the page again) replaced it.
    restarted.close()
    assert verify_object_file(bad, restarted.tiers.disk.namespace, PAGE_OBJECT_BYTES) is None
    restarted.check_integrity()


_KILLED_WRITER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    import numpy as np
    from morion.cache import disk_format

    def hang(src, dst):  # killed after the data is written, before the rename makes it visible
        print("written", flush=True)
        time.sleep(600)

    disk_format.os.replace = hang
    path, key, namespace = Path(sys.argv[1]), bytes.fromhex(sys.argv[2]), sys.argv[3]
    payload = np.full(int(sys.argv[4]), 0x7F, dtype=np.uint8)  # garbage that would be a wrong answer
    disk_format.write_object(path, disk_format.KIND_PAGE, key, namespace, payload, direct=False)
    """
)


def test_partial_files_of_a_killed_writer_are_ignored(tiered, engine_runner, cold):
    prompt = _prompt(6)
    engine = tiered()
    _run(engine, engine_runner, prompt)
    engine.close()
    disk = engine.tiers.disk
    target = _page_file(engine, prompt, 3)
    target.unlink()  # as if its write had never finished
    writer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _KILLED_WRITER,
            str(target),
            target.stem,
            disk.namespace,
            str(PAGE_OBJECT_BYTES),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert writer.stdout.readline().strip() == "written"
    os.kill(writer.pid, signal.SIGKILL)
    writer.wait()
    # And a truncated temp file of the same dead writer for another page.
    other = _page_file(engine, prompt, 4)
    (other.parent / f".{other.name}.{writer.pid}.0.tmp").write_bytes(other.read_bytes()[:1000])
    temps = sorted(disk.dir.glob("objects/*/.*.tmp"))
    assert len(temps) == 2 and not target.exists()

    restarted = tiered()
    assert restarted.tiers.disk.removed_temp_files == 2
    assert not list(disk.dir.glob("objects/*/.*.tmp"))
    output = _run(restarted, engine_runner, prompt)
    assert output.usage.cached_tokens == 3 * PAGE and output.token_ids == cold(prompt)


def test_manifest_of_another_model_skips_the_tier(tiny, tiered, engine_runner, cold, caplog):
    prompt = _prompt(7)
    engine = tiered()
    _run(engine, engine_runner, prompt)
    engine.close()
    manifest_path = engine.tiers.disk.dir / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["identity"]["model"]["dtype"] = "bfloat16"
    manifest_path.write_text(json.dumps(manifest))
    with caplog.at_level(logging.WARNING, logger="morion.cache"):
        restarted = tiered()
    stats = restarted.cache_stats
    assert not stats.disk_enabled and "another model" in stats.disk_skip_reason
    assert "disk cache tier NOT used" in caplog.text
    output = _run(restarted, engine_runner, prompt)
    assert output.usage.cached_tokens == 0 and output.token_ids == cold(prompt)


def test_other_weights_get_their_own_namespace(tiny, tiered, engine_runner):
    prompt = _prompt(8)
    engine = tiered()
    _run(engine, engine_runner, prompt)
    engine.close()
    other_weights = load_model(str(tiny.path), torch.float32, torch.device("cpu"))
    with torch.no_grad():
        other_weights.model.model.norm.weight.mul_(1.5)
    other = tiered(other_weights)
    assert other.tiers.disk.enabled and other.tiers.disk.dir != engine.tiers.disk.dir
    assert _run(other, engine_runner, prompt).usage.cached_tokens == 0


def test_another_expert_kernel_gets_its_own_namespace(tiny_qwen3_next, tiered, monkeypatch):
    """`--moe-kernel` other than auto, and under auto a device's tuned grouped mode for prefill
    (`StackedExperts.prefill_identity`), compute a prompt's K/V and states in other bits: the disk tier
    keeps each in a namespace of its own, so a conversation cached under one is never restored under
    another."""

    def namespace(**options) -> tuple[Path, dict]:
        disk = tiered(tiny_qwen3_next, **options).tiers.disk
        assert disk.enabled
        return disk.dir, json.loads((disk.dir / "manifest.json").read_text())["identity"]["model"]

    default_dir, default = namespace()
    assert "moe_kernel" not in default and "moe_prefill" not in default
    triton_dir, triton = namespace(moe_kernel="triton")
    assert triton["moe_kernel"] == "triton" and triton_dir != default_dir
    monkeypatch.setattr(StackedExperts, "prefill_identity", lambda self: "triton-grouped block_m=32")
    tuned_dir, tuned = namespace()
    assert tuned["moe_prefill"] == ["triton-grouped block_m=32"]
    assert tuned_dir not in (default_dir, triton_dir)
