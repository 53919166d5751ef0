"""The model runner's CUDA-graph wiring, on the CPU with capture stood in for (the captures themselves run
on the GPU: test_engine_gpu.py, test_speculative_gpu.py): decode graphs, then verify graphs of their
batch and page limits, and a failed verify capture that leaves verify eager."""

from __future__ import annotations

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
