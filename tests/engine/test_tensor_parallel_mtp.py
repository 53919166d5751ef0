"""MTP speculation on a tensor-parallel engine (issue #28) on the CPU: the tiny Qwen3-Next's MTP head drafts
at TP=2 (rank 0 here, rank 1 a process of its own, gloo between them) as at TP=1, through a batch, a device
prefix hit and a host-tier restore: the same tokens, drafts and accepted counts, and (within fp32
tolerance) the same logprobs. Forced acceptance (the same seeded draws at both sizes) accepts drafts
although random weights' head seldom agrees with the target, so accepted drafts are committed and the
follower's own drafts must equal rank 0's: its K/V at those positions come from them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from morion.config import EngineConfig
from morion.engine.engine import Engine
from morion.engine.sampling_params import SamplingParams
from morion.errors import MorionError
from morion.spec.forced import ForcedAcceptance
from morion.spec.speculative import SpecStats
from tests.engine.test_tensor_parallel import GREEDY, LOGPROB_TOLERANCE, PROMPTS, SHARED, _run

WIDTH = 3
WITH_LOGPROBS = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2, prompt_logprobs=2)
LONGER = SamplingParams(max_tokens=10, temperature=0.0)


def _engine(model_dir, size: int) -> Engine:
    config = EngineConfig(
        model=str(model_dir),
        load_format="dummy",
        device="cpu",
        kv_cache_tokens=2048,
        host_cache_gb=0.02,
        speculative="mtp",
        spec_width=WIDTH,
        tensor_parallel_size=size,
    )
    return Engine(config, forced_acceptance=ForcedAcceptance(0.7, seed=3))


def _scenario(engine: Engine) -> tuple[list[list], SpecStats]:
    """A batch (one request with logprobs; one never given room for the next step's drafts right after
    its verify, so it keeps the verify's hidden states and drafts on demand), a prefix hit on the
    device, then the same prompt again from the host tier once the device cache is evicted."""
    reserve = engine.scheduler.reserve_for_verify
    refused = []

    def no_room_after_verify_for_one_request(request, num_tokens: int, num_draft_slots: int) -> bool:
        granted = reserve(request, num_tokens, num_draft_slots)
        if num_tokens == 2 * (1 + WIDTH) and request.prompt_token_ids == PROMPTS[1]:
            refused.append(request.request_id)
            return False
        return granted

    engine.scheduler.reserve_for_verify = no_room_after_verify_for_one_request
    batch = _run(engine, [(PROMPTS[0], WITH_LOGPROBS), (PROMPTS[1], LONGER), (PROMPTS[2], GREEDY)])
    assert refused
    device_hit = _run(engine, [(SHARED, LONGER)])
    assert engine.evict_device_cache() > 0
    host_hit = _run(engine, [(PROMPTS[2], LONGER)])
    engine.check_integrity()
    return [batch, device_hit, host_hit], engine.speculative.stats


@pytest.fixture(scope="module")
def one_rank(tiny_qwen3_next_config_dir) -> tuple[list[list], SpecStats]:
    engine = _engine(tiny_qwen3_next_config_dir, 1)
    try:
        return _scenario(engine)
    finally:
        engine.close()


@pytest.fixture(scope="module")
def two_ranks(tiny_qwen3_next_config_dir) -> Iterator[Engine]:
    engine = _engine(tiny_qwen3_next_config_dir, 2)
    yield engine
    engine.close()


def test_two_ranks_draft_with_the_mtp_head_as_one(one_rank, two_ranks):
    check_as_one_rank(two_ranks, one_rank)


def check_as_one_rank(two_ranks: Engine, one_rank: tuple[list[list], SpecStats], rank_slack: int = 0) -> None:
    """`_scenario` on the TP=2 engine gives what it gave on one rank (`one_rank`); a prompt token's rank
    in the vocabulary within `rank_slack` (logits of other tokens within fp32 reordering error of its own
    may swap places with it)."""
    ([batch, device_hit, host_hit], stats) = _scenario(two_ranks)
    ([one_batch, one_device_hit, one_host_hit], one_stats) = one_rank
    assert len(two_ranks.follower_pids) == 1
    one_rank_outputs = one_batch + one_device_hit + one_host_hit
    for tp2, tp1 in zip(batch + device_hit + host_hit, one_rank_outputs, strict=True):
        assert tp2.token_ids == tp1.token_ids
        assert tp2.usage == tp1.usage
    assert device_hit[0].usage.cached_tokens == 64  # the shared pages (the head's K/V too), from the device
    assert host_hit[0].usage.cached_tokens == 64  # restored from the host tier, each rank its shard
    assert two_ranks.cache_stats.restores >= 1
    assert stats.accepted_tokens > 0 and stats.verify_steps > 0
    assert stats.drafted_tokens == one_stats.drafted_tokens
    assert stats.accepted_tokens == one_stats.accepted_tokens
    assert two_ranks.speculative.drafter.name == "mtp"
    [tp2, tp1] = [batch[0], one_batch[0]]
    for got, want in zip(tp2.logprobs, tp1.logprobs, strict=True):
        assert abs(got - want) < LOGPROB_TOLERANCE
    for got, want in zip(tp2.prompt_logprobs[1:], tp1.prompt_logprobs[1:], strict=True):
        assert abs(got.logprob - want.logprob) < LOGPROB_TOLERANCE
        assert abs(got.rank - want.rank) <= rank_slack and [t for t, _ in got.top] == [t for t, _ in want.top]


def test_a_token_map_is_refused_at_two_ranks(tiny_qwen3_next_config_dir, tmp_path):
    with pytest.raises(MorionError, match="spec_token_map is not supported with tensor_parallel_size > 1"):
        EngineConfig(
            model=str(tiny_qwen3_next_config_dir),
            speculative="mtp",
            spec_token_map=str(tmp_path / "map.npy"),
            tensor_parallel_size=2,
        )
