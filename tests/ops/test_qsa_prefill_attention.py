"""QSA's prefill attention on tensor cores (ops/qsa_prefill_triton.py) and the selection bits it reads
(`qsa_triton.select_block_bits`): the bits are `select_token_slots`' blocks, and the kernel computes what
the static path's torch code computes over the same selection (fp32 and FP8 K/V, compress ratios 2 and
4; sparse, everything selected, rows with no complete block), the same bits however the rows are tiled.
Without a GPU the kernels run under TRITON_INTERPRET=1 (tests/conftest.py); on the H200, at Flash-Next's
shapes, against the split-KV path the engine runs otherwise."""

from __future__ import annotations

import itertools

import pytest
import torch

from morion.ops.paged_attention import FP8_KV_DTYPE, store_kv
from morion.ops.qsa import gather_token_kv, select_blocks, selected_tokens, static_sparse_attention
from morion.ops.qsa_prefill_triton import selected_prefill_attention
from morion.ops.qsa_triton import select_block_bits

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _scores(positions: torch.Tensor, capacity: int, ratio: int, zero_share: float, seed: int) -> torch.Tensor:
    """Random block scores [rows, capacity], a share of them 0 (ties to the lower block), -inf past each
    row's complete blocks (as `block_scores` writes them)."""
    generator = torch.Generator().manual_seed(seed)
    scores = torch.rand(len(positions), capacity, generator=generator)
    scores = torch.where(torch.rand(scores.shape, generator=generator) < zero_share, 0.0, scores)
    complete = (positions + 1) // ratio
    return torch.where(torch.arange(capacity)[None] < complete[:, None], scores, float("-inf"))


def _chosen_blocks(bits: torch.Tensor, complete: int) -> list[int]:
    words = bits.cpu().tolist()
    return [b for b in range(complete) if (words[b // 32] >> (b % 32)) & 1]


@pytest.mark.parametrize(("block_topk", "zero_share"), [(5, 0.5), (40, 0.3), (9, 0.97)])
def test_the_bits_are_the_selection_s_blocks(block_topk, zero_share):
    """Rows with fewer complete blocks than the top-k (all taken), more (the radix select), mostly zero
    scores (ties to the lower block): each row's set bits are the blocks the torch code selects."""
    ratio = 4
    positions = torch.tensor([2, 3, 17, 63, 130, 131, 255, 399])
    capacity = 112
    scores = _scores(positions, capacity, ratio, zero_share, seed=block_topk)
    complete = (positions + 1) // ratio
    bits = select_block_bits(scores.to(DEVICE), complete.to(DEVICE), block_topk)
    assert bits.dtype == torch.int32 and bits.shape == (len(positions), capacity // 32 + (capacity % 32 > 0))
    expected = select_blocks(scores, complete, block_topk, exact_ties=False)
    for row, count in enumerate(complete.tolist()):
        want = sorted(b for b in expected[row].tolist() if 0 <= b < count)
        assert _chosen_blocks(bits[row], count) == want, row


def _case(ratio: int, block_topk: int, first: int, rows: int, kv_dtype: torch.dtype, seed: int):
    """One sequence's queries at positions first .. first + rows - 1 over its pool pages (scattered), with
    random selections: (q, kv, page_row, positions, bits, reference output)."""
    generator = torch.Generator().manual_seed(seed)
    page_size, q_heads, kv_heads, dim = 16, 4, 2, 32
    positions = torch.arange(first, first + rows)
    pages = -(-(first + rows) // page_size)
    page_row = torch.randperm(pages + 7, generator=generator)[:pages].int()
    num_slots = (pages + 7) * page_size
    kv = torch.zeros(num_slots, 2, kv_heads, dim, dtype=kv_dtype)
    k, v = (torch.randn(num_slots, kv_heads, dim, generator=generator) for _ in range(2))
    store_kv(kv, torch.arange(num_slots), k, v, 0.5, 2.0)
    q = torch.randn(rows, q_heads, dim, generator=generator)
    capacity = pages * page_size // ratio
    scores = _scores(positions, capacity, ratio, zero_share=0.3, seed=seed)
    complete = (positions + 1) // ratio
    blocks = select_blocks(scores, complete, block_topk, exact_ties=False)
    tokens, counts = selected_tokens(blocks, complete, positions, ratio)
    slots = page_row.long()[tokens // page_size] * page_size + tokens % page_size
    k_sel, v_sel = gather_token_kv(kv, slots, 0.5, 2.0)
    reference = static_sparse_attention(q, k_sel, v_sel, counts, dim**-0.5)
    bits = select_block_bits(scores.to(DEVICE), complete.to(DEVICE), block_topk)
    on_device = [t.to(DEVICE) for t in (q, kv, page_row, positions)]
    return (*on_device, bits, reference)


@pytest.mark.parametrize("kv_dtype", [torch.float32, FP8_KV_DTYPE])
@pytest.mark.parametrize(
    ("ratio", "block_topk", "first", "rows"),
    [
        (4, 6, 200, 37),  # sparse: 6 of ~50 blocks, three key tiles
        (2, 9, 150, 21),  # ratio 2: 64-key tiles
        (4, 200, 60, 40),  # every complete block selected
        (4, 3, 0, 6),  # short: rows with no complete block, only their tail
    ],
)
def test_the_kernel_computes_the_static_path_s_attention(kv_dtype, ratio, block_topk, first, rows):
    q, kv, page_row, positions, bits, reference = _case(ratio, block_topk, first, rows, kv_dtype, seed=rows)
    out = selected_prefill_attention(q, kv, page_row, positions, bits, ratio, 16, 32**-0.5, 0.5, 2.0)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.cpu(), reference, rtol=2e-5, atol=2e-5)


def test_a_row_s_result_does_not_depend_on_its_tile():
    """The same rows in one call and split into tiles at other points (different neighbours in each
    program, other key tiles skipped or computed): the same bits."""
    q, kv, page_row, positions, bits, _ = _case(4, 5, 300, 48, FP8_KV_DTYPE, seed=11)
    whole = selected_prefill_attention(q, kv, page_row, positions, bits, 4, 16, 0.125, 0.5, 2.0)
    for cuts in ((7, 30), (1, 2, 33, 47), (16,)):
        edges = (0, *cuts, 48)
        parts = [
            selected_prefill_attention(
                q[a:b], kv, page_row, positions[a:b], bits[a:b], 4, 16, 0.125, 0.5, 2.0
            )
            for a, b in itertools.pairwise(edges)
        ]
        assert torch.equal(torch.cat(parts), whole), cuts


def test_bad_bits_are_refused():
    q, kv, page_row, positions, bits, _ = _case(4, 5, 40, 8, torch.float32, seed=2)
    with pytest.raises(ValueError, match="bits must be int32"):
        selected_prefill_attention(q, kv, page_row, positions, bits.long(), 4, 16, 0.125)
    with pytest.raises(ValueError, match="does not fit"):
        selected_prefill_attention(q[:, :3], kv, page_row, positions, bits, 4, 16, 0.125)


@pytest.mark.gpu
def test_on_cuda_at_flash_next_s_shapes_it_agrees_with_the_split_kv_path():
    """1,024 queries at the end of an 8K context, 24 query heads on 2 K/V heads of 256, FP8 K/V, budget
    2,048 in blocks of 4: against the split-KV path over `select_token_slots` (the engine's other prefill
    path), in bf16."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from morion.ops import qsa_triton

    generator = torch.Generator(device="cuda").manual_seed(0)
    ratio, page_size, block_topk, context, rows = 4, 64, 512, 8192, 1024
    pages = context // page_size
    page_row = torch.randperm(pages + 16, device="cuda")[:pages].int()
    num_slots = (pages + 16) * page_size
    kv = torch.zeros(num_slots, 2, 2, 256, dtype=FP8_KV_DTYPE, device="cuda")
    k, v = (torch.randn(num_slots, 2, 256, device="cuda", generator=generator) for _ in range(2))
    store_kv(kv, torch.arange(num_slots, device="cuda"), k, v, 0.05, 0.05)
    q = torch.randn(rows, 24, 256, device="cuda", generator=generator).bfloat16()
    positions = torch.arange(context - rows, context, device="cuda")
    complete = (positions + 1) // ratio
    scores = _scores(positions.cpu(), pages * page_size // ratio, ratio, 0.0, seed=1).cuda()
    table = page_row[None]
    slots, counts = qsa_triton.select_token_slots(
        scores, complete, positions, table, block_topk, ratio, page_size
    )
    expected = qsa_triton.sparse_attention(q, kv, slots, counts, 256**-0.5, 0.05, 0.05).float()
    bits = select_block_bits(scores, complete, block_topk)
    out = selected_prefill_attention(
        q, kv, page_row, positions, bits, ratio, page_size, 256**-0.5, 0.05, 0.05
    )
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)


class _GraphBatchBackend:
    """What a short-chunk CUDA graph's capture gives a layer: query ranges, and no host copy of the
    sequences' lengths (reading them raises, as `PagedAttentionBackend.context_lens` does there)."""

    def __init__(self, lengths: list[int], contexts: list[int] | None = None) -> None:
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        self.query_ranges = list(zip(starts, lengths, strict=True))
        self._contexts = contexts

    @property
    def context_lens(self) -> list[int]:
        if self._contexts is None:
            raise RuntimeError("a replayed forward's batch has no host copy of its sequence lengths")
        return self._contexts


def test_short_pieces_never_read_the_lengths_a_graph_lacks():
    """Under `--qsa-prefill selected` a forward of short pieces (a prompt's tail, which a CUDA graph
    captures) keeps the split-KV kernel without reading the lengths: on the H200 the short graphs'
    capture raised on them and their forwards ran eagerly. Long pieces choose by their context."""
    from morion.layers.qsa_attention import SELECTED_PREFILL_MAX_BUDGETS, QSAAttention

    layer = QSAAttention.__new__(QSAAttention)
    layer.selected_prefill, layer.block_topk, layer.compress_ratio = True, 4, 4
    assert layer._selected_pieces(_GraphBatchBackend([2, 16, 9])) == [False, False, False]
    limit = SELECTED_PREFILL_MAX_BUDGETS * 16
    long = _GraphBatchBackend([17, 40, 3], contexts=[limit, limit + 1, 60])
    assert layer._selected_pieces(long) == [True, False, False]
    layer.selected_prefill = False
    assert layer._selected_pieces(_GraphBatchBackend([40], contexts=[60])) == [False]
