"""QSA's static path (decode and verify steps; ops/qsa.py) against its per-sequence reference, and its CUDA
kernels against the torch code: the block-score kernel, attention through the paged decode kernel with
one-token pages, and the gather of host-table rows by the device. Without a GPU the kernels run under
TRITON_INTERPRET=1 (tests/conftest.py)."""

from __future__ import annotations

import math

import pytest
import torch

from morion.ops.host_gather_triton import device_addresses, gather_host_rows
from morion.ops.paged_attention import FP8_KV_DTYPE, store_kv
from morion.ops.qsa import (
    block_scores,
    gather_token_kv,
    select_blocks,
    select_tokens,
    selected_tokens,
    sparse_attention,
    static_block_scores,
    static_sparse_attention,
    top_blocks,
)
from morion.ops.qsa_triton import block_scores as block_scores_triton
from morion.ops.qsa_triton import sparse_attention as sparse_attention_triton

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_top_blocks_ranks_zero_scores_by_lower_index_on_any_padding():
    scores = torch.tensor([[0.0, 2.0, 0.0, 1.0, 0.0, 3.0, float("-inf"), float("-inf")]])
    assert top_blocks(scores, 4, exact_ties=False).tolist() == [[5, 1, 3, 0]]
    padded = torch.cat([scores, torch.full((1, 57), float("-inf"))], dim=1)
    assert top_blocks(padded, 4, exact_ties=False).tolist() == [[5, 1, 3, 0]]
    # Past the finite entries: -1, not an index of a real block.
    assert top_blocks(scores, 8, exact_ties=False).tolist() == [[5, 1, 3, 0, 2, 4, -1, -1]]
    # -0.0 (and NaN garbage) rank as zeros.
    assert top_blocks(torch.tensor([[-0.0, float("nan"), 0.0]]), 3, exact_ties=False).tolist() == [[0, 1, 2]]


@pytest.mark.parametrize("exact_ties", [True, False])
def test_static_selection_equals_the_reference_per_sequence(exact_ties):
    """Two sequences of three queries each (a verify-shaped step) over their cached block keys: the
    static scores, blocks and tokens against `block_scores` + `select_tokens` of each sequence alone.
    Many blocks score exactly zero (keys opposite to every query: the ties that happen), so ties decide:
    either tie rule gives the very same tokens as the reference told to use it."""
    generator = torch.Generator().manual_seed(0)
    ratio, block_topk, dim, heads, width = 4, 3, 16, 2, 3
    seq_lens = [23, 38]
    max_blocks = 12  # the page table's capacity, past every sequence's blocks
    # Eighths of small integers: every product and sum is exact in fp32, so the batched and the
    # per-sequence matmuls must agree to the bit whatever order either adds in.
    keys = (torch.randn(2, max_blocks, dim, generator=generator) * 8).round() / 8
    zero = torch.rand(2, max_blocks, 1, generator=generator) < 0.6
    keys = torch.where(zero, -keys.abs(), keys)
    index_q = (torch.randn(2 * width, heads, dim, generator=generator) * 8).round().abs() / 8
    positions = torch.tensor([n - width + i for n in seq_lens for i in range(width)])
    num_complete = (positions + 1) // ratio
    scores = static_block_scores(index_q, keys, num_complete)
    assert torch.isinf(scores[0, (seq_lens[0] - width + 1) // ratio :]).all()
    assert (scores == 0).sum() > 10
    blocks = select_blocks(scores, num_complete, block_topk, exact_ties)
    tokens, counts = selected_tokens(blocks, num_complete, positions, ratio)
    for seq, length in enumerate(seq_lens):
        rows = slice(seq * width, seq * width + width)
        num_blocks = length // ratio
        reference_scores = block_scores(index_q[rows], keys[seq, :num_blocks])
        assert torch.equal(scores[rows, :num_blocks], reference_scores)
        expected = select_tokens(reference_scores, length - width, ratio, block_topk, exact_ties)
        for row in range(width):
            want = expected[row][expected[row] >= 0]
            got = tokens[seq * width + row, : counts[seq * width + row]]
            assert sorted(got.tolist()) == sorted(want.tolist()), (seq, row)


def test_selection_without_enough_blocks_takes_them_all_and_the_tail():
    positions = torch.tensor([0, 2, 5, 9])
    num_complete = (positions + 1) // 4
    scores = static_block_scores(torch.ones(4, 1, 8), torch.ones(4, 6, 8), num_complete)
    for exact in (True, False):
        blocks = select_blocks(scores, num_complete, 8, exact)
        tokens, counts = selected_tokens(blocks, num_complete, positions, 4)
        assert counts.tolist() == [1, 3, 6, 10]
        for row, position in enumerate(positions.tolist()):
            assert sorted(tokens[row, : counts[row]].tolist()) == list(range(position + 1))


def _pool(num_slots: int, kv_heads: int, dim: int, kv_dtype: torch.dtype, generator) -> torch.Tensor:
    kv = torch.zeros(num_slots, 2, kv_heads, dim, dtype=kv_dtype, device=DEVICE)
    k = torch.randn(num_slots, kv_heads, dim, generator=generator).to(DEVICE)
    v = torch.randn(num_slots, kv_heads, dim, generator=generator).to(DEVICE)
    store_kv(kv, torch.arange(num_slots, device=DEVICE), k, v, 0.5, 2.0)
    return kv


@pytest.mark.parametrize("kv_dtype", [torch.float32, FP8_KV_DTYPE])
def test_static_attention_equals_the_reference_and_the_kernel(kv_dtype):
    """Rows attending to scattered pool slots: the masked torch attention against the reference's
    gather + mask (`sparse_attention`) and against the paged decode kernel with one-token pages."""
    generator = torch.Generator().manual_seed(1)
    rows, width, q_heads, kv_heads, dim = 5, 11, 4, 2, 32
    kv = _pool(64, kv_heads, dim, kv_dtype, generator)
    q = torch.randn(rows, q_heads, dim, generator=generator).to(DEVICE)
    # Distinct per row, as selected tokens are.
    slots = torch.stack([torch.randperm(64, generator=generator)[:width] for _ in range(rows)]).to(DEVICE)
    counts = torch.tensor([1, 4, 7, 11, 9], device=DEVICE)
    slots = torch.where(torch.arange(width, device=DEVICE)[None] < counts[:, None], slots, 0)
    k, v = gather_token_kv(kv, slots, 0.5, 2.0)
    scale = dim**-0.5
    ours = static_sparse_attention(q, k, v, counts, scale)
    selected = torch.where(torch.arange(width, device=DEVICE)[None] < counts[:, None], slots, -1)
    for row in range(rows):

        def gather(positions, row=row):  # the "sequence" of a row is the pool itself
            return gather_token_kv(kv, positions, 0.5, 2.0)

        reference = sparse_attention(q[row : row + 1], selected[row : row + 1], gather, scale)
        assert torch.allclose(ours[row], reference[0], atol=1e-5, rtol=1e-5)
    kernel = sparse_attention_triton(q, kv, slots, counts, scale, 0.5, 2.0)
    assert torch.allclose(kernel, ours, atol=2e-5, rtol=1e-4)


def test_block_score_kernel_equals_torch():
    """Block keys on scattered pages (rows per page = page_size / ratio), three queries per sequence."""
    generator = torch.Generator().manual_seed(2)
    ratio, page_size, heads, dim, width = 4, 8, 2, 24, 3
    num_pages, max_pages = 10, 4
    pool = torch.randn(num_pages * page_size // ratio, dim + 8, generator=generator).to(DEVICE)  # padded
    page_table = torch.tensor([[3, 7, 1, 0], [9, 2, 5, 8]], dtype=torch.int32, device=DEVICE)
    index_q = torch.randn(2 * width, heads, dim, generator=generator).to(DEVICE)
    positions = torch.tensor([5, 6, 7, 27, 28, 29], device=DEVICE)
    num_complete = (positions + 1) // ratio
    per_page = pool.view(num_pages, page_size // ratio, -1)
    keys = per_page[page_table.long()].view(2, max_pages * page_size // ratio, -1)[..., :dim]
    expected = static_block_scores(index_q, keys, num_complete)
    got = block_scores_triton(index_q, pool, page_table, num_complete, page_size, ratio)
    assert got.shape == expected.shape == (6, 8)
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    finite = ~torch.isinf(expected)
    assert torch.allclose(got[finite], expected[finite], atol=1e-5, rtol=1e-5)
    assert math.isclose(float(got[0, 0]), float(expected[0, 0]), rel_tol=1e-5)


def test_host_rows_gathered_by_the_device():
    """Shards addressed by their base addresses (page-locked host memory on CUDA; any CPU tensor in the
    interpreter), rows of any byte width, the last shard shorter."""
    generator = torch.Generator().manual_seed(3)
    shard_rows, dim = 7, 5
    shards = [torch.randn(n, dim, generator=generator) for n in (7, 7, 3)]
    pointers = [s.data_ptr() for s in shards]
    if DEVICE.type == "cuda":
        shards = [s.pin_memory() for s in shards]
        pointers = device_addresses(shards, DEVICE)
    addresses = torch.tensor(pointers, dtype=torch.int64, device=DEVICE)
    rows = torch.tensor([0, 16, 7, 13, 6, 15, 15], device=DEVICE)
    got = gather_host_rows(rows, addresses, shard_rows, dim * 4).view(torch.float32)
    assert torch.equal(got.cpu(), torch.cat(shards)[rows.cpu()])


def _torch_token_slots(scores, num_complete, positions, page_table, block_topk, ratio, page_size):
    """The torch code's slots and counts (select_blocks without exact ties, selected_tokens, the table)."""
    blocks = select_blocks(scores, num_complete, block_topk, exact_ties=False)
    tokens, counts = selected_tokens(blocks, num_complete, positions, ratio)
    sequence = torch.arange(scores.shape[0], device=scores.device) // (scores.shape[0] // page_table.shape[0])
    pages = page_table.long()[sequence[:, None], tokens // page_size]
    return pages * page_size + tokens % page_size, counts


@pytest.mark.parametrize("rows_per_seq", [1, 3])
def test_the_selection_kernel_takes_the_torch_code_s_tokens_as_slots(rows_per_seq):
    """Rows with fewer complete blocks than the top-k (all taken), more (a radix select), many zero
    scores (ties to the lower block) and the table's full capacity: the same slots as the torch code,
    the chosen blocks in ascending order; padding to the width is token 0's slot, as there."""
    from morion.ops.qsa_triton import select_token_slots

    generator = torch.Generator().manual_seed(7)
    ratio, page_size, block_topk, pages = 4, 16, 5, 6
    capacity = pages * page_size // ratio  # 24 blocks
    num_seqs = 4
    ends = torch.tensor([3, 18, 61, capacity * ratio - 1])  # 0, 4, 15 and 24 complete blocks at the end
    positions = torch.stack([ends - rows_per_seq + 1 + i for i in range(rows_per_seq)], dim=1).flatten()
    positions = positions.clamp(min=0)
    num_complete = (positions + 1) // ratio
    page_table = torch.randperm(40, generator=generator)[: num_seqs * pages].view(num_seqs, pages).int()
    scores = torch.rand(len(positions), capacity, generator=generator)
    # The third sequence mostly zeros: fewer positive scores than the top-k, so zeros fill it by index.
    zero_share = torch.tensor([0.5, 0.5, 0.9, 0.5]).repeat_interleave(rows_per_seq)[:, None]
    scores = torch.where(torch.rand(scores.shape, generator=generator) < zero_share, 0.0, scores)
    assert ((scores[2 * rows_per_seq] > 0).sum() < block_topk).item()
    blocks = torch.arange(capacity)
    scores = torch.where(blocks[None, :] < num_complete[:, None], scores, float("-inf"))
    args = (num_complete, positions, page_table, block_topk, ratio, page_size)
    slots, counts = select_token_slots(scores.to(DEVICE), *(a.to(DEVICE) for a in args[:3]), *args[3:])
    want_slots, want_counts = _torch_token_slots(scores, *args)
    assert slots.dtype == counts.dtype == torch.int32 and slots.shape == want_slots.shape
    assert torch.equal(counts.cpu().long(), want_counts)
    for row, count in enumerate(want_counts.tolist()):
        assert sorted(slots[row, :count].tolist()) == sorted(want_slots[row, :count].tolist()), row
        assert torch.equal(slots[row, count:].cpu().long(), want_slots[row, count:]), row
        chosen = min(block_topk, int(num_complete[row])) * ratio  # blocks ascend: their first slots do
        firsts = [int(s) for s in slots[row, :chosen:ratio].cpu()]
        tokens = [page_table[row // rows_per_seq].tolist().index(s // page_size) * page_size + s % page_size
                  for s in firsts]  # fmt: skip
        assert tokens == sorted(tokens), row


def test_a_row_s_selection_and_attention_do_not_depend_on_the_page_table_s_width():
    """The same rows over the batch's own page table (an eager step) and over a graph's wider one (its
    capacity, the extra blocks -inf): the same slots, of one width, and the same attention to the bit, on
    both paths. The width once followed the table, and the split-KV attention split a row's keys by it:
    Flash-Next's replayed prompt tails parted from its eager ones (session 22)."""
    from morion.ops.qsa_triton import select_token_slots

    generator = torch.Generator().manual_seed(5)
    ratio, page_size, block_topk, pages, wide_pages = 4, 16, 128, 6, 40
    positions = torch.tensor([86, 87, 88])
    num_complete = (positions + 1) // ratio
    table = torch.randperm(64, generator=generator)[:wide_pages].view(1, wide_pages).int()
    kv = _pool(64 * page_size, 1, 32, FP8_KV_DTYPE, generator)
    q = torch.randn(len(positions), 4, 32, generator=generator).to(DEVICE)
    scores = torch.rand(len(positions), wide_pages * page_size // ratio, generator=generator)
    scores = torch.where(torch.arange(scores.shape[1])[None] < num_complete[:, None], scores, float("-inf"))
    results = {}
    for width in (pages, wide_pages):
        narrow = scores[:, : width * page_size // ratio].contiguous()
        args = (num_complete, positions, table[:, :width].contiguous())
        slots, counts = select_token_slots(
            narrow.to(DEVICE), *(a.to(DEVICE) for a in args), block_topk, ratio, page_size
        )
        kernel = sparse_attention_triton(q, kv, slots, counts, 0.125, 0.5, 2.0)
        torch_slots, torch_counts = _torch_token_slots(narrow, *args, block_topk, ratio, page_size)
        k, v = gather_token_kv(kv, torch_slots.to(DEVICE), 0.5, 2.0)
        ours = static_sparse_attention(q, k, v, torch_counts.to(DEVICE), 0.125)
        results[width] = slots.shape[1], torch_slots.shape[1], kernel, ours
    (eager_width, eager_torch_width, eager_kernel, eager_ours) = results[pages]
    (graph_width, graph_torch_width, graph_kernel, graph_ours) = results[wide_pages]
    assert (
        eager_width == graph_width == eager_torch_width == graph_torch_width == block_topk * ratio + ratio - 1
    )
    assert torch.equal(eager_kernel, graph_kernel)
    assert torch.equal(eager_ours, graph_ours)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_block_key_kernel_writes_the_indexer_s_keys_of_the_blocks_a_step_completes(dtype):
    """Tokens of one forward, some completing their block: each completed block's row gets
    `keys_of_blocks` of its raw keys (mean, k norm, RoPE at the block's first position); other rows stay.
    Both index heads' paths through the same norm and RoPE code as the q/k kernel."""
    from morion.layers.qsa_attention import QSAIndexer
    from morion.layers.rotary import RotaryEmbedding, apply_rotary
    from morion.ops.qk_norm_rope_triton import norm_rope
    from morion.ops.qsa_triton import store_block_keys_

    generator = torch.Generator().manual_seed(11)
    ratio, dim, rotary_dim, slots = 4, 40, 16, 64
    indexer = QSAIndexer(32, 2, dim, 1e-6)
    indexer.k_layernorm.weight.data = torch.randn(dim, generator=generator) * 0.1
    indexer.q_layernorm.weight.data = torch.randn(dim, generator=generator) * 0.1
    indexer = indexer.to(DEVICE, dtype)
    raw_keys = torch.randn(slots, dim, generator=generator).to(DEVICE, dtype)
    key_rows = torch.randn(slots // ratio, ratio * 10, generator=generator).to(DEVICE, dtype)
    before = key_rows.clone()
    positions = torch.tensor([3, 4, 10, 11, 19, 30], device=DEVICE)  # 3, 11, 19 complete their blocks
    out_slots = torch.tensor([7, 8, 22, 23, 35, 50], device=DEVICE)  # pages hold whole blocks
    rotary = RotaryEmbedding(rotary_dim, {"rope_type": "default", "rope_theta": 10000.0})
    block_cos, block_sin = rotary(positions - positions % ratio)
    norm = indexer.k_layernorm
    store_block_keys_(
        raw_keys, key_rows, out_slots, positions, block_cos, block_sin, norm.weight, norm.eps, ratio
    )
    tolerance = {torch.float32: 1e-6, torch.float16: 2e-3}[dtype]
    completed = {int(s) // ratio: i for i, s in enumerate(out_slots) if (positions[i] + 1) % ratio == 0}
    for block in range(slots // ratio):
        if block not in completed:
            assert torch.equal(key_rows[block], before[block]), block
            continue
        row = completed[block]
        raw = raw_keys[block * ratio : block * ratio + ratio][None]
        want = indexer.keys_of_blocks(raw, block_cos[row : row + 1], block_sin[row : row + 1])[0]
        torch.testing.assert_close(key_rows[block, :dim], want, rtol=tolerance, atol=tolerance)
        assert torch.equal(key_rows[block, dim:], before[block, dim:])
    # The index queries' norm and RoPE through the same head code.
    q = torch.randn(6, 2, dim, generator=generator).to(DEVICE, dtype)
    cos, sin = rotary(positions)
    eager = apply_rotary(indexer.q_layernorm(q), cos, sin)
    got = norm_rope(q, indexer.q_layernorm.weight, indexer.q_layernorm.eps, cos, sin)
    torch.testing.assert_close(got, eager, rtol=tolerance, atol=tolerance)
