"""Paged attention at small shapes: the reference against dense attention, store_kv, and the Triton
kernels against the reference. Without a GPU the kernels run under TRITON_INTERPRET=1 (set by
tests/conftest.py; fp32 and fp16 only, as bf16 tl.dot is broken there); with one they run on it."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from morion.ops.fp8 import FP8_MAX
from morion.ops.paged_attention import FP8_KV_DTYPE, paged_attention_reference, store_kv
from morion.ops.paged_attention_triton import (
    _INTERPRET,
    MAX_SPLIT_QUERY_LEN,
    decode_workspace,
    kv_split_count,
    paged_attention,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


class PagedBatch(NamedTuple):
    q: torch.Tensor  # [T, Hq, D]
    kv_layer: torch.Tensor  # [slots, 2, Hkv, D]
    page_table: torch.Tensor  # [B, max_pages] int32
    cu_seqlens_q: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    page_size: int
    keys: list[torch.Tensor]  # per sequence [seq_len, Hkv, D] fp32, as given to store_kv
    values: list[torch.Tensor]

    @property
    def max_query_len(self) -> int:
        return int((self.cu_seqlens_q[1:] - self.cu_seqlens_q[:-1]).max())


def make_batch(
    seq_lens: list[int],
    query_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype = torch.float32,
    kv_dtype: torch.dtype | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    seed: int = 0,
    device: torch.device = DEVICE,
) -> PagedBatch:
    """Sequences on scattered pages of a pool whose unused slots hold NaN, with unused page-table
    entries pointing at a NaN page: a kernel that reads past a sequence's keys gives NaN."""
    generator = torch.Generator().manual_seed(seed)
    kv_dtype = kv_dtype or dtype
    max_pages = max(-(-n // page_size) for n in seq_lens) + 2
    num_pages = len(seq_lens) * max_pages + 3
    order = torch.randperm(num_pages, generator=generator)
    poison_page = int(order[-1])
    page_table = torch.full((len(seq_lens), max_pages), poison_page, dtype=torch.int32)
    kv_layer = torch.empty(num_pages * page_size, 2, num_kv_heads, head_dim, dtype=kv_dtype)
    if kv_dtype == FP8_KV_DTYPE:
        kv_layer.view(torch.uint8).fill_(0x7F)  # e4m3fn NaN
    else:
        kv_layer.fill_(float("nan"))
    keys, values = [], []
    next_page = 0
    for b, n in enumerate(seq_lens):
        used = -(-n // page_size)
        page_table[b, :used] = order[next_page : next_page + used].to(torch.int32)
        next_page += used
        positions = torch.arange(n)
        slots = page_table[b].long()[positions // page_size] * page_size + positions % page_size
        k = torch.randn(n, num_kv_heads, head_dim, generator=generator)
        v = torch.randn(n, num_kv_heads, head_dim, generator=generator)
        store_kv(kv_layer, slots, k, v, k_scale, v_scale)
        keys.append(k)
        values.append(v)
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), num_q_heads, head_dim, generator=generator).to(dtype)
    seq_lens_tensor = torch.tensor(seq_lens, dtype=torch.int32)
    on_device = (t.to(device) for t in (q, kv_layer, page_table, cu, seq_lens_tensor))
    return PagedBatch(*on_device, page_size, keys, values)


def run_reference(batch: PagedBatch, scale: float, k_scale: float = 1.0, v_scale: float = 1.0):
    return paged_attention_reference(
        batch.q, batch.kv_layer, batch.page_table, batch.cu_seqlens_q, batch.seq_lens, batch.page_size,
        scale, k_scale, v_scale,
    )  # fmt: skip


def run_triton(batch: PagedBatch, scale: float, k_scale: float = 1.0, v_scale: float = 1.0, **options):
    return paged_attention(
        batch.q, batch.kv_layer, batch.page_table, batch.cu_seqlens_q, batch.seq_lens, batch.page_size,
        scale, max_query_len=options.pop("max_query_len", batch.max_query_len), k_scale=k_scale,
        v_scale=v_scale, **options,
    )  # fmt: skip


def dense_causal_attention(q, k, v, scale):
    """q [Tq, Hq, D] at the last Tq positions of k, v [Tk, Hkv, D]; float64 softmax(QK^T)V."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    q_pos = torch.arange(k.shape[0] - q.shape[0], k.shape[0])[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3}


def assert_close(ours: torch.Tensor, reference: torch.Tensor, atol: float) -> None:
    assert ours.shape == reference.shape
    assert not ours.isnan().any(), "NaN in the output"
    if ours.numel() == 0:
        return
    error = (ours.float() - reference.float()).abs().max().item()
    assert error <= atol, f"max abs error {error:.3g} > {atol:.3g}"


# --- the reference and store_kv ---------------------------------------------------------------------


def test_reference_matches_dense_causal_attention() -> None:
    # Full prefill, prefill over a cached prefix, a decode row, a sequence without rows; GQA 3:1.
    batch = make_batch([9, 13, 6, 5], [9, 4, 1, 0], 6, 2, head_dim=8, page_size=4, device=torch.device("cpu"))
    out = run_reference(batch, scale=0.4)
    bounds = batch.cu_seqlens_q.tolist()
    for b in range(4):
        rows = slice(bounds[b], bounds[b + 1])
        expected = dense_causal_attention(batch.q[rows], batch.keys[b], batch.values[b], 0.4)
        assert_close(out[rows], expected, 1e-5)


def test_reference_dequantizes_fp8_pools() -> None:
    kwargs = dict(num_q_heads=4, num_kv_heads=2, head_dim=8, page_size=4, kv_dtype=FP8_KV_DTYPE, device="cpu")
    batch = make_batch([11], [3], k_scale=0.25, v_scale=2.0, **kwargs)
    out = run_reference(batch, 0.3, k_scale=0.25, v_scale=2.0)
    k = (batch.keys[0] / 0.25).to(FP8_KV_DTYPE).float() * 0.25
    v = (batch.values[0] / 2.0).to(FP8_KV_DTYPE).float() * 2.0
    assert_close(out, dense_causal_attention(batch.q, k, v, 0.3), 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_kv_writes_only_its_slots(dtype: torch.dtype) -> None:
    kv_layer = torch.zeros(10, 2, 2, 4, dtype=dtype)
    k, v = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    slots = torch.tensor([7, 2, 5])
    store_kv(kv_layer, slots, k, v, k_scale=3.0, v_scale=5.0)  # scales are ignored for non-fp8 pools
    assert torch.equal(kv_layer[slots, 0], k.to(dtype))
    assert torch.equal(kv_layer[slots, 1], v.to(dtype))
    others = torch.tensor([i for i in range(10) if i not in (7, 2, 5)])
    assert not kv_layer[others].any()


def test_store_kv_fp8_divides_by_the_scale_and_clamps() -> None:
    kv_layer = torch.zeros(6, 2, 1, 4, dtype=FP8_KV_DTYPE)
    k = torch.tensor([[[1.0, -2.5, 1000.0, -1e6]], [[0.01, 0.0, 3.0, 7.0]]])
    v = torch.tensor([[[1e6, 0.5, -0.5, 2.0]], [[-3.0, 4.0, 8.0, 0.125]]])
    store_kv(kv_layer, torch.tensor([4, 1]), k, v, k_scale=0.5, v_scale=4.0)
    stored_k = kv_layer[[4, 1], 0].float()
    stored_v = kv_layer[[4, 1], 1].float()
    assert not stored_k.isnan().any() and not stored_v.isnan().any()
    # Out-of-range values saturate at the largest e4m3 value instead of becoming NaN.
    assert stored_k[0, 0, 2] == FP8_MAX and stored_k[0, 0, 3] == -FP8_MAX
    assert stored_v[0, 0, 0] == FP8_MAX
    in_range = (k / 0.5).abs() <= FP8_MAX
    assert torch.allclose(stored_k[in_range], (k / 0.5)[in_range], rtol=1 / 16, atol=1e-2)
    assert torch.allclose(stored_v[1], v[1] / 4.0, rtol=1 / 16)


# --- decode (split-KV) ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(4, 4), (8, 2)])
@pytest.mark.parametrize("num_kv_splits", [None, 1, 5])
def test_decode_matches_reference(dtype, num_q_heads, num_kv_heads, num_kv_splits) -> None:
    # seq_len 1 (all splits but one empty), lengths off the page (4) and key-block (16) grid, a sequence
    # without a query this step.
    batch = make_batch(
        [1, 7, 37, 64, 20], [1, 1, 1, 1, 0], num_q_heads, num_kv_heads, head_dim=16, page_size=4, dtype=dtype
    )
    out = run_triton(batch, 0.25, num_kv_splits=num_kv_splits)
    assert out.dtype == dtype
    assert_close(out, run_reference(batch, 0.25), TOLERANCE[dtype])


def test_decode_head_dim_not_a_power_of_two() -> None:
    batch = make_batch([30, 5], [1, 1], num_q_heads=6, num_kv_heads=2, head_dim=24, page_size=16)
    assert_close(run_triton(batch, 0.2, num_kv_splits=2), run_reference(batch, 0.2), 2e-5)


def test_decode_workspace_is_reused_across_new_lengths_and_pages() -> None:
    """What a CUDA-graph replay does: same shapes, workspace and output; new lengths and page tables."""
    shape = dict(num_q_heads=8, num_kv_heads=2, head_dim=16, page_size=4)
    first = make_batch([40, 3, 17], [1, 1, 1], seed=1, **shape)
    second = make_batch([2, 45, 9], [1, 0, 1], seed=2, **shape)
    workspace = decode_workspace(3, 8, 16, 4, DEVICE)
    out = torch.full_like(first.q, 7.0)
    run_triton(first, 0.3, workspace=workspace, out=out)
    assert_close(out, run_reference(first, 0.3), 2e-5)
    out_second = torch.full_like(second.q, 7.0)
    run_triton(second, 0.3, workspace=workspace, out=out_second)
    assert_close(out_second, run_reference(second, 0.3), 2e-5)


# --- extend / prefill over a paged prefix ------------------------------------------------------------


# Full prefill (no prefix), prefill of 11 over a 29-token prefix, a decode row inside an extend batch, a
# one-token sequence, a sequence without rows, a prefill shorter than the query block.
EXTEND_SEQ_LENS = [23, 40, 9, 1, 30, 12]
EXTEND_QUERY_LENS = [23, 11, 1, 1, 0, 12]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(4, 4), (8, 2), (6, 2)])
def test_extend_matches_reference(dtype, num_q_heads, num_kv_heads) -> None:
    batch = make_batch(
        EXTEND_SEQ_LENS, EXTEND_QUERY_LENS, num_q_heads, num_kv_heads, head_dim=16, page_size=4, dtype=dtype
    )
    out = run_triton(batch, 0.25, split_kv=False)
    assert_close(out, run_reference(batch, 0.25), TOLERANCE[dtype])


def test_extend_long_prefill_page_size_16_head_dim_24() -> None:
    # Several query blocks per sequence and the unmasked prefix loop; D not a power of two.
    batch = make_batch([70, 45], [70, 33], num_q_heads=2, num_kv_heads=1, head_dim=24, page_size=16)
    assert_close(run_triton(batch, 0.2), run_reference(batch, 0.2), 2e-5)


def test_extend_maps_blocks_to_sequences_in_a_large_batch() -> None:
    # 20 sequences (the block -> sequence map spans more than 16 entries), many short or without rows.
    generator = torch.Generator().manual_seed(3)
    query_lens = torch.randint(0, 4, (20,), generator=generator).tolist()
    seq_lens = [q + int(torch.randint(0, 9, (1,), generator=generator)) + 1 for q in query_lens]
    query_lens[7] = 2
    batch = make_batch(seq_lens, query_lens, num_q_heads=2, num_kv_heads=1, head_dim=16, page_size=4)
    assert_close(run_triton(batch, 0.3), run_reference(batch, 0.3), 2e-5)


@pytest.mark.parametrize("split_kv", [True, False], ids=["split-kv", "extend-kernel"])
def test_short_extends_leave_rows_outside_the_batch_untouched(split_kv: bool) -> None:
    batch = make_batch([12, 6], [5, 6], num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=4)
    padded_q = torch.cat([batch.q, torch.randn(3, 4, 16, device=DEVICE)])
    out = torch.full_like(padded_q, 7.0)
    paged_attention(
        padded_q, batch.kv_layer, batch.page_table, batch.cu_seqlens_q, batch.seq_lens, 4, 0.3,
        max_query_len=6, out=out, split_kv=split_kv,
    )  # fmt: skip
    assert_close(out[:11], run_reference(batch, 0.3), 2e-5)
    assert (out[11:] == 7.0).all()


# --- short extends (speculative verify) on the split-KV kernels -----------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(8, 1), (8, 2), (6, 2), (4, 4)])
@pytest.mark.parametrize("num_kv_splits", [1, 5])
def test_short_extends_on_the_split_kv_kernels_match_reference(
    dtype, num_q_heads, num_kv_heads, num_kv_splits
) -> None:
    # Verify-shaped queries: 4 tokens over 62 cached keys, whose last split (16-key blocks under the
    # interpreter, 5 splits: keys 64..65) starts past the first two tokens' positions, so their rows see
    # no key there; the longest split-KV query (16 tokens, several query blocks); a decode row; a sequence
    # without rows; a whole short prompt.
    batch = make_batch(
        [66, 40, 9, 30, 3], [4, 16, 1, 0, 3], num_q_heads, num_kv_heads, head_dim=16, page_size=4, dtype=dtype
    )
    out = run_triton(batch, 0.25, num_kv_splits=num_kv_splits, split_kv=True)
    assert_close(out, run_reference(batch, 0.25), TOLERANCE[dtype])


def test_query_length_picks_the_kernel(monkeypatch) -> None:
    from morion.ops import paged_attention_triton as module

    launched = []
    real_launch = module.launch_kernel
    monkeypatch.setattr(
        module, "launch_kernel", lambda kernel, *args: launched.append(kernel) or real_launch(kernel, *args)
    )
    for query_len in (1, MAX_SPLIT_QUERY_LEN, MAX_SPLIT_QUERY_LEN + 1):
        batch = make_batch([40], [query_len], num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=4)
        assert_close(run_triton(batch, 0.3), run_reference(batch, 0.3), 2e-5)
    assert launched == [module._split_kernel, module._split_kernel, module._extend_kernel]


# --- FP8 KV ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("query_lens", [[1, 1, 0], [9, 1, 4]], ids=["decode", "extend"])
def test_fp8_kv_matches_reference_on_the_same_pool(dtype, query_lens) -> None:
    scales = dict(k_scale=0.25, v_scale=2.0)
    batch = make_batch(
        [33, 5, 18], query_lens, num_q_heads=8, num_kv_heads=2, head_dim=16, page_size=4, dtype=dtype,
        kv_dtype=FP8_KV_DTYPE, **scales,
    )  # fmt: skip
    options = {"num_kv_splits": 3} if max(query_lens) == 1 else {}
    out = run_triton(batch, 0.3, **scales, **options)
    reference = run_reference(batch, 0.3, **scales)
    assert_close(out, reference, TOLERANCE[dtype] * 2)  # the outputs are ~v_scale times larger


# --- host-side behaviour ---------------------------------------------------------------------------------


def test_kv_split_count_depends_only_on_static_sizes() -> None:
    cpu = torch.device("cpu")
    assert kv_split_count(2, 32768, cpu) == 2  # about 4 programs for one sequence (1 "SM" on the CPU)
    assert kv_split_count(8, 32768, cpu) == 1
    assert kv_split_count(1, 100, cpu) == 1  # short contexts are not split finely


def test_a_sequences_result_does_not_depend_on_its_batch_at_a_fixed_split_count() -> None:
    """The split-KV contract the engine relies on (a restored prefix must answer as the cold run did): at
    one split count, a sequence's output is bitwise the same alone, beside other sequences, and under a
    wider page table (a CUDA graph's is as wide as the longest context)."""
    heads = {"num_q_heads": 4, "num_kv_heads": 2, "head_dim": 16, "page_size": 4}
    lone = make_batch([37], [3], **heads, seed=11)
    others = make_batch([9, 50], [1, 2], **heads, seed=12)
    lone_pages = lone.kv_layer.shape[0] // lone.page_size
    width = lone.page_table.shape[1] + others.page_table.shape[1] + 8
    page_table = torch.full((3, width), int(lone.page_table[0, -1]), dtype=torch.int32, device=DEVICE)
    page_table[0, : others.page_table.shape[1]] = others.page_table[0] + lone_pages
    page_table[1, : lone.page_table.shape[1]] = lone.page_table[0]
    page_table[2, : others.page_table.shape[1]] = others.page_table[1] + lone_pages
    q_rows = [others.q[:1], lone.q, others.q[1:]]
    crowd = lone._replace(
        q=torch.cat(q_rows),
        kv_layer=torch.cat([lone.kv_layer, others.kv_layer]),
        page_table=page_table,
        cu_seqlens_q=torch.tensor([0, 1, 4, 6], dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor([9, 37, 50], dtype=torch.int32, device=DEVICE),
    )
    splits = kv_split_count(heads["num_kv_heads"], width * lone.page_size, torch.device("cpu")) + 2
    alone = run_triton(lone, 0.3, num_kv_splits=splits)
    together = run_triton(crowd, 0.3, num_kv_splits=splits)
    assert torch.equal(together[1:4], alone)
    assert_close(alone, run_reference(lone, 0.3), TOLERANCE[torch.float32])


def test_rejects_inconsistent_shapes() -> None:
    batch = make_batch([5], [1], num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=4)
    with pytest.raises(ValueError, match="does not fit"):
        paged_attention(
            batch.q[..., :8], batch.kv_layer, batch.page_table, batch.cu_seqlens_q, batch.seq_lens, 4, 1.0,
            max_query_len=1,
        )  # fmt: skip
    with pytest.raises(ValueError, match="number of sequences"):
        paged_attention(
            batch.q, batch.kv_layer, batch.page_table, batch.cu_seqlens_q[:1], batch.seq_lens, 4, 1.0,
            max_query_len=1,
        )  # fmt: skip
    if _INTERPRET:
        with pytest.raises(NotImplementedError, match="bf16"):
            run_triton(batch._replace(q=batch.q.bfloat16()), 1.0)
    with pytest.raises(ValueError, match="workspace"):
        run_triton(batch, 1.0, workspace=decode_workspace(1, 4, 16, 3, DEVICE), num_kv_splits=2)


def test_scales_are_ignored_for_non_fp8_pools() -> None:
    batch = make_batch([21, 6], [4, 1], num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=4)
    scales = dict(k_scale=0.25, v_scale=2.0)
    plain = run_reference(batch, 0.3)
    assert torch.equal(run_reference(batch, 0.3, **scales), plain)
    assert_close(run_triton(batch, 0.3, **scales), plain, 2e-5)


def test_launch_falls_back_to_one_stage_when_shared_memory_runs_out(caplog) -> None:
    from triton.runtime.errors import OutOfResources

    from morion.ops import paged_attention_triton as module

    launches = []

    class FakeKernel:
        __name__ = "fake_kernel"

        def __getitem__(self, grid):
            def run(*args, num_warps, num_stages, **meta):
                launches.append(num_stages)
                if num_stages > 1:
                    raise OutOfResources(300_000, 232_448, "shared memory")

            return run

    config = module.KernelConfig(64, 64, 8, 3)
    module.launch_kernel(FakeKernel(), (1,), (), {"BLOCK": 64}, config, ("key",))
    module.launch_kernel(FakeKernel(), (1,), (), {"BLOCK": 64}, config, ("key",))
    assert launches == [3, 1, 1]  # the second launch goes straight to one stage
    assert "using 1 stage" in caplog.text
