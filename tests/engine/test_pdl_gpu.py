"""Programmatic dependent launch changes when kernels start, never what they compute (ops/pdl.py): at the
80B and Flash-Next presets' layer shapes (12 layers each, FP8 weights and K/V, decode from CUDA graphs),
`--pdl launch` and `--pdl prefetch` give every greedy token and its logprob bit for bit as `--pdl off`. A
kernel that read before its wait would read the previous kernel's output half-written, and the tokens or
logprobs would differ."""

from __future__ import annotations

import random

import pytest
import torch

from morion.config import PDL_MODES, EngineConfig
from morion.engine.engine import Engine
from morion.engine.sampling_params import SamplingParams
from morion.loader import load_model
from morion.ops import pdl

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, logprobs=0)


@pytest.fixture
def pdl_off_afterwards():
    yield
    pdl.set_pdl_mode("off", torch.device("cuda"))


@pytest.mark.parametrize("preset", ["qwen3-next-80b-a3b-12l", "qwen3.8-flash-next-12l"])
def test_pdl_modes_give_the_same_tokens_and_logprobs(preset, engine_runner, pdl_off_afterwards):
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs compute capability 9.0 (Hopper) or later")
    cuda = torch.device("cuda")
    loaded = load_model(f"preset:{preset}", torch.bfloat16, cuda, weight_dtype="fp8")
    rng = random.Random(7)
    prompts = [[rng.randrange(1, 50000) for _ in range(rng.randint(300, 900))] for _ in range(4)]
    answers = {}
    for mode in PDL_MODES:
        config = EngineConfig(
            model=f"preset:{preset}", device="cuda", kv_cache_dtype="fp8", kv_cache_tokens=16384,
            max_running_requests=4, cuda_graph_max_batch=4, enable_prefix_cache=False, pdl=mode,
        )  # fmt: skip
        engine = Engine(config, loaded)
        assert pdl.pdl_mode() == (pdl.AUTO_MODE if mode == "auto" else mode)  # Hopper and later
        assert engine.graphs is not None
        answers[mode] = [(o.token_ids, o.logprobs) for o in engine_runner(engine, prompts, GREEDY)]
        engine.close()
    assert answers["launch"] == answers["off"]
    assert answers["prefetch"] == answers["off"]
