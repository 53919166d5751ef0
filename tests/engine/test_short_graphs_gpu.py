"""Short-chunk CUDA graphs (runner/model_runner.capture_short_graphs) on the GPU, at both presets' layer
shapes (12 layers, FP8 weights and K/V; Flash-Next's PLE hashing its tails on the device, its QSA on the
static path): every prompt's tail (the 2 to 16 tokens after its last page boundary) replays the graph of
its length, and answers as the eager short forward does, token and logprob, cold and as a cached prefix's
tail; a one-token tail is a decode step and replays no short graph."""

from __future__ import annotations

import random

import pytest
import torch

from morion.config import EngineConfig
from morion.engine.engine import Engine
from morion.engine.sampling_params import SamplingParams
from morion.loader import load_model

pytestmark = pytest.mark.gpu

# Both presets: Flash-Next's replayed tails parted from its eager ones until QSA's selection width stopped
# following the page table's (ops/qsa_triton.select_token_slots, session 22).
PRESETS = ("qwen3-next-80b-a3b-12l", "qwen3.8-flash-next-12l")
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
# Tails of 2, 7 and 16 tokens after 16-token pages (the last a whole page), and of one token.
LENGTHS = (16 * 20 + 2, 16 * 40 + 7, 16 * 9 + 16, 16 * 30 + 1)


@pytest.fixture(scope="module", params=PRESETS)
def loaded(request):
    model = load_model(f"preset:{request.param}", torch.bfloat16, torch.device("cuda"), weight_dtype="fp8")
    yield request.param, model
    del model
    torch.cuda.empty_cache()


def engine_of(loaded) -> Engine:
    preset, model = loaded
    config = EngineConfig(
        model=f"preset:{preset}", device="cuda", kv_cache_dtype="fp8", kv_cache_tokens=16384,
        max_running_requests=2, cuda_graph_max_batch=2,
    )  # fmt: skip
    return Engine(config, model)


def test_tails_replay_their_graphs_and_answer_as_the_eager_short_forward(loaded, engine_runner):
    rng = random.Random(11)
    prompts = [[rng.randrange(1, 50000) for _ in range(n)] for n in LENGTHS]
    graphs = engine_of(loaded)
    assert sorted(graphs.runner.short_graphs) == list(range(2, 17))
    replayed = graphs.runner.short_graphs
    cold = [engine_runner(graphs, [p], GREEDY)[0] for p in prompts]
    assert [replayed[n].replays for n in (2, 7, 16)] == [1, 1, 1]
    assert sum(graph.replays for graph in replayed.values()) == 3  # the one-token tail is a decode step

    eager = engine_of(loaded)
    eager.runner.short_graphs = {}
    references = [engine_runner(eager, [p], GREEDY)[0] for p in prompts]
    eager.close()
    for c, r in zip(cold, references, strict=True):
        assert (c.token_ids, c.logprobs) == (r.token_ids, r.logprobs)

    hits = [engine_runner(graphs, [p], GREEDY)[0] for p in reversed(prompts)][::-1]
    assert [replayed[n].replays for n in (2, 7, 16)] == [2, 2, 2]  # each hit recomputes its tail
    for c, h in zip(cold, hits, strict=True):
        assert (h.token_ids, h.logprobs) == (c.token_ids, c.logprobs)
    graphs.close()
