"""QSA's static path on CUDA (see `morion.ops.qsa` for the rule and its torch reference).

- `block_scores`: one program per (query row, tile of BLOCK_B blocks) reads the tile's cached block keys
  straight from the pool through the sequence's page table (each page holds page_size / ratio block keys,
  consecutive) and writes sum_h relu(q_h . key) / sqrt(Di), or -inf past the row's complete blocks. The
  grid covers the page table's whole block capacity (a static shape); tiles past a row's complete blocks
  load nothing (masked), so the bytes read follow the real context.
- `sparse_attention`: the selected tokens of each query row, as flat pool slots [rows, W], are a page
  table with one-token pages: the paged decode kernel (`paged_attention_triton`, split-KV, GQA packing,
  FP8 K/V) attends each row, as its own one-query sequence of counts[row] keys, to exactly those.

Neither syncs with the host or allocates by data: both may be captured in a CUDA graph. Under
TRITON_INTERPRET=1 they run on the CPU (tests compare them with the torch reference there).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from morion.ops.paged_attention_triton import paged_attention

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
):
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
        BLOCK_D=triton.next_power_of_2(dim), BLOCK_B=block_b, num_warps=4,
    )  # fmt: skip
    return out


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
