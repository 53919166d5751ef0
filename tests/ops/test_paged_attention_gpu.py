"""Paged attention on the GPU at real shapes: the Triton kernels against the reference (bf16 and FP8 KV),
and the decode step captured in a CUDA graph and replayed with other lengths and page tables."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from morion.ops.paged_attention import FP8_KV_DTYPE, paged_attention_reference, store_kv
from morion.ops.paged_attention_triton import decode_workspace, kv_split_count, paged_attention

pytestmark = pytest.mark.gpu

PAGE_SIZE = 16
# name -> (Hq, Hkv, D)
SHAPES = {"qwen3_next": (16, 2, 256), "llama_8b": (32, 8, 128)}
FP8_SCALE = 1 / 32  # randn * 4 / scale stays well inside the e4m3 range
QUERY_GAIN = 4.0  # sharper softmax than plain randn, so outputs are not all ~0 at long contexts


class Pool(NamedTuple):
    kv_layer: torch.Tensor  # [num_pages * PAGE_SIZE, 2, Hkv, D]
    num_pages: int


def make_pool(num_tokens: int, num_kv_heads: int, head_dim: int, kv_dtype: torch.dtype, seed: int) -> Pool:
    num_pages = -(-num_tokens // PAGE_SIZE) + 8
    generator = torch.Generator("cuda").manual_seed(seed)
    kv = torch.randn(
        num_pages * PAGE_SIZE,
        2,
        num_kv_heads,
        head_dim,
        dtype=torch.bfloat16,
        device="cuda",
        generator=generator,
    )
    if kv_dtype == FP8_KV_DTYPE:
        kv = kv.div_(FP8_SCALE).to(FP8_KV_DTYPE)
    return Pool(kv, num_pages)


def page_table_for(seq_lens: list[int], num_pages: int, width: int, seed: int) -> torch.Tensor:
    """Scattered, non-contiguous pages (a random permutation of the pool), unused entries 0."""
    order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed))
    table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    used = 0
    for b, n in enumerate(seq_lens):
        pages = -(-n // PAGE_SIZE)
        table[b, :pages] = order[used : used + pages].to(torch.int32)
        used += pages
    assert used <= num_pages
    return table.cuda()


def cu_seqlens(query_lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


def assert_matches(ours: torch.Tensor, reference: torch.Tensor, tolerance: float = 2e-2) -> None:
    assert not ours.isnan().any()
    ours, reference = ours.float(), reference.float()
    relative = ((ours - reference).norm() / reference.norm()).item()
    assert relative < tolerance / 2, f"relative error {relative:.3g}"
    torch.testing.assert_close(ours, reference, atol=tolerance, rtol=tolerance)


def scales(kv_dtype: torch.dtype) -> dict[str, float]:
    return {"k_scale": FP8_SCALE, "v_scale": FP8_SCALE} if kv_dtype == FP8_KV_DTYPE else {}


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8_KV_DTYPE], ids=["bf16", "fp8"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("batch", [1, 8, 64])
def test_decode_matches_reference(batch: int, shape: str, kv_dtype: torch.dtype) -> None:
    num_q_heads, num_kv_heads, head_dim = SHAPES[shape]
    lengths = torch.randint(4096, 32769, (batch,), generator=torch.Generator().manual_seed(batch))
    seq_lens = [32768] if batch == 1 else lengths.tolist()
    # Each sequence rounds up to whole pages.
    pool = make_pool(sum(seq_lens) + PAGE_SIZE * batch, num_kv_heads, head_dim, kv_dtype, seed=batch)
    page_table = page_table_for(seq_lens, pool.num_pages, 32768 // PAGE_SIZE, seed=batch)
    q = QUERY_GAIN * torch.randn(batch, num_q_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    args = (q, pool.kv_layer, page_table, cu_seqlens([1] * batch), torch.tensor(seq_lens).int().cuda())
    scale = head_dim**-0.5
    out = paged_attention(*args, PAGE_SIZE, scale, max_query_len=1, **scales(kv_dtype))
    assert_matches(out, paged_attention_reference(*args, PAGE_SIZE, scale, **scales(kv_dtype)))


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8_KV_DTYPE], ids=["bf16", "fp8"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_verify_shaped_queries_on_split_kv_match_reference_and_the_extend_kernel(
    shape: str, kv_dtype: torch.dtype
) -> None:
    """Speculative verify: 4, 8 and 16 tokens per sequence over 1K to 33K keys, on the split-KV kernels
    (the default up to MAX_SPLIT_QUERY_LEN) and on the extend kernel; prints both kernels' time for four
    tokens over 1K keys at one sequence, inside a CUDA graph (run with -s)."""
    num_q_heads, num_kv_heads, head_dim = SHAPES[shape]
    seq_lens, query_lens = [1028, 32773, 5000], [4, 16, 8]
    pool = make_pool(sum(seq_lens) + 3 * PAGE_SIZE, num_kv_heads, head_dim, kv_dtype, seed=5)
    page_table = page_table_for(seq_lens, pool.num_pages, 34000 // PAGE_SIZE, seed=5)
    q = QUERY_GAIN * torch.randn(sum(query_lens), num_q_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    args = (q, pool.kv_layer, page_table, cu_seqlens(query_lens), torch.tensor(seq_lens).int().cuda())
    scale = head_dim**-0.5
    reference = paged_attention_reference(*args, PAGE_SIZE, scale, **scales(kv_dtype))
    split = paged_attention(*args, PAGE_SIZE, scale, max_query_len=16, **scales(kv_dtype))
    assert_matches(split, reference)
    assert_matches(
        paged_attention(*args, PAGE_SIZE, scale, max_query_len=16, split_kv=False, **scales(kv_dtype)),
        reference,
    )

    one = (q[:4], pool.kv_layer, page_table[:1], cu_seqlens([4]), torch.tensor(seq_lens[:1]).int().cuda())
    out, times = torch.empty_like(q[:4]), {}
    for split_kv in (True, False):
        options = dict(max_query_len=4, split_kv=split_kv, out=out, **scales(kv_dtype))
        paged_attention(*one, PAGE_SIZE, scale, **options)  # compiles outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # 20 calls per replay: launch cost out of the timing, as in decode
            for _ in range(20):
                paged_attention(*one, PAGE_SIZE, scale, **options)
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times["split-KV" if split_kv else "extend"] = start.elapsed_time(end) * 1e3 / 100
    listed = ", ".join(f"{kernel} {us:.1f} us" for kernel, us in times.items())
    print(f"\nverify, 4 tokens over 1028 keys, {shape} {kv_dtype}: {listed}")


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8_KV_DTYPE], ids=["bf16", "fp8"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_extend_over_paged_prefix_matches_reference(shape: str, kv_dtype: torch.dtype) -> None:
    # Two 1K extends over 2K prefixes, a full 1.5K prefill and a decode row, in one batch.
    num_q_heads, num_kv_heads, head_dim = SHAPES[shape]
    seq_lens, query_lens = [3072, 3072, 1500, 700], [1024, 1024, 1500, 1]
    pool = make_pool(sum(seq_lens), num_kv_heads, head_dim, kv_dtype, seed=3)
    page_table = page_table_for(seq_lens, pool.num_pages, 4096 // PAGE_SIZE, seed=3)
    q = QUERY_GAIN * torch.randn(sum(query_lens), num_q_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    args = (q, pool.kv_layer, page_table, cu_seqlens(query_lens), torch.tensor(seq_lens).int().cuda())
    scale = head_dim**-0.5
    out = paged_attention(*args, PAGE_SIZE, scale, max_query_len=1500, **scales(kv_dtype))
    assert_matches(out, paged_attention_reference(*args, PAGE_SIZE, scale, **scales(kv_dtype)))


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8_KV_DTYPE], ids=["bf16", "fp8"])
def test_decode_cuda_graph_replays_with_new_lengths_and_pages(kv_dtype: torch.dtype) -> None:
    """Capture store_kv + decode once; replay with other seq_lens, page tables (and a sequence without a
    query): the grid and scratch are fixed, so every replay must match the reference."""
    num_q_heads, num_kv_heads, head_dim = SHAPES["qwen3_next"]
    batch, width = 8, 16384 // PAGE_SIZE
    pool = make_pool(batch * 16384, num_kv_heads, head_dim, kv_dtype, seed=5)
    splits = kv_split_count(num_kv_heads, width * PAGE_SIZE, torch.device("cuda"))
    workspace = decode_workspace(batch, num_q_heads, head_dim, splits, torch.device("cuda"))
    static = {
        "q": torch.zeros(batch, num_q_heads, head_dim, dtype=torch.bfloat16, device="cuda"),
        "k": torch.zeros(batch, num_kv_heads, head_dim, dtype=torch.bfloat16, device="cuda"),
        "v": torch.zeros(batch, num_kv_heads, head_dim, dtype=torch.bfloat16, device="cuda"),
        "out_slots": torch.zeros(batch, dtype=torch.int64, device="cuda"),
        "page_table": torch.zeros(batch, width, dtype=torch.int32, device="cuda"),
        "cu": torch.zeros(batch + 1, dtype=torch.int32, device="cuda"),
        "seq_lens": torch.zeros(batch, dtype=torch.int32, device="cuda"),
        "out": torch.zeros(batch, num_q_heads, head_dim, dtype=torch.bfloat16, device="cuda"),
    }
    scale = head_dim**-0.5

    def step() -> None:
        store_kv(pool.kv_layer, static["out_slots"], static["k"], static["v"], **scales(kv_dtype))
        paged_attention(
            static["q"], pool.kv_layer, static["page_table"], static["cu"], static["seq_lens"], PAGE_SIZE,
            scale, max_query_len=1, out=static["out"], workspace=workspace, **scales(kv_dtype),
        )  # fmt: skip

    def load(seq_lens: list[int], query_lens: list[int], seed: int) -> None:
        generator = torch.Generator("cuda").manual_seed(seed)
        table = page_table_for(seq_lens, pool.num_pages, width, seed)
        last = torch.tensor(seq_lens, device="cuda") - 1
        static["page_table"].copy_(table)
        static["seq_lens"].copy_(torch.tensor(seq_lens, dtype=torch.int32))
        static["cu"].copy_(cu_seqlens(query_lens))
        static["out_slots"].copy_(table.long().gather(1, (last // PAGE_SIZE)[:, None])[:, 0] * PAGE_SIZE)
        static["out_slots"].add_(last % PAGE_SIZE)
        for name in ("q", "k", "v"):
            values = torch.randn(static[name].shape, generator=generator, device="cuda")
            static[name].copy_(values * (QUERY_GAIN if name == "q" else 1.0))
        static["out"].zero_()

    load([4096] * batch, [1] * batch, seed=0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    cases = [
        ([1, 17, 4096, 16384, 333, 9000, 64, 12345], [1] * batch),
        ([16384, 2, 700, 5000, 1, 15000, 8191, 129], [1, 1, 1, 0, 1, 1, 1, 1]),
    ]
    for seed, (seq_lens, query_lens) in enumerate(cases, start=1):
        load(seq_lens, query_lens, seed)
        graph.replay()
        torch.cuda.synchronize()
        reference = paged_attention_reference(
            static["q"], pool.kv_layer, static["page_table"], static["cu"], static["seq_lens"], PAGE_SIZE,
            scale, **scales(kv_dtype),
        )  # fmt: skip
        rows = sum(query_lens)
        assert_matches(static["out"][:rows], reference[:rows])
        if rows < batch:
            assert not static["out"][rows:].any()  # rows past the batch are left as they were (zero)


def test_decode_bandwidth_report(record_property) -> None:
    """Not a gate: reports the decode kernel's effective KV bandwidth at B=64, 8K context (run with -s)."""
    num_q_heads, num_kv_heads, head_dim = SHAPES["qwen3_next"]
    batch, context = 64, 8192
    pool = make_pool(batch * context, num_kv_heads, head_dim, torch.bfloat16, seed=7)
    page_table = page_table_for([context] * batch, pool.num_pages, context // PAGE_SIZE, seed=7)
    q = torch.randn(batch, num_q_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    args = (q, pool.kv_layer, page_table, cu_seqlens([1] * batch), torch.full((batch,), context).int().cuda())
    out = torch.empty_like(q)
    workspace = decode_workspace(
        batch, num_q_heads, head_dim, kv_split_count(num_kv_heads, context, q.device), q.device
    )
    for _ in range(3):
        paged_attention(*args, PAGE_SIZE, 0.06, max_query_len=1, out=out, workspace=workspace)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        paged_attention(*args, PAGE_SIZE, 0.06, max_query_len=1, out=out, workspace=workspace)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / 20
    bandwidth = batch * context * 2 * num_kv_heads * head_dim * 2 / seconds / 1e12
    record_property("decode_us", seconds * 1e6)
    record_property("decode_tb_per_s", bandwidth)
    print(
        f"decode B={batch} ctx={context} Hq/Hkv/D=16/2/256 bf16: {seconds * 1e6:.1f} us, {bandwidth:.2f} TB/s"
    )
    assert seconds > 0
