"""Qwen3.8-Flash-Next (qwen4_exp) on a CUDA device (skipped where there is none): the n-gram table in
page-locked host memory, its rows copied on a side stream (prefill) or read by the decode step's kernel,
the engine on the GPU against the CPU, and decode / verify steps replayed from CUDA graphs.

QSA ties: on CUDA, blocks that score exactly zero are ranked by lower index (ops/qsa.py); the CPU
references here are told to do the same (`exact_ties_on_cpu` off), so both devices select alike."""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import save_file

from morion.config import EngineConfig
from morion.engine.engine import Engine
from morion.engine.sampling_params import SamplingParams
from morion.layers.host_table import HostRowTable, shard_name
from morion.layers.ple_static import device_gather_ok, gather_rows
from morion.layers.qsa_attention import QSAAttention
from morion.loader import load_model
from morion.spec.synthetic import SyntheticDrafter
from tests.models.conftest import QWEN4_EXP_TINY_CONFIG, one_shot_logits

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
TIE_GAP = 1e-3
CONFIG = {
    **QWEN4_EXP_TINY_CONFIG,
    "vocab_size": 1024,
    "hidden_size": 128,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "max_position_embeddings": 32768,  # the default
}


def _page_locked_table() -> HostRowTable:
    table = HostRowTable(num_rows=1000, dim=16, parts=3)
    table.place("ram", pin_memory=True, model_dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    for index in range(table.num_shards):
        table.load(
            shard_name(index),
            torch.randn(table.shard_shape(index), generator=generator).to(torch.float8_e4m3fn),
        )
    table.load("weight_scale", torch.tensor([0.5], dtype=torch.bfloat16))
    return table


def test_table_rows_reach_the_device_from_page_locked_memory():
    table = _page_locked_table()
    assert all(shard.is_pinned() for shard in table.shards)
    rows = torch.tensor([0, 999, 333, 334, 667, 5, 5])
    fetched = table.fetch(rows, torch.device("cuda"))
    assert fetched.ready is not None and fetched.staging.is_pinned()
    on_device = fetched.wait(torch.float32)
    assert on_device.is_cuda and torch.equal(on_device.cpu(), table.gather(rows).float() * 0.5)


def test_the_device_gathers_rows_from_page_locked_shards_itself():
    """The decode step's UVA gather reads the shards at the addresses the driver gives (a wrong pointer
    attribute once handed the kernel a memory type instead: an illegal address)."""
    table = _page_locked_table()
    cuda = torch.device("cuda")
    assert device_gather_ok(table, cuda)
    rows = torch.tensor([0, 999, 333, 334, 667, 5, 5])
    gathered = gather_rows(table, rows.to(cuda)).view(torch.uint8)
    assert gathered.is_cuda and torch.equal(gathered.cpu(), table.gather(rows).view(torch.uint8))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """Seeded random weights drawn on the CPU, saved, so both devices load the same ones."""
    directory = tmp_path_factory.mktemp("qwen4_exp_gpu")
    (directory / "config.json").write_text(json.dumps(CONFIG))
    model = load_model(str(directory), torch.float32, torch.device("cpu"), "dummy", seed=1).model
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, directory / "model.safetensors")
    return directory


def _check_greedy(greedy_checker, cpu_model: torch.nn.Module, prompts, outputs, expected) -> None:
    """`outputs` equal `expected` token for token, or diverge only at a near-tie of the CPU's logits."""
    for prompt, a, b in zip(prompts, outputs, expected, strict=True):
        greedy_checker(
            a.token_ids,
            b.token_ids,
            lambda s, p=prompt, r=b: one_shot_logits(cpu_model, p + r.token_ids[:s], page_size=8)[-1],
            TIE_GAP,
        )


def test_cuda_equals_cpu(checkpoint, engine_factory, engine_runner, greedy_checker, monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # the PLE conv: fp32 on both devices
    monkeypatch.setattr(QSAAttention, "exact_ties_on_cpu", False)  # zero-score ties as on CUDA
    on_cpu = load_model(str(checkpoint), torch.float32, torch.device("cpu"))
    on_cuda = load_model(str(checkpoint), torch.float32, torch.device("cuda"))
    (table,) = on_cuda.model.host_tables()
    assert table.pin_memory and all(shard.is_pinned() and not shard.is_cuda for shard in table.shards)
    rng = random.Random(0)
    prompts = [[rng.randrange(1024) for _ in range(rng.randint(1, 80))] for _ in range(5)]
    cpu_out = engine_runner(engine_factory(on_cpu, page_size=8), prompts, GREEDY)
    engine = engine_factory(on_cuda, page_size=8, device="cuda", chunk_size=32, host_cache_gb=0.05)
    assert engine.graphs is not None  # decode captured: QSA's static path, PLE hashed and gathered on the GPU
    cuda_out = engine_runner(engine, prompts, GREEDY)
    assert engine.graphs.replays > 0
    _check_greedy(greedy_checker, on_cpu.model, prompts, cuda_out, cpu_out)
    again = engine_runner(engine, prompts, GREEDY)  # device prefix-cache hits
    assert [o.token_ids for o in again] == [o.token_ids for o in cuda_out]
    engine.evict_device_cache()
    restored = engine_runner(engine, prompts, GREEDY)  # host-tier hits: copies on the copy stream
    assert [o.token_ids for o in restored] == [o.token_ids for o in cuda_out]
    assert engine.cache_stats.restored_snapshots > 0
    engine.check_integrity()
    engine.close()


def test_bf16_with_fp8_kv_runs(checkpoint, engine_factory, engine_runner):
    loaded = load_model(str(checkpoint), torch.bfloat16, torch.device("cuda"))
    engine = engine_factory(loaded, device="cuda", kv_cache_dtype="fp8", cuda_graph=False)
    outputs = engine_runner(engine, [[1, 2, 3], list(range(6, 90))], GREEDY)
    assert all(len(o.token_ids) == 16 for o in outputs)


def test_decode_graphs_equal_eager_decode(
    checkpoint, engine_factory, engine_runner, greedy_checker, monkeypatch
):
    """6 requests decode through the 8- and 4-row buckets with padding rows; a divergence from eager is
    accepted only at a near-tie of the CPU's logits. FP8 K/V replays too."""
    monkeypatch.setattr(QSAAttention, "exact_ties_on_cpu", False)  # zero-score ties as on CUDA
    on_cpu = load_model(str(checkpoint), torch.float32, torch.device("cpu"))
    loaded = load_model(str(checkpoint), torch.float32, torch.device("cuda"))
    rng = random.Random(1)
    prompts = [[rng.randrange(1024) for _ in range(rng.randint(20, 120))] for _ in range(6)]
    eager = engine_factory(loaded, page_size=8, device="cuda", cuda_graph=False)
    eager_out = engine_runner(eager, prompts, GREEDY)
    graphed = engine_factory(loaded, page_size=8, device="cuda", cuda_graph_max_batch=8)
    assert graphed.graphs is not None
    graphed_out = engine_runner(graphed, prompts, GREEDY)
    assert graphed.graphs.replays > 0
    _check_greedy(greedy_checker, on_cpu.model, prompts, graphed_out, eager_out)
    graphed.check_integrity()  # padding rows wrote only to the scratch page and slot
    bf16 = load_model(str(checkpoint), torch.bfloat16, torch.device("cuda"))
    fp8 = engine_factory(bf16, page_size=8, device="cuda", kv_cache_dtype="fp8", cuda_graph_max_batch=8)
    assert fp8.graphs is not None
    assert all(len(o.token_ids) == 16 for o in engine_runner(fp8, prompts, GREEDY))
    assert fp8.graphs.replays > 0


def test_verify_graphs_give_the_plain_greedy_output(checkpoint, engine_runner):
    loaded = load_model(str(checkpoint), torch.float32, torch.device("cuda"))
    options = dict(device="cuda", kv_cache_tokens=8192, page_size=8, chunk_size=64, cuda_graph_max_batch=8)
    rng = random.Random(2)
    prompts = [[rng.randrange(1024) for _ in range(rng.randint(20, 60))] for _ in range(4)]
    plain = Engine(EngineConfig(**options, enable_prefix_cache=False), loaded)
    expected = [o.token_ids for o in engine_runner(plain, prompts, GREEDY)]
    oracle = [p + e for p, e in zip(prompts, expected, strict=True)]
    drafter = SyntheticDrafter(0.6, oracle, 1024, seed=0)
    engine = Engine(EngineConfig(**options, spec_width=3), loaded, drafter=drafter)
    assert engine.verify_graphs, "verify CUDA graphs were not captured"
    assert [o.token_ids for o in engine_runner(engine, prompts, GREEDY)] == expected
    assert sum(runner.replays for runner in engine.verify_graphs.values()) > 0
    engine.check_integrity()


def test_mtp_drafts_from_graphs_give_the_plain_greedy_output(checkpoint, engine_runner):
    """`--speculative mtp` with decode, verify and MTP draft graphs (the head reads the trunk's pre-mixer
    streams; its QSA layers take the static path): greedy output equals plain, token for token."""
    loaded = load_model(str(checkpoint), torch.float32, torch.device("cuda"))
    assert loaded.model.mtp is not None
    options = dict(device="cuda", kv_cache_tokens=8192, page_size=8, chunk_size=64, cuda_graph_max_batch=8)
    rng = random.Random(3)
    prompts = [[rng.randrange(1024) for _ in range(rng.randint(20, 60))] for _ in range(4)]
    plain = Engine(EngineConfig(**options, enable_prefix_cache=False), loaded)
    expected = [o.token_ids for o in engine_runner(plain, prompts, GREEDY)]
    engine = Engine(EngineConfig(**options, speculative="mtp", spec_width=3), loaded)
    assert engine.verify_graphs and engine.speculative.drafter.graphs, "verify / draft graphs not captured"
    assert [o.token_ids for o in engine_runner(engine, prompts, GREEDY)] == expected
    assert sum(graphs.replays for graphs in engine.speculative.drafter.graphs.values()) > 0
    engine.check_integrity()


def test_memory_mapped_table_refuses_capture_and_decodes_eagerly(checkpoint, engine_factory, engine_runner):
    """The GPU cannot read a table left in memory-mapped files: capture is refused with a message and
    decode gathers its rows on the host, with the same output as the page-locked table."""
    ram = load_model(str(checkpoint), torch.float32, torch.device("cuda"))
    mapped = load_model(str(checkpoint), torch.float32, torch.device("cuda"), host_table_placement="mmap")
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], list(range(6, 70))]
    engine = engine_factory(mapped, page_size=8, device="cuda")
    assert engine.graphs is None
    reference = engine_factory(ram, page_size=8, device="cuda")
    want = [o.token_ids for o in engine_runner(reference, prompts, GREEDY)]
    assert [o.token_ids for o in engine_runner(engine, prompts, GREEDY)] == want


def test_qsa_kernels_at_real_shapes():
    """Flash-Next's shapes (4 index heads of 128, 24 query heads over 2 K/V heads of 256, budget 2048):
    the Triton block scores and the one-token-page attention against the torch static path."""
    from morion.ops.paged_attention import FP8_KV_DTYPE, store_kv
    from morion.ops.qsa import gather_token_kv, static_block_scores, static_sparse_attention
    from morion.ops.qsa_triton import block_scores, sparse_attention

    generator = torch.Generator(device="cuda").manual_seed(0)
    ratio, page_size, rows = 4, 16, 8
    num_pages, max_pages = 600, 512
    pool = torch.randn(num_pages * page_size // ratio, 128, device="cuda", generator=generator).bfloat16()
    page_table = torch.randint(0, num_pages, (rows, max_pages), device="cuda", generator=generator).int()
    index_q = torch.randn(rows, 4, 128, device="cuda", generator=generator).bfloat16()
    positions = torch.tensor([5, 100, 2047, 2050, 4000, 8191, 8000, 3], device="cuda")
    complete = (positions + 1) // ratio
    keys = pool.view(num_pages, page_size // ratio, 128)[page_table.long()].view(rows, -1, 128)
    expected = static_block_scores(index_q, keys, complete)
    got = block_scores(index_q, pool, page_table, complete, page_size, ratio)
    finite = ~torch.isinf(expected)
    assert torch.equal(finite, ~torch.isinf(got))
    assert torch.allclose(got[finite], expected[finite], atol=1e-3, rtol=1e-3)
    for kv_dtype in (torch.bfloat16, FP8_KV_DTYPE):
        kv = torch.zeros(num_pages * page_size, 2, 2, 256, dtype=kv_dtype, device="cuda")
        store_kv(kv, torch.arange(kv.shape[0], device="cuda"),
                 torch.randn(kv.shape[0], 2, 256, device="cuda", generator=generator),
                 torch.randn(kv.shape[0], 2, 256, device="cuda", generator=generator))  # fmt: skip
        q = torch.randn(rows, 24, 256, device="cuda", generator=generator).bfloat16()
        slots = torch.stack(
            [torch.randperm(kv.shape[0], device="cuda", generator=generator)[:2051] for _ in range(rows)]
        )
        counts = torch.tensor([1, 100, 2048, 2051, 2051, 7, 2050, 4], device="cuda")
        k, v = gather_token_kv(kv, slots)
        want = static_sparse_attention(q, k, v, counts, 256**-0.5)
        got = sparse_attention(q, kv, slots, counts, 256**-0.5)
        assert torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2)
