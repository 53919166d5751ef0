"""A tensor-parallel engine on two GPUs (skipped with fewer): NCCL collectives inside the decode, verify and
MTP draft CUDA graphs, captured on both ranks in the same order. The tiny Qwen3-Next (fp32, forced
acceptance with the same seeded draws) gives the same tokens and accepted drafts at TP=2 as at TP=1,
through a batch, a device prefix hit and a host-tier restore, the draft graphs replaying."""

from __future__ import annotations

import pytest
import torch

from morion.config import EngineConfig
from morion.engine.engine import Engine
from morion.spec.forced import ForcedAcceptance
from tests.engine.test_tensor_parallel import GREEDY, PROMPTS, SHARED, _run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]
WIDTH = 3


def _answers(model_dir, size: int) -> tuple[list, int, int]:
    """Every answer, the drafts accepted and the MTP draft graphs' replays (rank 0's)."""
    config = EngineConfig(
        model=str(model_dir),
        load_format="dummy",
        device="cuda",
        dtype="float32",
        kv_cache_tokens=2048,
        host_cache_gb=0.02,
        speculative="mtp",
        spec_width=WIDTH,
        max_running_requests=4,
        tensor_parallel_size=size,
    )
    engine = Engine(config, forced_acceptance=ForcedAcceptance(0.7, seed=3))
    try:
        answers = _run(engine, [(prompt, GREEDY) for prompt in PROMPTS])
        answers += _run(engine, [(SHARED, GREEDY)])
        assert engine.evict_device_cache() > 0
        answers += _run(engine, [(PROMPTS[2], GREEDY)])
        engine.check_integrity()
        replays = engine.speculative.drafter.graphs[WIDTH].replays
        return answers, engine.speculative.stats.accepted_tokens, replays
    finally:
        engine.close()


def test_two_gpus_draft_with_the_mtp_head_in_graphs_as_one(tiny_qwen3_next_config_dir):
    answers, accepted, replays = _answers(tiny_qwen3_next_config_dir, 2)
    one_answers, one_accepted, _ = _answers(tiny_qwen3_next_config_dir, 1)
    assert [a.token_ids for a in answers] == [a.token_ids for a in one_answers]
    assert [a.usage for a in answers] == [a.usage for a in one_answers]
    assert accepted == one_accepted > 0 and replays > 0
    assert answers[3].usage.cached_tokens == 64 and answers[4].usage.cached_tokens == 64
