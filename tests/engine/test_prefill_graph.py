"""Piecewise prefill graphs (runner/prefill_graph.py, runner/piecewise_graph.py) on the CPU, on the tiny
Qwen3-Next. CUDA graphs cannot exist here, so `RerunPieces` stands in for one bucket's captured pieces:
"replaying" piece 0 starts the traced forward afresh in a thread, which computes its pieces in Python
over the static inputs and stops at each break point until the next piece is replayed, while the
runner's replay loop runs the recorded eager calls in between, with the live batch, as on the GPU. What is
checked is everything but the graphs themselves: the break points, bucket choice, padding, bridges, the
live backend, which memory is written, and where `ModelRunner` replays (the GPU test:
test_prefill_graph_gpu.py)."""

from __future__ import annotations

import threading

import pytest
import torch

from morion.engine.sampling_params import SamplingParams
from morion.runner.forward_batch import build_forward_batch
from morion.runner.model_runner import ModelRunner, forward_eager
from morion.runner.piecewise_graph import CapturedForward, PieceBackend, PieceForward, Traced
from morion.runner.prefill_graph import PrefillGraphRunner

PAGE = 8


class RerunPieces:
    """One bucket's pieces, replayed by rerunning the traced forward in a thread, a piece at a time."""

    def __init__(self, forward: PieceForward, recorded: Traced) -> None:
        self._forward = forward
        self._recorded = recorded
        self._to_caller = threading.Semaphore(0)
        self._to_forward = threading.Semaphore(0)
        self._error: BaseException | None = None
        self.pieces = [_Piece(self, i) for i in range(len(recorded.calls) + 1)]

    def replay(self, index: int) -> None:
        if index == 0:
            threading.Thread(target=self._run, daemon=True).start()
        else:
            self._to_forward.release()
        self._to_caller.acquire()
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        try:
            with torch.inference_mode():
                traced = self._forward(self._pause)
                # The graphs' output is one tensor, written by the last piece.
                assert len(traced.calls) == len(self._recorded.calls)
                self._recorded.hidden.copy_(traced.hidden)
        except BaseException as error:  # handed to the replaying thread
            self._error = error
        self._to_caller.release()

    def _pause(self, op, inputs) -> None:
        self._to_caller.release()
        self._to_forward.acquire()


class _Piece:
    def __init__(self, pieces: RerunPieces, index: int) -> None:
        self._pieces, self._index = pieces, index

    def replay(self) -> None:
        self._pieces.replay(self._index)


def rerun_pieces(forward: PieceForward) -> CapturedForward:
    """The stand-in for `capture_cuda_pieces`: the forward traced once with calls not run (as a capture
    does), then its pieces rerun on replay."""
    recorded = forward(lambda op, inputs: None)
    return CapturedForward(RerunPieces(forward, recorded).pieces, recorded.calls, recorded.hidden)


@pytest.fixture
def engine(tiny_qwen3_next, engine_factory):
    return engine_factory(tiny_qwen3_next, page_size=PAGE, enable_prefix_cache=False)


def graph_runner(engine, buckets=(32, 64)) -> ModelRunner:
    """A model runner over `engine`'s memory with piecewise prefill graphs for `buckets`."""
    runner = ModelRunner(
        engine.model, engine.pool, engine.state_slots, engine.kv_scales, engine.pool.alloc(1),
        [engine.state_slots.alloc()],
    )  # fmt: skip
    graphs = PrefillGraphRunner(
        engine.model, engine.pool, engine.state_slots, engine.kv_scales, buckets, runner.scratch_pages[0],
        runner.scratch_slots[0], capture_pieces=rerun_pieces,
    )  # fmt: skip
    graphs.capture()
    runner.prefill_graphs = graphs
    return runner


def batch_of(engine, lengths, seed=0, starts=None):
    """A forward of fresh sequences of `lengths` new tokens (after `starts` earlier ones), with pages and
    state slots of their own."""
    generator = torch.Generator().manual_seed(seed)
    starts = starts or [0] * len(lengths)
    chunks, slots = [], []
    for length, start in zip(lengths, starts, strict=True):
        tokens = torch.randint(0, 512, (start + length,), generator=generator).tolist()
        chunks.append((tokens, engine.pool.alloc(-(-(start + length) // PAGE)), start, length))
        slots.append(engine.state_slots.alloc())
    return build_forward_batch(chunks, slots, PAGE, torch.device("cpu"))


def memory(engine) -> list[torch.Tensor]:
    return [t.clone() for t in (*engine.pool.storages(), *engine.state_slots.storages())]


def restore(engine, saved: list[torch.Tensor]) -> None:
    for storage, copy in zip((*engine.pool.storages(), *engine.state_slots.storages()), saved, strict=True):
        storage.copy_(copy)


def run_both(engine, runner, batch):
    """(eager hidden, eager memory after, replayed hidden, replayed memory after) from the same memory."""
    before = memory(engine)
    with torch.inference_mode():
        eager = forward_eager(engine.model, engine.pool, batch, engine.state_slots, engine.kv_scales)
        eager_memory = memory(engine)
        restore(engine, before)
        replays = runner.prefill_graphs.replays
        replayed = runner.forward(batch, ()).hidden.clone()
    assert runner.prefill_graphs.replays == replays + 1
    return eager, eager_memory, replayed, memory(engine)


def test_trace_breaks_at_every_attention_and_gated_delta_net_core(engine):
    runner = graph_runner(engine)
    captured = runner.prefill_graphs._captured
    num_layers = len(engine.model.model.layers)
    assert sorted(captured) == [32, 64]
    for bucket in (32, 64):
        assert len(captured[bucket].calls) == num_layers  # one break per mixer
        assert len(captured[bucket].pieces) == num_layers + 1
    # Every bucket's calls read and write the same bridges (rows of the largest bucket).
    for small, large in zip(captured[32].calls, captured[64].calls, strict=True):
        assert small.output is large.output and small.output.shape[0] == 64
        assert all(a is b for a, b in zip(small.inputs, large.inputs, strict=True))


def test_replay_equals_the_eager_forward_and_writes_only_the_batch_memory(engine):
    runner = graph_runner(engine)
    batch = batch_of(engine, [20, 23], starts=[0, 9])  # 43 tokens: bucket 64, 21 padding rows
    scratch = runner.scratch_pages[0], runner.scratch_slots[0]
    eager, eager_memory, replayed, replayed_memory = run_both(engine, runner, batch)
    torch.testing.assert_close(replayed, eager, atol=2e-5, rtol=0)
    # Both wrote the same K/V and states; padding rows wrote nothing anywhere (not even scratch memory:
    # the eager calls see only the real rows).
    for got, want in zip(replayed_memory, eager_memory, strict=True):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
    kv = engine.pool.storage("kv")
    assert torch.equal(kv[:, scratch[0]], eager_memory[0][:, scratch[0]])
    # The calls' padding rows were zeroed for this replay.
    for call in runner.prefill_graphs._captured[64].calls:
        assert not call.output[43:64].any()


def test_one_bucket_replays_forwards_of_other_lengths_and_the_same_one_identically(engine):
    runner = graph_runner(engine)
    runs = []
    for lengths, seed in (([40], 1), ([17, 16], 2), ([30], 3), ([64], 4), ([20, 23], 5)):
        batch = batch_of(engine, lengths, seed)
        before = memory(engine)
        eager, _, replayed, replayed_memory = run_both(engine, runner, batch)
        torch.testing.assert_close(replayed, eager, atol=2e-5, rtol=0)
        runs.append((batch, before, replayed, replayed_memory))
    assert_replays_repeat(engine, runner, runs)


def assert_replays_repeat(engine, runner, runs) -> None:
    """Each forward of `runs` ((batch, memory before, replayed hidden, memory after)) again, from the same
    memory, after the others left their rows in the bridges and static inputs: the same bits (what a
    prompt's chunk computes never depends on what ran before)."""
    for batch, before, replayed, replayed_memory in reversed(runs):
        restore(engine, before)
        with torch.inference_mode():
            again = runner.forward(batch, ()).hidden.clone()
        assert torch.equal(again, replayed)
        assert all(torch.equal(a, b) for a, b in zip(memory(engine), replayed_memory, strict=True))


def test_model_runner_replays_only_prefill_forwards_within_the_buckets(engine):
    runner = graph_runner(engine)
    graphs = runner.prefill_graphs
    with torch.inference_mode():
        for lengths, replays in (([30], True), ([65], False), ([16, 16], False), ([1, 1], False)):
            batch = batch_of(engine, lengths, starts=[4] * len(lengths))
            before = graphs.replays
            runner.forward(batch, ())
            assert (graphs.replays == before + 1) is replays, lengths
    assert [graphs.bucket(t) for t in (1, 32, 33, 64)] == [32, 32, 64, 64]
    with runner.profiled(by_module=True):  # hooks see every module: eager
        assert runner.prefill_graphs is None
    assert runner.prefill_graphs is graphs


def test_pieces_get_no_batch_metadata():
    backend = PieceBackend(None, 8, lambda op, inputs: None)
    assert backend.verify_slots is None
    for name in ("query_ranges", "state_indices", "cu_seqlens", "state_pool", "token_pool"):
        with pytest.raises(RuntimeError, match=f"no '{name}'"):
            getattr(backend, name)


def test_a_failed_capture_leaves_prefill_eager(engine, monkeypatch, capsys):
    runner = ModelRunner(
        engine.model, engine.pool, engine.state_slots, engine.kv_scales, engine.pool.alloc(1),
        [engine.state_slots.alloc()],
    )  # fmt: skip

    def host_sync(self: PrefillGraphRunner) -> None:
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(PrefillGraphRunner, "capture", host_sync)
    runner.capture_prefill_graphs([64])
    assert runner.prefill_graphs is None
    assert "piecewise prefill CUDA graph capture FAILED, prefill runs eagerly" in capsys.readouterr().err


def test_cached_prefix_answers_as_cold_with_prefill_graphs(tiny_qwen3_next, engine_factory, engine_runner):
    prompt = [(7 * i + 3) % 500 for i in range(45)]
    longer = prompt + [(11 * i + 5) % 500 for i in range(30)]
    other_prompt = [(5 * i + 1) % 500 for i in range(60)]
    check_cached_prefix_answers_as_cold(
        tiny_qwen3_next, engine_factory, engine_runner, prompt, longer, other_prompt
    )


def check_cached_prefix_answers_as_cold(loaded, engine_factory, engine_runner, prompt, longer, other_prompt):
    """The restore-identity property through the engine: a prompt's prefill chunk replays a graph, and
    the same prompt again (a prefix hit: its tail recomputed) answers with the same tokens and logprobs;
    another engine with the same history (after `other_prompt`) answers alike, whatever its graphs
    replayed before. `prompt`: 45 tokens (chunks 0-40, prefill, and 40-45, the tail); `longer` extends it."""
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2)

    def engine_with_graphs():
        engine = engine_factory(loaded, page_size=PAGE, chunk_size=64)
        engine.runner.prefill_graphs = graph_runner(engine).prefill_graphs
        return engine

    engine = engine_with_graphs()
    graphs = engine.runner.prefill_graphs
    cold = engine_runner(engine, [prompt], params)[0]
    assert graphs.replays == 1  # the prefill chunk; the tail and the decodes run eagerly
    hit = engine_runner(engine, [prompt], params)[0]
    assert graphs.replays == 1  # the hit recomputes only the tail
    extended = engine_runner(engine, [longer], params)[0]
    assert graphs.replays == 2
    assert hit.token_ids == cold.token_ids and hit.logprobs == cold.logprobs
    other = engine_with_graphs()
    engine_runner(other, [other_prompt], params)
    assert engine_runner(other, [prompt], params)[0].logprobs == cold.logprobs
    again = engine_runner(other, [longer], params)[0]
    assert again.token_ids == extended.token_ids and again.logprobs == extended.logprobs
