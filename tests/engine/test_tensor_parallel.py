"""A tensor-parallel engine (issue #28) on the CPU: rank 0 in this process, one follower rank in a process of
its own, gloo between them. The same requests on the tiny Qwen3-Next at TP=2 and at TP=1 give the same
greedy tokens, cached tokens and (within fp32 tolerance) prompt logprobs, through a batch, a device prefix
hit and a host-tier restore, with n-gram speculation; after a restart each rank restores its shard from its
own disk namespace, which one rank never reads; closing the engine, or killing rank 0, ends the follower."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from morion.cache.disk_format import BLOCK, KIND_SNAPSHOT, object_relative_path
from morion.cache.page_keys import extend_page_keys
from morion.config import EngineConfig
from morion.engine.engine import Engine
from morion.engine.sampling_params import SamplingParams
from morion.errors import MorionError
from tests.conftest import TINY_QWEN3_NEXT

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
WITH_PROMPT_LOGPROBS = SamplingParams(max_tokens=6, temperature=0.0, prompt_logprobs=2)
LOGPROB_TOLERANCE = 1e-4  # fp32: the ranks' partial sums add in another order
# Phrases repeated: n-gram speculation drafts their continuation, so verify forwards run on both ranks.
PROMPTS = [
    ([(7 * i + k) % 500 + 3 for i in range(9)] * 8)[:length] for k, length in ((1, 45), (2, 23), (3, 70))
]
SHARED = [*PROMPTS[2][:64], 11, 12, 13, 14, 15]  # the third prompt up to its tail snapshot, then its own
# Token 3 followed by every token of the vocabulary, then 3 again: whatever the first answer token t is,
# (3, t) is in the prompt, so n-gram speculation drafts from the first decode step on, whatever the
# random weights answer (the repeated phrases above draft only if the answer happens to repeat one).
DRAFTABLE = [*[token for t in range(TINY_QWEN3_NEXT["vocab_size"]) for token in (3, t)], 3]
EXIT_S = 15.0


@pytest.fixture(scope="module")
def tiny_qwen3_next_config_dir(tmp_path_factory) -> Path:
    """The tiny Qwen3-Next (conftest.py's), with positions for DRAFTABLE's 1,025 tokens."""
    directory = tmp_path_factory.mktemp("tiny_qwen3_next_long_config")
    (directory / "config.json").write_text(json.dumps({**TINY_QWEN3_NEXT, "max_position_embeddings": 2048}))
    return directory


def _config(model_dir, size: int, disk: Path | None = None) -> EngineConfig:
    return EngineConfig(
        model=str(model_dir),
        load_format="dummy",
        kv_cache_tokens=2048,
        host_cache_gb=0.02,
        disk_cache_dir=str(disk) if disk else None,
        speculative="ngram",
        tensor_parallel_size=size,
    )


@pytest.fixture(scope="module")
def disk(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tp_disk_cache")


def _run(engine: Engine, requests: list[tuple[list[int], SamplingParams]]) -> dict[str, object]:
    ids = [engine.add_request(prompt, params) for prompt, params in requests]
    finals = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output.final
    return [finals[request_id] for request_id in ids]


def _scenario(engine: Engine) -> list[list]:
    """A batch (one request with prompt logprobs), a prefix hit on the device, then the same prompt again
    from the host tier once the device cache is evicted."""
    batch = _run(
        engine,
        [(PROMPTS[0], WITH_PROMPT_LOGPROBS), (PROMPTS[1], GREEDY), (PROMPTS[2], GREEDY), (DRAFTABLE, GREEDY)],
    )
    device_hit = _run(engine, [(SHARED, GREEDY)])
    assert engine.evict_device_cache() > 0
    host_hit = _run(engine, [(PROMPTS[2], GREEDY)])
    engine.check_integrity()
    return [batch, device_hit, host_hit]


@pytest.fixture(scope="module")
def one_rank(tiny_qwen3_next_config_dir) -> list[list]:
    engine = Engine(_config(tiny_qwen3_next_config_dir, 1))
    try:
        return _scenario(engine)
    finally:
        engine.close()


@pytest.fixture(scope="module")
def two_ranks(tiny_qwen3_next_config_dir, disk) -> Iterator[Engine]:
    engine = Engine(_config(tiny_qwen3_next_config_dir, 2, disk))
    yield engine
    engine.close()


def test_two_ranks_answer_as_one_through_prefix_hits_and_restores(one_rank, two_ranks):
    [batch, device_hit, host_hit] = _scenario(two_ranks)
    [one_batch, one_device_hit, one_host_hit] = one_rank
    assert len(two_ranks.follower_pids) == 1
    one_rank_outputs = one_batch + one_device_hit + one_host_hit
    for tp2, tp1 in zip(batch + device_hit + host_hit, one_rank_outputs, strict=True):
        assert tp2.token_ids == tp1.token_ids
        assert tp2.usage == tp1.usage
    assert device_hit[0].usage.cached_tokens == 64  # the shared pages, from the device
    assert host_hit[0].usage.cached_tokens == 64  # all but the tail, restored from the host tier
    assert host_hit[0].token_ids == batch[2].token_ids  # as cold
    assert two_ranks.cache_stats.restores >= 1
    assert two_ranks.speculative.stats.verify_steps > 0
    for tp2, tp1 in zip(batch[0].prompt_logprobs[1:], one_batch[0].prompt_logprobs[1:], strict=True):
        assert abs(tp2.logprob - tp1.logprob) < LOGPROB_TOLERANCE and tp2.rank == tp1.rank


def test_one_tensor_parallel_engine_a_process(tiny_qwen3_next_config_dir, two_ranks):
    with pytest.raises(MorionError, match="one tensor-parallel engine at a time"):
        Engine(_config(tiny_qwen3_next_config_dir, 2))


def test_closing_the_engine_ends_its_followers(two_ranks):
    [follower] = two_ranks.follower_pids
    assert _alive(follower)
    two_ranks.close()
    assert not _alive(follower)


def test_a_restart_restores_each_rank_s_shard_from_its_disk_namespace(
    tiny_qwen3_next_config_dir, disk, one_rank, two_ranks
):
    """Both conversations are on disk, one rank's namespace each. Rank 1's snapshot of the first prompt is
    corrupt: rank 0's read of it succeeds, rank 1's fails, so the ranks agree on a miss and that prompt is
    computed (as cold); the other is restored from both ranks' objects."""
    two_ranks.close()  # the first run's writes are done
    namespaces = {}
    for manifest in disk.glob("*/manifest.json"):
        layout = json.loads(manifest.read_text())["identity"]["tensor_parallel"]
        namespaces[(layout["rank"], layout["size"])] = manifest.parent
    assert sorted(namespaces) == [(0, 2), (1, 2)]
    [_, snapshot_key] = extend_page_keys([], PROMPTS[0], 16, 2)  # its tail snapshot, after two pages
    snapshot = namespaces[(1, 2)] / object_relative_path(KIND_SNAPSHOT, snapshot_key)
    payload = bytearray(snapshot.read_bytes())
    payload[BLOCK] ^= 0xFF  # the first payload byte: the checksum no longer matches
    snapshot.write_bytes(bytes(payload))
    engine = Engine(_config(tiny_qwen3_next_config_dir, 2, disk))
    try:
        [corrupt, from_disk] = _run(engine, [(PROMPTS[0], GREEDY), (PROMPTS[2], GREEDY)])
        assert engine.cache_stats.checksum_failures == 0  # rank 0's own objects were fine
    finally:
        engine.close()
    assert from_disk.usage.cached_tokens == 64
    assert from_disk.token_ids == one_rank[0][2].token_ids  # as cold
    assert corrupt.usage.cached_tokens == 0
    assert corrupt.token_ids == one_rank[0][0].token_ids


def test_one_rank_never_reads_a_two_rank_disk_cache(tiny_qwen3_next_config_dir, disk, one_rank):
    engine = Engine(_config(tiny_qwen3_next_config_dir, 1, disk))
    try:
        [cold] = _run(engine, [(PROMPTS[2], GREEDY)])
        assert engine.cache_stats.disk_hits == 0
    finally:
        engine.close()
    assert cold.usage.cached_tokens == 0
    assert cold.token_ids == one_rank[0][2].token_ids


_RANK_ZERO = """
import sys, time
from morion.cache.disk_format import BLOCK, KIND_SNAPSHOT, object_relative_path
from morion.cache.page_keys import extend_page_keys
from morion.config import EngineConfig
from morion.engine.engine import Engine
config = EngineConfig(model=sys.argv[1], load_format="dummy", kv_cache_tokens=256, tensor_parallel_size=2)
engine = Engine(config)
print(*engine.follower_pids, flush=True)
time.sleep(600)
"""


def test_a_killed_rank_zero_leaves_no_follower_behind(tiny_qwen3_next_config_dir):
    rank_zero = subprocess.Popen(
        [sys.executable, "-c", _RANK_ZERO, str(tiny_qwen3_next_config_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        follower = int(rank_zero.stdout.readline())
        assert _alive(follower)
    finally:
        os.kill(rank_zero.pid, signal.SIGKILL)
        rank_zero.wait()
    deadline = time.monotonic() + EXIT_S
    while _alive(follower) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(follower)


def test_a_size_that_does_not_divide_the_heads_is_refused_before_any_rank_starts(tiny_qwen3_next_config_dir):
    with pytest.raises(MorionError, match="--tensor-parallel-size 3 does not divide the 4 attention heads"):
        Engine(_config(tiny_qwen3_next_config_dir, 3))


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie (an exited child its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
