"""QSA's static path on CUDA (see `morion.ops.qsa` for the rule and its torch reference).

- `block_scores`: one program per (query row, tile of BLOCK_B blocks) reads the tile's cached block keys
  straight from the pool through the sequence's page table (each page holds page_size / ratio block keys,
  consecutive) and writes sum_h relu(q_h . key) / sqrt(Di), or -inf past the row's complete blocks. The
  grid covers the page table's whole block capacity (a static shape); tiles past a row's complete blocks
  load nothing (masked), so the bytes read follow the real context.
- `select_token_slots`: one program per query row takes the row's top-k blocks (the rule of
  `qsa.select_blocks` without exact ties: positive scores first, then zero scores by lower block index;
  equal positive scores also by lower index) by an 8-pass radix select over the rank keys of its complete
  blocks only, then writes the flat pool slots of their tokens (blocks in ascending order) and of the
  unfinished block's tail, as `qsa.selected_tokens` and the page-table lookup after it do, in one kernel.
  Its loops run over the row's complete blocks, not the table's capacity: a 1K-token context costs a
  few hundred entries where torch.topk over the capacity (65,536 blocks at 256K tokens) took 83 us a
  layer on the H200 (`results/2026-12-02-h200-profile-flash-next-12l.md`). A row with at most k complete
  blocks takes all of them without a select.
- `select_block_bits`: the same choice as a bit per block (a row's words over its complete blocks),
  for the prefill kernel that attends a tile of queries to their selected blocks on tensor cores
  (ops/qsa_prefill_triton.py).
- `store_block_keys_`: one program per new token; where the token completes its block, the block's key
  (the mean of its raw index keys in fp32, rounded, zero-centred RMSNorm and RoPE at the block's first
  position: `QSAIndexer.keys_of_blocks`' rounding points, through the q/k norm + RoPE kernel's head
  code) written into the block-key cache. About twenty torch kernels a layer and step before.
- `sparse_attention`: the selected tokens of each query row, as flat pool slots [rows, W], are a page
  table with one-token pages: the paged decode kernel (`paged_attention_triton`, split-KV, GQA packing,
  FP8 K/V) attends each row, as its own one-query sequence of counts[row] keys, to exactly those.

Neither syncs with the host or allocates by data: both may be captured in a CUDA graph. Under
TRITON_INTERPRET=1 they run on the CPU (tests compare them with the torch reference there). PDL
(ops/pdl.py): each kernel's programs wait for the kernel before it first of all.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from morion.ops.paged_attention_triton import paged_attention
from morion.ops.pdl import launch_options, wait_for_previous_kernel
from morion.ops.qk_norm_rope_triton import _norm_rope_head

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _block_scores_kernel(
    q_ptr,
    keys_ptr,
    page_table_ptr,
    num_complete_ptr,
    out_ptr,
    stride_q_row,
    stride_q_head,
    stride_keys,
    stride_page_table,
    stride_out,
    num_blocks,
    sqrt_dim,
    rows_per_seq,
    BLOCKS_PER_PAGE: tl.constexpr,
    HEADS: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_B: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    row = tl.program_id(0)
    tile = tl.program_id(1)
    seq = row // rows_per_seq
    complete = tl.load(num_complete_ptr + row)
    offs_b = tile * BLOCK_B + tl.arange(0, BLOCK_B)
    valid = offs_b < complete
    page = tl.load(page_table_ptr + seq * stride_page_table + offs_b // BLOCKS_PER_PAGE, mask=valid, other=0)
    key_row = page.to(tl.int64) * BLOCKS_PER_PAGE + offs_b % BLOCKS_PER_PAGE
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < DIM
    keys = tl.load(
        keys_ptr + key_row[:, None] * stride_keys + offs_d[None, :],
        mask=valid[:, None] & d_mask[None, :],
        other=0.0,
    ).to(tl.float32)
    acc = tl.zeros([BLOCK_B], dtype=tl.float32)
    for head in tl.static_range(HEADS):
        q = tl.load(q_ptr + row * stride_q_row + head * stride_q_head + offs_d, mask=d_mask, other=0.0)
        acc += tl.maximum(tl.sum(keys * q.to(tl.float32)[None, :], axis=1), 0.0)
    scores = tl.where(valid, acc / sqrt_dim, float("-inf"))
    tl.store(out_ptr + row * stride_out + offs_b, scores, mask=offs_b < num_blocks)


def block_scores(
    index_q: torch.Tensor,
    block_pool: torch.Tensor,
    page_table: torch.Tensor,
    num_complete: torch.Tensor,
    page_size: int,
    ratio: int,
) -> torch.Tensor:
    """index_q [B * n, H, Di]; block_pool [num_slots // ratio, >= Di], the block-key storage with one row
    per block slot (row = flat slot of the block's first token // ratio); page_table [B, P];
    num_complete [B * n]. Returns scores [B * n, P * page_size // ratio] fp32 (as
    `qsa.static_block_scores`; -inf past each row's complete blocks)."""
    rows, heads, dim = index_q.shape
    num_seqs = page_table.shape[0]
    blocks_per_page = page_size // ratio
    num_blocks = page_table.shape[1] * blocks_per_page
    if index_q.stride(-1) != 1 or block_pool.stride(-1) != 1 or page_table.stride(-1) != 1:
        raise ValueError("index_q, block_pool and page_table must be contiguous in their last dimension")
    out = torch.empty(rows, num_blocks, dtype=torch.float32, device=index_q.device)
    block_b = 16 if _INTERPRET else 64
    grid = (rows, triton.cdiv(num_blocks, block_b))
    _block_scores_kernel[grid](
        index_q, block_pool, page_table, num_complete, out,
        index_q.stride(0), index_q.stride(1), block_pool.stride(0), page_table.stride(0), out.stride(0),
        num_blocks, math.sqrt(dim), rows // num_seqs, BLOCKS_PER_PAGE=blocks_per_page, HEADS=heads, DIM=dim,
        BLOCK_D=triton.next_power_of_2(dim), BLOCK_B=block_b, **launch_options(), num_warps=4,
    )  # fmt: skip
    return out


@triton.jit
def _rank_keys(scores_ptr, blocks, ok):
    """Rank keys (int64 in [0, 2^32), larger ranks first) of the blocks `blocks`: a positive score's fp32
    bits above 2^31 (positive floats order as their bits), a zero (or NaN garbage) below 2^31 and falling
    with the block index, so zeros rank by lower block."""
    scores = tl.load(scores_ptr + blocks, mask=ok, other=0.0)
    bits = tl.cast(scores.to(tl.int32, bitcast=True), tl.int64)
    return tl.where(scores > 0.0, bits + 2147483648, 2147483647 - tl.cast(blocks, tl.int64))


@triton.jit
def _top_k_threshold(scores_row, complete, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    """The TOP_K-th largest rank key of the row's `complete` blocks (`threshold`) and how many keys equal
    to it are taken (`need_equal`, the lower blocks first), by an 8-pass radix select, 4 bits a pass from
    the top; with at most TOP_K complete blocks (0, 0): every block is taken (every key exceeds 0)."""
    offs = tl.arange(0, BLOCK)
    bins = tl.arange(0, 16)
    threshold = tl.zeros([], dtype=tl.int64)
    need_equal = tl.zeros([], dtype=tl.int32)
    if complete > TOP_K:
        remaining = tl.full([], TOP_K, dtype=tl.int32)
        for digit_index in tl.static_range(8):
            shift = 28 - 4 * digit_index
            counts = tl.zeros([16], dtype=tl.int32)
            for start in range(0, complete, BLOCK):
                blocks = start + offs
                ok = blocks < complete
                keys = _rank_keys(scores_row, blocks, ok)
                match = ok & ((keys >> (shift + 4)) == (threshold >> (shift + 4)))
                digit = ((keys >> shift) & 15).to(tl.int32)
                hits = match[:, None] & (digit[:, None] == bins[None, :])
                counts += tl.sum(hits.to(tl.int32), axis=0)
            # The digit d whose keys hold the remaining-th largest: counts at d and above reach it.
            at_or_above = tl.sum(counts, axis=0) - tl.cumsum(counts, axis=0) + counts
            d = tl.sum((at_or_above >= remaining).to(tl.int32), axis=0) - 1
            remaining -= tl.sum(tl.where(bins > d, counts, 0), axis=0)
            threshold = threshold | (tl.cast(d, tl.int64) << shift)
        need_equal = remaining
    return threshold, need_equal


@triton.jit
def _picked_blocks(scores_row, blocks, ok, threshold, need_equal, equal_seen):
    """Which of `blocks` (where `ok`) the row takes, given `_top_k_threshold`'s result and the keys equal
    to the threshold seen in earlier blocks (`equal_seen`); and how many of these equal it."""
    keys = _rank_keys(scores_row, blocks, ok)
    equal = ok & (keys == threshold)
    equal_rank = equal_seen + tl.cumsum(equal.to(tl.int32), axis=0) - 1
    picked = (ok & (keys > threshold)) | (equal & (equal_rank < need_equal))
    return picked, tl.sum(equal.to(tl.int32), axis=0)


@triton.jit
def _select_token_slots_kernel(
    scores_ptr, num_complete_ptr, positions_ptr, page_table_ptr, slots_ptr, counts_ptr,
    stride_scores, stride_page_table, stride_slots, rows_per_seq, num_blocks,
    TOP_K: tl.constexpr, RATIO: tl.constexpr, PAGE_SIZE: tl.constexpr, WIDTH: tl.constexpr,
    BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous_kernel(USE_PDL)
    row = tl.program_id(0)
    seq = row // rows_per_seq
    scores_row = scores_ptr + tl.cast(row, tl.int64) * stride_scores
    table_row = page_table_ptr + tl.cast(seq, tl.int64) * stride_page_table
    complete = tl.minimum(tl.load(num_complete_ptr + row).to(tl.int32), num_blocks)
    position = tl.load(positions_ptr + row).to(tl.int32)
    chosen = tl.minimum(complete, TOP_K)
    offs = tl.arange(0, BLOCK)
    threshold, need_equal = _top_k_threshold(scores_row, complete, TOP_K, BLOCK)
    # The chosen blocks in ascending order, each as its RATIO token slots.
    taken = tl.zeros([], dtype=tl.int32)
    equal_seen = tl.zeros([], dtype=tl.int32)
    for start in range(0, complete, BLOCK):
        blocks = start + offs
        ok = blocks < complete
        picked, equal_count = _picked_blocks(scores_row, blocks, ok, threshold, need_equal, equal_seen)
        column = (taken + tl.cumsum(picked.to(tl.int32), axis=0) - 1) * RATIO
        for j in tl.static_range(RATIO):
            token = blocks * RATIO + j
            page = tl.load(table_row + token // PAGE_SIZE, mask=picked, other=0).to(tl.int64)
            slot = page * PAGE_SIZE + token % PAGE_SIZE
            tl.store(slots_ptr + row * stride_slots + column + j, slot.to(tl.int32), mask=picked)
        taken += tl.sum(picked.to(tl.int32), axis=0)
        equal_seen += equal_count
    # Then the unfinished block's tail, then token 0 (a valid slot, masked by the count) to WIDTH.
    count = chosen * RATIO + position + 1 - complete * RATIO
    for start in range(chosen * RATIO, WIDTH, BLOCK):
        column = start + offs
        token = tl.where(column < count, complete * RATIO + column - chosen * RATIO, 0)
        inside = column < WIDTH
        page = tl.load(table_row + token // PAGE_SIZE, mask=inside, other=0).to(tl.int64)
        slot = page * PAGE_SIZE + token % PAGE_SIZE
        tl.store(slots_ptr + row * stride_slots + column, slot.to(tl.int32), mask=inside)
    tl.store(counts_ptr + row, count)


# The scores' and bits' widths follow the page table's (a prefill batch's): not specialized on, so no
# batch brings a variant the warm-up did not compile.
@triton.jit(do_not_specialize=["stride_scores", "stride_bits", "num_blocks"])
def _select_block_bits_kernel(
    scores_ptr, num_complete_ptr, bits_ptr, stride_scores, stride_bits, num_blocks,
    TOP_K: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous_kernel(USE_PDL)
    row = tl.program_id(0)
    scores_row = scores_ptr + tl.cast(row, tl.int64) * stride_scores
    complete = tl.minimum(tl.load(num_complete_ptr + row).to(tl.int32), num_blocks)
    offs = tl.arange(0, BLOCK)
    words = tl.arange(0, BLOCK // 32)
    threshold, need_equal = _top_k_threshold(scores_row, complete, TOP_K, BLOCK)
    equal_seen = tl.zeros([], dtype=tl.int32)
    for start in range(0, complete, BLOCK):  # BLOCK is a multiple of 32: whole words
        blocks = start + offs
        ok = blocks < complete
        picked, equal_count = _picked_blocks(scores_row, blocks, ok, threshold, need_equal, equal_seen)
        # Distinct bits: their sum is their OR (bit 31 wraps to the sign, as an OR sets it).
        bits = tl.sum(tl.reshape(picked.to(tl.int32) << (offs % 32), (BLOCK // 32, 32)), axis=1)
        word = start // 32 + words
        tl.store(bits_ptr + tl.cast(row, tl.int64) * stride_bits + word, bits, mask=word * 32 < complete)
        equal_seen += equal_count


def select_token_slots(
    scores: torch.Tensor,
    num_complete: torch.Tensor,
    positions: torch.Tensor,
    page_table: torch.Tensor,
    block_topk: int,
    ratio: int,
    page_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [B * n, NB] from `block_scores`, num_complete and positions [B * n], page_table [B, P] ->
    (slots [B * n, W] int32, counts [B * n] int32), W = block_topk * ratio + ratio - 1: row t attends to
    the pool slots slots[t, :counts[t]] (what `qsa.select_blocks` without exact ties,
    `qsa.selected_tokens` and the page table give, the chosen blocks in ascending order).

    W never follows the page table's width: `sparse_attention` splits a row's keys by W, so a W taken
    from the table (the batch's pages eagerly, the graph's capacity in a replay) summed a row's keys in
    another order in a graph than eagerly (Flash-Next's replayed prompt tails parted from the eager ones
    in the fourth decimal of a logprob, scripts/short_graph_divergence.py on the H200, session 22)."""
    rows, num_blocks = scores.shape
    width = block_topk * ratio + ratio - 1
    if scores.stride(-1) != 1 or page_table.stride(-1) != 1:
        raise ValueError("scores and page_table must be contiguous in their last dimension")
    slots = torch.empty(rows, width, dtype=torch.int32, device=scores.device)
    counts = torch.empty(rows, dtype=torch.int32, device=scores.device)
    if rows:
        _select_token_slots_kernel[(rows,)](
            scores, num_complete, positions, page_table, slots, counts,
            scores.stride(0), page_table.stride(0), slots.stride(0), rows // page_table.shape[0], num_blocks,
            TOP_K=block_topk, RATIO=ratio, PAGE_SIZE=page_size, WIDTH=width, BLOCK=64 if _INTERPRET else 512,
            **launch_options(), num_warps=4,
        )  # fmt: skip
    return slots, counts


def select_block_bits(scores: torch.Tensor, num_complete: torch.Tensor, block_topk: int) -> torch.Tensor:
    """scores [rows, NB] from `block_scores`, num_complete [rows] -> bits [rows, ceil(NB / 32)] int32:
    bit b % 32 of word b // 32 set where the row takes complete block b (`select_token_slots`' choice,
    by the same select). Only the words of a row's complete blocks are written (the rest is garbage:
    a reader masks by the row's complete count, `selected_prefill_attention`)."""
    rows, num_blocks = scores.shape
    if scores.stride(-1) != 1:
        raise ValueError("scores must be contiguous in its last dimension")
    bits = torch.empty(rows, triton.cdiv(num_blocks, 32), dtype=torch.int32, device=scores.device)
    if rows:
        _select_block_bits_kernel[(rows,)](
            scores, num_complete, bits, scores.stride(0), bits.stride(0), num_blocks,
            TOP_K=block_topk, BLOCK=64 if _INTERPRET else 512, **launch_options(), num_warps=4,
        )  # fmt: skip
    return bits


@triton.jit
def _store_block_keys_kernel(
    raw_ptr, key_rows_ptr, slots_ptr, positions_ptr, cos_ptr, sin_ptr, w_ptr, scratch_ptr,
    stride_key_rows, stride_cos, stride_sin, dim, rotary_dim, eps,
    RATIO: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous_kernel(USE_PDL)
    token = tl.cast(tl.program_id(0), tl.int64)
    position = tl.load(positions_ptr + token)
    if (position + 1) % RATIO == 0:
        block = tl.load(slots_ptr + token).to(tl.int64) // RATIO  # pages hold whole blocks
        cols = tl.arange(0, BLOCK_D)
        mask = cols < dim
        total = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for j in tl.static_range(RATIO):
            total += tl.cast(
                tl.load(raw_ptr + (block * RATIO + j) * dim + cols, mask=mask, other=0.0), tl.float32
            )
        # The mean in fp32 (torch's: the sum times 1 / n), rounded to the keys' dtype; then the head code
        # reads it back (its partner dims by address) from this token's scratch row.
        pooled = scratch_ptr + token * BLOCK_D
        tl.store(pooled + cols, tl.cast(total * (1.0 / RATIO), scratch_ptr.dtype.element_ty), mask=mask)
        tl.debug_barrier()
        _norm_rope_head(
            pooled, w_ptr, cos_ptr + token * stride_cos, sin_ptr + token * stride_sin,
            key_rows_ptr + block * stride_key_rows, dim, rotary_dim, eps, BLOCK_D,
        )  # fmt: skip


def store_block_keys_(
    raw_keys: torch.Tensor,
    key_rows: torch.Tensor,
    out_slots: torch.Tensor,
    positions: torch.Tensor,
    block_cos: torch.Tensor,
    block_sin: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    ratio: int,
) -> None:
    """raw_keys [num_slots, Di] (the `INDEX_KEYS` cache, this step's keys already in it), key_rows
    [num_slots / ratio, >= Di] (the `BLOCK_KEYS` cache, one row per block slot), out_slots and positions
    [T] of this step's tokens, block_cos/sin [T, r] at each token's block's first position, the key norm's
    weight [Di] (zero-centred): writes the key of every block a token of this step completes."""
    tokens, dim = out_slots.shape[0], raw_keys.shape[1]
    if tokens == 0:
        return
    block_d = triton.next_power_of_2(dim)
    scratch = torch.empty(tokens, block_d, dtype=raw_keys.dtype, device=raw_keys.device)
    _store_block_keys_kernel[(tokens,)](
        raw_keys, key_rows, out_slots, positions, block_cos, block_sin, weight, scratch,
        key_rows.stride(0), block_cos.stride(0), block_sin.stride(0), dim, block_cos.shape[-1], eps,
        RATIO=ratio, BLOCK_D=block_d, **launch_options(),
        enable_fp_fusion=raw_keys.dtype != torch.float32,  # as the q/k norm + RoPE kernel
    )  # fmt: skip


def sparse_attention(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    slots: torch.Tensor,
    counts: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """q [rows, Hq, D]; kv_layer [num_slots, 2, Hkv, D] (any pool dtype the paged kernels take); slots
    [rows, W] flat pool slots of each row's selected tokens, the first counts[row] real. Returns
    [rows, Hq, D] in q's dtype (as `qsa.static_sparse_attention`). The paged kernel's split count follows
    W alone (`kv_split_count`), never the number of rows: a row's result does not depend on its batch."""
    rows = q.shape[0]
    cu_seqlens = torch.arange(rows + 1, dtype=torch.int32, device=q.device)
    return paged_attention(
        q.contiguous(), kv_layer, slots.to(torch.int32), cu_seqlens, counts.to(torch.int32), 1, scale,
        max_query_len=1, k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
