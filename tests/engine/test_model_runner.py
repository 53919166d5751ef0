"""The model runner's CUDA-graph wiring, on the CPU with capture stood in for (the captures themselves run
on the GPU: test_engine_gpu.py, test_speculative_gpu.py): decode graphs, then verify graphs of their
batch and page limits, and a failed verify capture that leaves verify eager; short-chunk graphs (a
prompt's tail) per length, and which graph `forward` hands a batch."""

from __future__ import annotations

from types import SimpleNamespace

from morion.engine.sampling_params import SamplingParams
from morion.models.llama import DenseForCausalLM
from morion.models.qwen3_next import Qwen3NextForCausalLM
from morion.models.qwen4_exp import Qwen4ExpForCausalLM
from morion.runner.cuda_graph import DecodeGraphRunner
from morion.runner.model_runner import ModelRunner


def test_decode_then_verify_graphs_and_a_failed_capture(tiny_qwen3_next, engine_factory, monkeypatch):
    engine = engine_factory(tiny_qwen3_next, page_size=8)
    captured: list[DecodeGraphRunner] = []
    monkeypatch.setattr(DecodeGraphRunner, "capture", lambda self: captured.append(self))
    runner = ModelRunner(
        engine.model, engine.pool, engine.state_slots, engine.kv_scales, engine.pool.alloc(1),
        [engine.state_slots.alloc()],
    )  # fmt: skip
    runner.capture_decode_graphs(6, 9)
    decode = runner.decode_graphs
    assert captured == [decode] and (decode.max_batch, decode.max_pages, decode.query_len) == (6, 9, 1)
    assert runner.capture_verify_graph(4)
    verify = runner.verify_graphs[4]
    assert (verify.max_batch, verify.max_pages, verify.query_len) == (6, 9, 4)

    def host_sync(self: DecodeGraphRunner) -> None:
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(DecodeGraphRunner, "capture", host_sync)
    assert not runner.capture_verify_graph(3) and sorted(runner.verify_graphs) == [4]


def test_short_graphs_per_tail_length_and_the_forward_that_replays_them(
    tiny_qwen3_next, engine_factory, monkeypatch, capsys
):
    """A graph per short length 2 .. min(SHORT_CHUNK_TOKENS, page size), of one sequence, without verify
    slots, once decode graphs exist and where the model says its short forward is capturable; `forward`
    picks the decode graphs for one token per sequence, the short graph of the batch's length otherwise
    (its `can_run` then decides), none for prefill; a failed capture leaves them all eager."""
    engine = engine_factory(tiny_qwen3_next, page_size=8)
    captured: list[DecodeGraphRunner] = []
    monkeypatch.setattr(DecodeGraphRunner, "capture", lambda self, quiet=False: captured.append(self))
    runner = ModelRunner(
        engine.model, engine.pool, engine.state_slots, engine.kv_scales, engine.pool.alloc(1),
        [engine.state_slots.alloc()],
    )  # fmt: skip
    runner.capture_short_graphs()
    assert runner.short_graphs == {} and captured == []  # no decode graphs' memory pool to share
    runner.capture_decode_graphs(6, 9)
    runner.capture_short_graphs()
    assert sorted(runner.short_graphs) == list(range(2, 9))  # up to the page size
    for length, graph in runner.short_graphs.items():
        assert (graph.max_batch, graph.max_pages, graph.query_len, graph.verify) == (1, 9, length, False)
    assert "short-chunk CUDA graphs (one sequence of 2 to 8 tokens" in capsys.readouterr().err

    chosen: list[tuple[str, DecodeGraphRunner | None]] = []
    monkeypatch.setattr(
        runner, "_run", lambda kind, batch, graph, restores, images=None: chosen.append((kind, graph))
    )
    for length in (1, 5, 8, 9, 300):
        runner.forward(SimpleNamespace(max_query_len=length), ())
    short = runner.short_graphs
    assert chosen == [
        ("decode", runner.decode_graphs), ("short", short[5]), ("short", short[8]), ("short", None),
        ("prefill", None),
    ]  # fmt: skip

    def host_sync(self: DecodeGraphRunner, quiet: bool = False) -> None:
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(DecodeGraphRunner, "capture", host_sync)
    runner.short_graphs = {}
    runner.capture_short_graphs()
    assert runner.short_graphs == {} and "short-chunk CUDA graph capture FAILED" in capsys.readouterr().err


def test_short_graphs_only_where_the_model_captures_them(tiny_qwen3_next, engine_factory, monkeypatch):
    """Both hybrid models declare their short forward capturable (Flash-Next since its QSA selection's
    width stopped following the page table's, session 22); the dense models do not: a model that does
    not gets no short graphs."""
    assert Qwen3NextForCausalLM.short_chunk_graphs and Qwen4ExpForCausalLM.short_chunk_graphs
    assert not hasattr(DenseForCausalLM, "short_chunk_graphs")
    engine = engine_factory(tiny_qwen3_next, page_size=8)
    monkeypatch.setattr(DecodeGraphRunner, "capture", lambda self, quiet=False: None)
    monkeypatch.setattr(type(engine.model), "short_chunk_graphs", False)
    runner = ModelRunner(
        engine.model, engine.pool, engine.state_slots, engine.kv_scales, engine.pool.alloc(1),
        [engine.state_slots.alloc()],
    )  # fmt: skip
    runner.capture_decode_graphs(2, 4)
    runner.capture_short_graphs()
    assert runner.decode_graphs is not None and runner.short_graphs == {}


def test_forwards_are_counted_by_kind_and_path(tiny_qwen3_next, engine_factory, engine_runner):
    """A 40-token prompt on 16-token pages is a prefill chunk (32 tokens) and a short tail (8); each
    output token after the first a decode forward; on a CPU all of them eager."""
    engine = engine_factory(tiny_qwen3_next, page_size=16)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine_runner(engine, [list(range(3, 43))], params)
    counts = engine.runner.forwards.snapshot()
    assert {key: count for key, count in counts.items() if count} == {
        ("prefill", "eager"): 1, ("short", "eager"): 1, ("decode", "eager"): 3,
    }  # fmt: skip
    assert len(counts) == 8  # every (kind, path), counted or not
