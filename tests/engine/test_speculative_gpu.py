"""Speculative decoding on CUDA (skipped without a GPU): the verify forward replays its CUDA graph (the
Triton extend attention, the Gated DeltaNet decode kernels chained over the draft positions with a
state slot per position) and greedy output equals the plain CUDA-graph decode."""

from __future__ import annotations

import copy
import random

import pytest

from morion.config import EngineConfig
from morion.engine.engine import Engine
from morion.engine.sampling_params import SamplingParams
from morion.spec.synthetic import SyntheticDrafter

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=["small_llama", "tiny_qwen3_next"])
def on_cuda(request):
    loaded = request.getfixturevalue(request.param)
    return loaded._replace(model=copy.deepcopy(loaded.model).to("cuda"))


def _engine(loaded, drafter=None, **options) -> Engine:
    options = {
        "device": "cuda",
        "kv_cache_tokens": 4096,
        "page_size": 8,
        "max_running_requests": 4,
        **options,
    }
    return Engine(EngineConfig(**options), loaded, drafter=drafter)


@pytest.mark.parametrize("acceptance", [0.0, 0.5, 1.0])
def test_verify_graphs_give_the_plain_greedy_output(on_cuda, engine_runner, acceptance):
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(30 + 7 * i)] for i in range(3)]
    expected = [
        o.token_ids for o in engine_runner(_engine(on_cuda, enable_prefix_cache=False), prompts, GREEDY)
    ]
    oracle = [p + o for p, o in zip(prompts, expected, strict=True)]
    engine = _engine(on_cuda, SyntheticDrafter(acceptance, oracle, 256, seed=0), spec_width=3)
    assert [o.token_ids for o in engine_runner(engine, prompts, GREEDY)] == expected
    assert engine.verify_graphs[4].replays > 0
    engine.check_integrity()


def test_mtp_drafts_on_cuda_give_the_plain_greedy_output(tiny_qwen3_next, engine_runner):
    """The MTP head reads the hidden states the decode and verify graphs leave behind."""
    on_cuda = tiny_qwen3_next._replace(model=copy.deepcopy(tiny_qwen3_next.model).to("cuda"))
    rng = random.Random(1)
    prompts = [[rng.randrange(512) for _ in range(30 + 7 * i)] for i in range(3)]
    expected = [
        o.token_ids for o in engine_runner(_engine(on_cuda, enable_prefix_cache=False), prompts, GREEDY)
    ]
    engine = _engine(on_cuda, speculative="mtp", spec_width=3)
    assert [o.token_ids for o in engine_runner(engine, prompts, GREEDY)] == expected
    assert engine.verify_graphs[4].replays > 0 and engine.speculative.stats.drafted_tokens > 0
    engine.check_integrity()
