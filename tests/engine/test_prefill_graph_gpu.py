"""Piecewise prefill CUDA graphs (`--prefill-graph-tokens`, runner/prefill_graph.py) on the GPU, at the
80B preset's layer shapes (12 layers, FP8 weights and K/V): they capture; a replay computes what the eager
forward computes from the same memory (up to the bits a bucket's row count may change in its GEMMs),
writes the same K/V and states and nothing else; the same forward replays to the same bits after other
lengths of its bucket; and through the engine a cached prefix answers as cold, token and logprob (on
Qwen3.8-Flash-Next's shapes too, whose QSA and PLE layers break the trace at their own eager calls)."""

from __future__ import annotations

import random

import pytest
import torch

from morion.config import EngineConfig
from morion.engine.engine import Engine
from morion.engine.sampling_params import SamplingParams
from morion.loader import load_model
from morion.runner.forward_batch import build_forward_batch
from morion.runner.model_runner import forward_eager

pytestmark = pytest.mark.gpu

PRESET = "qwen3-next-80b-a3b-12l"
BUCKETS = (256, 512, 1024)
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def loaded():
    return load_model(f"preset:{PRESET}", torch.bfloat16, torch.device("cuda"), weight_dtype="fp8")


def engine_of(loaded, buckets=BUCKETS) -> Engine:
    config = EngineConfig(
        model=f"preset:{PRESET}", device="cuda", kv_cache_dtype="fp8", kv_cache_tokens=16384,
        max_running_requests=4, cuda_graph_max_batch=4, prefill_graph_tokens=buckets,
    )  # fmt: skip
    return Engine(config, loaded)


def memory(engine) -> list[torch.Tensor]:
    return [t.clone() for t in (*engine.pool.storages(), *engine.state_slots.storages())]


def restore(engine, saved) -> None:
    for storage, copy in zip((*engine.pool.storages(), *engine.state_slots.storages()), saved, strict=True):
        storage.copy_(copy)


def part_indices(engine, pages: list[int], slots: list[int]) -> list[torch.Tensor]:
    """For each tensor of `memory`, the indices along its dimension 1 that a forward of sequences on
    `pages` with state `slots` may write: their pages' token rows (pool storages are [layers, pages x page
    size, ...]), their slots (state storages are [layers, slots, ...])."""
    page, device = engine.config.page_size, engine.pool.device
    rows = torch.tensor([p * page + i for p in pages for i in range(page)], device=device)
    return [rows] * len(engine.pool.storages()) + [torch.tensor(slots, device=device)] * len(
        engine.state_slots.storages()
    )


def live_parts(saved, indices: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t[:, index] for t, index in zip(saved, indices, strict=True)]


def outside_parts(saved, indices: list[torch.Tensor]) -> list[torch.Tensor]:
    """A `memory` copy with its `live_parts` zeroed: what the forward must leave as it was."""
    kept = [t.clone() for t in saved]
    for t, index in zip(kept, indices, strict=True):
        t[:, index] = 0
    return kept


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30))


def worst_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max(relative_error(g, w) for g, w in zip(got, want, strict=True))


# A replay's difference from the eager forward of its T tokens may come only from the bucket's R rows in
# its GEMMs (cuBLAS picks its kernel by the row count; a rounding change can flip a token's experts,
# and random routers flip easily). So it is bounded by what the same tokens differ by when an eager
# forward has R rows (a filler sequence after them): stale or misplaced rows would be O(1).
FLOOR_FACTOR, FLOOR_MIN = 4.0, 2e-2


@torch.inference_mode()
def test_replays_compute_the_eager_forward_and_repeat_bit_for_bit(loaded):
    engine = engine_of(loaded)
    runner, graphs = engine.runner, engine.runner.prefill_graphs
    assert graphs is not None and graphs.buckets == BUCKETS
    page = engine.config.page_size
    rng = random.Random(3)
    runs = []
    # 992 and 688 tokens replay the 1024 bucket, 200 + 296 the 512 one, 96 the 256 one.
    for lengths in ([992], [688], [200, 296], [96]):
        chunks, slots = [], []
        for length in lengths:
            tokens = [rng.randrange(1, 50000) for _ in range(length)]
            chunks.append((tokens, engine.pool.alloc(-(-length // page)), 0, length))
            slots.append(engine.state_slots.alloc())
            engine.state_slots.zero(slots[-1])
        indices = part_indices(engine, [p for chunk in chunks for p in chunk[1]], slots)
        rows, bucket = sum(lengths), graphs.bucket(sum(lengths))
        batch = build_forward_batch(chunks, slots, page, engine.pool.device)
        before = memory(engine)
        eager = forward_eager(engine.model, engine.pool, batch, engine.state_slots, engine.kv_scales).clone()
        eager_live = live_parts(memory(engine), indices)
        restore(engine, before)

        # The floor: the same chunks eagerly with a filler sequence making them the bucket's R rows.
        floor_chunks, floor_slots = list(chunks), list(slots)
        if rows < bucket:
            filler = bucket - rows
            floor_chunks.append(
                (
                    [rng.randrange(1, 50000) for _ in range(filler)],
                    engine.pool.alloc(-(-filler // page)),
                    0,
                    filler,
                )
            )
            floor_slots.append(engine.state_slots.alloc())
            engine.state_slots.zero(floor_slots[-1])
        floor_batch = build_forward_batch(floor_chunks, floor_slots, page, engine.pool.device)
        as_bucket = forward_eager(
            engine.model, engine.pool, floor_batch, engine.state_slots, engine.kv_scales
        )[:rows].clone()
        floor_live = live_parts(memory(engine), indices)
        hidden_floor, memory_floor = relative_error(as_bucket, eager), worst_error(floor_live, eager_live)
        restore(engine, before)

        replays = graphs.replays
        replayed = runner.forward(batch, ()).hidden.clone()
        assert graphs.replays == replays + 1
        after = memory(engine)
        same_rows = int((replayed == eager).all(dim=1).sum())
        hidden_error = relative_error(replayed, eager)
        memory_error = worst_error(live_parts(after, indices), eager_live)
        print(
            f"{lengths} in bucket {bucket}: {same_rows} of {rows} rows as eager bit for bit; relative error "
            f"hidden {hidden_error:.2e} (eager at {bucket} rows {hidden_floor:.2e}), cache memory "
            f"{memory_error:.2e} ({memory_floor:.2e})"
        )
        assert hidden_error <= max(FLOOR_FACTOR * hidden_floor, FLOOR_MIN), lengths
        assert memory_error <= max(FLOOR_FACTOR * memory_floor, FLOOR_MIN), lengths
        # Padding rows write no page and no state slot: everything else is as it was, bit for bit.
        untouched = zip(
            outside_parts(after, indices),
            outside_parts(before, indices),
            strict=True,
        )
        assert all(torch.equal(a, b) for a, b in untouched), lengths
        runs.append((batch, before, replayed, after))
    for batch, before, replayed, after in reversed(runs):
        restore(engine, before)
        assert torch.equal(runner.forward(batch, ()).hidden, replayed)
        assert all(torch.equal(a, b) for a, b in zip(memory(engine), after, strict=True))
    engine.close()


def test_a_cached_prefix_answers_as_cold(loaded, engine_runner):
    """A prompt's prefill chunk replays; the same prompt again restores its prefix and recomputes only
    the tail, and answers as cold, after prompts of other lengths in the same buckets."""
    rng = random.Random(5)
    prompts = [[rng.randrange(1, 50000) for _ in range(n)] for n in (1000, 700, 300)]
    engine = engine_of(loaded)
    graphs = engine.runner.prefill_graphs
    cold = [engine_runner(engine, [p], GREEDY)[0] for p in prompts]
    assert graphs.replays == len(prompts)
    hits = [engine_runner(engine, [p], GREEDY)[0] for p in reversed(prompts)][::-1]
    assert graphs.replays == len(prompts)  # tails and decodes only
    for c, h in zip(cold, hits, strict=True):
        assert (h.token_ids, h.logprobs) == (c.token_ids, c.logprobs)
    engine.close()


def test_flash_next_prefill_replays(engine_runner):
    """Qwen3.8-Flash-Next's QSA and PLE read the batch's layout only in eager calls (cache writes and
    attention, the n-gram fetch and conv): its prefill graphs capture, a prefill chunk replays, and a
    cached prefix answers as cold, token and logprob."""
    preset = "qwen3.8-flash-next-12l"
    loaded = load_model(f"preset:{preset}", torch.bfloat16, torch.device("cuda"), weight_dtype="fp8")
    config = EngineConfig(
        model=f"preset:{preset}", device="cuda", kv_cache_dtype="fp8", kv_cache_tokens=16384,
        max_running_requests=2, cuda_graph_max_batch=2, prefill_graph_tokens=(512,),
    )  # fmt: skip
    engine = Engine(config, loaded)
    graphs = engine.runner.prefill_graphs
    assert graphs is not None and engine.graphs is not None
    prompt = [random.Random(7).randrange(1, 50000) for _ in range(300)]
    cold = engine_runner(engine, [prompt], GREEDY)[0]
    assert graphs.replays == 1 and len(cold.token_ids) == GREEDY.max_tokens
    hit = engine_runner(engine, [prompt], GREEDY)[0]
    assert graphs.replays == 1  # the tail and the decodes only
    assert (hit.token_ids, hit.logprobs) == (cold.token_ids, cold.logprobs)
    engine.close()
