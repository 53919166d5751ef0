"""QSA prefill attention on tensor cores: a tile of one sequence's queries attends to their selected blocks.

The static path (ops/qsa_triton.py) attends each query row alone to its selected tokens, gathered as
one-token pages by the split-KV decode kernel: the right kernel for a decode step, where a row is alone,
but in a prefill chunk every row gathers its ~budget keys by itself and no two rows share a load or an MMA
(Flash-Next at 8K: 62 ms of a 4K-token step's ~300, the largest single part:
results/2026-12-04-h200-profile-flash-next-prefill-long-98aff3b.md).

Here a program takes BLOCK_Q consecutive query tokens x the G query heads of one KV head (GQA packing, as
the extend kernel: row r = token r // G, head r % G) and walks the sequence's keys in tiles of
32 x ratio tokens: 32 blocks, one word of each row's selection bits (`qsa_triton.select_block_bits`). A
tile that no row of the program needs (no selected block, not its unfinished block's tail) is skipped;
otherwise the keys go through `tl.dot` for all rows at once, each row masked to its selected blocks and
its tail (keys from its first incomplete block to its own position), with an online softmax in the log2
domain as the paged kernels keep it.

A row's result depends on its own selection only. A key block masked for a row is an exact no-op of its
online softmax (the max stays, alpha = exp2(0) = 1, probabilities exactly 0, so acc and l are unchanged),
the same as a skipped tile; so what the other rows of its program select, how the prompt is tiled and
which batch it runs in never change it. It is not the split-KV path's bits (another summation order):
the engine uses one path or the other for a given forward kind and context (layers/qsa_attention.py), so
a restored prefix and its cold run compute every row on the same path.

Cost: a program reads the union of its rows' selections densely, so its work follows the context where
the split-KV path's follows the budget: the layer uses it up to a context limit. No host sync, no
allocation but the output: capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from morion.ops.paged_attention import FP8_KV_DTYPE
from morion.ops.paged_attention_triton import (
    LOG2E,
    KernelConfig,
    extend_config,
    gqa_rows,
    launch_kernel,
    online_softmax_step,
)
from morion.ops.pdl import wait_for_previous_kernel

# Blocks per key tile: one int32 word of a row's selection bits.
BLOCKS_PER_TILE = 32


# The row count and the bits' width follow the batch: not specialized on (a variant first met in serving
# would compile while every request waits).
@triton.jit(do_not_specialize=["rows", "stride_bits"])
def _selected_kernel(
    q_ptr, kv_ptr, out_ptr, page_row_ptr, positions_ptr, bits_ptr, rows,
    stride_q_tok, stride_q_head, stride_kv_tok, stride_kv_kv, stride_kv_head, stride_o_tok, stride_o_head,
    stride_bits, qk_scale, v_scale,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, RATIO: tl.constexpr,
    BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous_kernel(USE_PDL)
    BLOCK_N: tl.constexpr = 32 * RATIO  # keys a tile: BLOCKS_PER_TILE blocks
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    tok, heads, row_valid = gqa_rows(q_block, kv_head, rows, GROUP, BLOCK_Q, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q_pos = tl.load(positions_ptr + tok, mask=row_valid, other=0).to(tl.int32)
    tail_start = (q_pos + 1) // RATIO * RATIO  # the row's first key past its complete blocks
    row_offsets = tl.cast(tok, tl.int64)
    q_offsets = row_offsets[:, None] * stride_q_tok + heads[:, None] * stride_q_head + offs_d[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_valid[:, None] & d_mask[None, :], other=0.0)
    compute_dtype = q.dtype

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    last = tl.max(tl.where(row_valid, q_pos, 0), 0)  # the program's last key
    kv_head_offset = kv_head * stride_kv_head
    local_block = offs_n // RATIO
    for tile in range(0, last // BLOCK_N + 1):
        start = tile * BLOCK_N
        # The rows' words of this tile: only words of complete blocks were written.
        word = tl.load(
            bits_ptr + row_offsets * stride_bits + tile, mask=row_valid & (start < tail_start), other=0
        )
        tail_here = row_valid & (tail_start < start + BLOCK_N) & (q_pos >= start)
        if tl.max(((word != 0) | tail_here).to(tl.int32), 0) > 0:
            pos = start + offs_n
            key_valid = pos <= last
            page = tl.load(page_row_ptr + pos // PAGE_SIZE, mask=key_valid, other=0)
            slot = tl.cast(page, tl.int64) * PAGE_SIZE + pos % PAGE_SIZE
            kv_offsets = slot[:, None] * stride_kv_tok + kv_head_offset + offs_d[None, :]
            kv_mask = key_valid[:, None] & d_mask[None, :]
            k = tl.load(kv_ptr + kv_offsets, mask=kv_mask, other=0.0)
            qk = tl.dot(q, tl.trans(tl.cast(k, compute_dtype)), input_precision=DOT_PRECISION) * qk_scale
            selected = ((word[:, None] >> local_block[None, :]) & 1) != 0
            selected = selected & (pos[None, :] < tail_start[:, None])
            tail = (pos[None, :] >= tail_start[:, None]) & (pos[None, :] <= q_pos[:, None])
            visible = (selected | tail) & key_valid[None, :] & row_valid[:, None]
            qk = tl.where(visible, qk, float("-inf"))
            # A row whose first blocks it did not select has seen no key yet.
            acc, m_i, l_i = online_softmax_step(
                acc, m_i, l_i, qk, q, kv_ptr + kv_offsets + stride_kv_kv, kv_mask, True, DOT_PRECISION
            )

    result = acc / tl.where(l_i > 0, l_i, 1.0)[:, None] * v_scale
    o_offsets = row_offsets[:, None] * stride_o_tok + heads[:, None] * stride_o_head + offs_d[None, :]
    tl.store(
        out_ptr + o_offsets,
        tl.cast(result, out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & d_mask[None, :],
    )


def selected_prefill_attention(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    page_row: torch.Tensor,
    positions: torch.Tensor,
    bits: torch.Tensor,
    ratio: int,
    page_size: int,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """q [rows, Hq, D] of one sequence's queries at `positions` [rows] (consecutive or not: each row reads
    its own); kv_layer [num_slots, 2, Hkv, D] (BF16, fp16, fp32 or FP8, scales as the paged kernels take
    them); page_row [P] the sequence's pages; bits [rows, >= ceil(complete blocks / 32)] int32 from
    `qsa_triton.select_block_bits`. Returns [rows, Hq, D] in q's dtype: each row attends to the tokens of
    its selected complete blocks and of its unfinished block up to its position (what
    `qsa.static_sparse_attention` computes over `select_token_slots`' tokens)."""
    rows, num_q_heads, head_dim = q.shape
    num_kv_heads = kv_layer.shape[2]
    if num_q_heads % num_kv_heads or kv_layer.shape[3] != head_dim or kv_layer.shape[1] != 2:
        raise ValueError(f"q {tuple(q.shape)} does not fit kv_layer {tuple(kv_layer.shape)}")
    for name, tensor in (("q", q), ("kv_layer", kv_layer), ("page_row", page_row), ("bits", bits)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    if bits.dtype != torch.int32 or bits.shape[0] != rows:
        raise ValueError(f"bits must be int32 [{rows}, words], got {bits.dtype} {tuple(bits.shape)}")
    out = torch.empty_like(q)
    if rows == 0:
        return out
    group = num_q_heads // num_kv_heads
    config = extend_config(head_dim)
    block_m = max(config.block_m, triton.next_power_of_2(group))
    block_q = block_m // group
    if kv_layer.dtype != FP8_KV_DTYPE:
        k_scale = v_scale = 1.0
    tiles = KernelConfig(block_m, BLOCKS_PER_TILE * ratio, config.num_warps, config.num_stages)
    args = (
        q, kv_layer, out, page_row, positions, bits, rows,
        q.stride(0), q.stride(1), kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2),
        out.stride(0), out.stride(1), bits.stride(0), float(scale) * float(k_scale) * LOG2E, float(v_scale),
    )  # fmt: skip
    block_d = max(16, triton.next_power_of_2(head_dim))
    meta = dict(
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, RATIO=ratio, BLOCK_D=block_d, HEAD_DIM=head_dim,
        PAGE_SIZE=page_size, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    grid = (triton.cdiv(rows, block_q), num_kv_heads)
    launch_kernel(_selected_kernel, grid, args, meta, tiles, (q.dtype, kv_layer.dtype))
    return out
