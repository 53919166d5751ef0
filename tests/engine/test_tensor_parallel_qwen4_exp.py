"""A tensor-parallel engine (issue #28) on the tiny Qwen3.8-Flash-Next, on the CPU: rank 0 here, rank 1 a
process of its own, gloo between them. test_tensor_parallel_mtp.py's scenario (a batch with logprobs, one
request drafting on demand after its verify, a device prefix hit, a host-tier restore) with the model's MTP
head drafting at forced acceptance, at TP=2 against TP=1: the same tokens, drafted and accepted counts and
cached tokens, logprobs within fp32 tolerance. Each rank's pages hold its K/V heads and the replicated QSA
side caches, its state slots its Gated DeltaNet heads and the replicated PLE state. A multimodal checkpoint
loads at TP=2 and answers text as at TP=1; its images are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from morion.config import EngineConfig
from morion.engine.engine import Engine
from morion.errors import InvalidRequestError
from morion.multimodal.image_decode import prepare_image
from morion.multimodal.processing import ImageProcessing
from morion.spec.speculative import SpecStats
from tests import tiny_vlm
from tests.engine.test_tensor_parallel import GREEDY, LOGPROB_TOLERANCE, WITH_PROMPT_LOGPROBS, _run
from tests.engine.test_tensor_parallel_mtp import _engine, _scenario, check_as_one_rank
from tests.models.conftest import QWEN4_EXP_TINY_CONFIG
from tests.tiny_vlm import IMAGE_TOKEN, VISION_END, VISION_START


@pytest.fixture(scope="module")
def qwen4_exp_config_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tiny_qwen4_exp_config")
    (directory / "config.json").write_text(json.dumps(QWEN4_EXP_TINY_CONFIG))
    return directory


@pytest.fixture(scope="module")
def one_rank(qwen4_exp_config_dir) -> tuple[list[list], SpecStats]:
    engine = _engine(qwen4_exp_config_dir, 1)
    try:
        return _scenario(engine)
    finally:
        engine.close()


def test_two_ranks_draft_with_the_mtp_head_as_one(qwen4_exp_config_dir, one_rank):
    two_ranks = _engine(qwen4_exp_config_dir, 2)  # closed here: a process holds one such engine at a time
    try:
        # 4,096 tokens of random logits: a prompt token's rank may swap with a neighbour's within 1e-6 (seen)
        check_as_one_rank(two_ranks, one_rank, rank_slack=1)
    finally:
        two_ranks.close()


def test_a_multimodal_checkpoint_splits_and_refuses_images(tiny_vlm_checkpoint):
    """A checkpoint as users get it (`model.language_model.` names, the vision tower's `model.visual.*`,
    the n-gram table's shards): each rank cuts its part as the tensors stream in and answers text as one
    rank does; a request with an image is refused, as nothing sends the follower its image rows."""
    directory, _ = tiny_vlm_checkpoint
    prompt = [(37 * i) % 3900 + 6 for i in range(30)]
    answers = []
    for size in (1, 2):
        engine = Engine(EngineConfig(model=str(directory), device="cpu", tensor_parallel_size=size))
        try:
            answers.append(_run(engine, [(prompt, WITH_PROMPT_LOGPROBS)])[0])
            image = prepare_image(tiny_vlm.png(16, 16, seed=0), ImageProcessing.for_model(directory))
            tokens = [VISION_START, *[IMAGE_TOKEN] * image.num_tokens(2), VISION_END]
            if size == 2:
                with pytest.raises(InvalidRequestError, match="images are not supported with tensor_"):
                    engine.add_request(tokens, GREEDY, images=[image])
        finally:
            engine.close()
    [one, two] = answers
    assert two.token_ids == one.token_ids
    for got, want in zip(two.prompt_logprobs[1:], one.prompt_logprobs[1:], strict=True):
        assert abs(got.logprob - want.logprob) < LOGPROB_TOLERANCE and got.rank == want.rank
