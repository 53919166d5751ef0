"""Piecewise prefill graphs (runner/prefill_graph.py) on the CPU for the tiny Qwen3.8-Flash-Next (qwen4_exp),
with test_prefill_graph.py's stand-in replay: its trace breaks at QSA's cache writes and attention, Gated
DeltaNet's core and PLE's fetch and conv (nothing else reads the batch's layout or the cache), and a
replay computes and writes what the eager forward does (K/V, QSA's index and block keys, Gated DeltaNet's
and PLE's states), on QSA's per-sequence reference path and on the static one CUDA takes."""

from __future__ import annotations

import functools
import json

import pytest
import torch

from morion.layers.qsa_attention import QSAAttention
from morion.loader import LoadedModel, load_model
from morion.runner import model_runner
from morion.runner.model_runner import ModelRunner
from morion.runner.prefill_graph import PrefillGraphRunner
from tests.engine.test_prefill_graph import (
    PAGE,
    assert_replays_repeat,
    batch_of,
    check_cached_prefix_answers_as_cold,
    graph_runner,
    memory,
    rerun_pieces,
    run_both,
)
from tests.models.conftest import QWEN4_EXP_TINY_CONFIG, qwen4_exp_prompts


@pytest.fixture(scope="module")
def flash_next(tmp_path_factory) -> LoadedModel:
    directory = tmp_path_factory.mktemp("qwen4_exp_prefill_graph")
    (directory / "config.json").write_text(json.dumps(QWEN4_EXP_TINY_CONFIG))
    return load_model(str(directory), torch.float32, torch.device("cpu"), "dummy")


@pytest.fixture
def engine(flash_next, engine_factory):
    return engine_factory(flash_next, page_size=PAGE, enable_prefix_cache=False)


@pytest.fixture(params=[None, True], ids=["reference", "static"])
def qsa_prefill_path(request, monkeypatch):
    """QSA's prefill on the CPU's per-sequence reference path, or on the static path CUDA takes."""
    monkeypatch.setattr(QSAAttention, "static_prefill", request.param)


def test_trace_breaks_at_every_mixer_and_ple_fetch_and_conv(engine):
    """The eager calls, in order: each PLE layer's fetch (at the start), then per layer its PLE conv and
    its mixer's core (QSA's cache writes and attention, Gated DeltaNet's conv and rule)."""
    runner = graph_runner(engine)
    layers = engine.model.model.layers
    expected = ["_fetch_ple_rows"] * sum(layer.ple is not None for layer in layers)
    for layer in layers:
        expected += ["_conv"] if layer.ple is not None else []
        expected.append("_cache_and_attend" if hasattr(layer, "self_attn") else "_mix_reference")
    assert {"_fetch_ple_rows", "_cache_and_attend", "_mix_reference"} <= set(expected)
    captured = runner.prefill_graphs._captured
    for bucket in (32, 64):
        assert [getattr(call.op, "func", call.op).__name__ for call in captured[bucket].calls] == expected
    for small, large in zip(captured[32].calls, captured[64].calls, strict=True):
        assert small.output is large.output and small.output.shape[0] == 64


@pytest.mark.usefixtures("qsa_prefill_path")
def test_replays_equal_the_eager_forward_and_repeat_bit_for_bit(engine):
    """Forwards of 32 and 64 tokens' buckets, with padding and several sequences, some after cached
    tokens: the same hidden states and cache memory as eager, padding writing nothing (not even the
    scratch page); then each again, after the others: the same bits."""
    runner = graph_runner(engine)
    page = runner.scratch_pages[0]
    scratch = slice(page * PAGE, (page + 1) * PAGE)  # the scratch page's token slots
    num_token_components = len(engine.pool.storages())
    runs = []
    forwards = (([20, 23], [0, 9]), ([40], [0]), ([17, 16], [0, 0]), ([30], [12]), ([64], [0]), ([18], [5]))
    for seed, (lengths, starts) in enumerate(forwards):
        batch = batch_of(engine, lengths, seed, starts)
        before = memory(engine)
        eager, eager_memory, replayed, replayed_memory = run_both(engine, runner, batch)
        torch.testing.assert_close(replayed, eager, atol=2e-5, rtol=0)
        for got, want in zip(replayed_memory, eager_memory, strict=True):
            torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
        for storage, saved in zip(engine.pool.storages(), before[:num_token_components], strict=True):
            assert torch.equal(storage[:, scratch], saved[:, scratch])
        tokens, bucket = sum(lengths), runner.prefill_graphs.bucket(sum(lengths))
        for call in runner.prefill_graphs._captured[bucket].calls:
            assert not call.output[tokens:bucket].any()
        runs.append((batch, before, replayed, replayed_memory))
    assert_replays_repeat(engine, runner, runs)


def test_model_runner_captures_without_failing(engine, monkeypatch, capsys):
    """`ModelRunner.capture_prefill_graphs` (with the stand-in for CUDA graphs) keeps the graphs."""
    runner = ModelRunner(
        engine.model, engine.pool, engine.state_slots, engine.kv_scales, engine.pool.alloc(1),
        [engine.state_slots.alloc()],
    )  # fmt: skip
    stand_in = functools.partial(PrefillGraphRunner, capture_pieces=rerun_pieces)
    monkeypatch.setattr(model_runner, "PrefillGraphRunner", stand_in)
    runner.capture_prefill_graphs([32, 64])
    assert runner.prefill_graphs is not None
    err = capsys.readouterr().err
    assert "FAILED" not in err and "captured piecewise prefill CUDA graphs for 2 token buckets" in err


@pytest.mark.usefixtures("qsa_prefill_path")
def test_cached_prefix_answers_as_cold_with_prefill_graphs(flash_next, engine_factory, engine_runner):
    prompt, extra, other_prompt = qwen4_exp_prompts(3, seed=11, lengths=(30, 60))
    prompt = (prompt * 2)[:45]
    check_cached_prefix_answers_as_cold(
        flash_next, engine_factory, engine_runner, prompt, prompt + extra[:30], other_prompt
    )
