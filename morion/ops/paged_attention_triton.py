"""Paged attention in Triton: a split-KV decode kernel and an extend/prefill kernel over a paged prefix.

Same contract as `paged_attention_reference` (see `morion.ops.paged_attention` for the memory layout and
the batch description). Both kernels walk a sequence's keys through its page table one token block at a
time, gather K/V rows by flat token slot (so any page size works, independently of the key block) and keep
an online softmax in fp32 in the log2 domain (the softmax scale, k_scale and log2(e) are folded into one
multiplier; v_scale is applied to the output).

Split-KV (FlashDecoding): decode (`max_query_len == 1`) and short extends such as speculative
verification (`max_query_len <= MAX_SPLIT_QUERY_LEN`):
- stage 1, grid (B, Hkv x query blocks, num_splits): one program takes a block of its sequence's query
  tokens x the Hq/Hkv query heads of one KV head (GQA packing: row r = token r // G, head r % G, at least
  16 rows for tl.dot, so G = 8 packs two tokens) over one contiguous key range of its sequence. The range
  is derived on the device: split_len = round_up(ceil(seq_len / num_splits), BLOCK_N), so the grid and the
  scratch buffers depend only on shapes and a captured CUDA graph is valid for any seq_lens. Keys up to
  the block's first query position need no mask; later ones are masked causally per row. Each split
  writes each of its rows' normalised partial output and log2-sum-exp2 (-inf where the row saw no key).
- stage 2, grid (T, Hq): merges one query row's splits, weighting each by 2^(lse - max lse); empty splits
  weigh 0.
- Syncs with nothing and allocates only the (optional) workspace: safe to capture.

Extend (longer queries: prefill chunks): grid (query blocks, Hkv). A block packs BLOCK_M // G query
tokens x the G query heads of one KV head into BLOCK_M rows. The block -> sequence map is computed inside
the kernel from cu_seqlens_q (a cumulative count of blocks per sequence), so the grid is a static upper
bound and nothing syncs with the host. Keys below the block's first query position need no mask; only
the diagonal band is masked causally.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from morion.ops.paged_attention import FP8_KV_DTYPE
from morion.ops.pdl import launch_options, wait_for_previous_kernel

LOG2E = 1.4426950408889634
# Under TRITON_INTERPRET=1 every tile op is a numpy call: small tiles keep CPU tests fast and still cover
# several key blocks per split.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
MAX_KV_SPLITS = 64
# The split-KV kernels take batches whose longest query has at most this many tokens (speculative verify
# at width <= 15); longer queries take the extend kernel, whose programs do not re-read keys per block.
MAX_SPLIT_QUERY_LEN = 16
logger = logging.getLogger(__name__)
# Masking of one key block in _attend_block: none, keys past key_end, and also keys after each query.
MODE_FULL = tl.constexpr(0)
MODE_KEY_BOUND = tl.constexpr(1)
MODE_CAUSAL = tl.constexpr(2)


class KernelConfig(NamedTuple):
    """Tile sizes and launch options of one kernel (fixed per head dim; no autotuning)."""

    block_m: int  # query rows (tokens x heads of a group) per program; split-KV: the minimum
    block_n: int  # keys per inner-loop step
    num_warps: int
    num_stages: int


class DecodeWorkspace(NamedTuple):
    """Scratch of the split-KV kernels, one row per query token; preallocate it once per captured batch
    size. All layers of one forward may share it: they run in order on one stream, and each layer's
    merge reads it before the next layer's stage 1 writes it."""

    partial_out: torch.Tensor  # [T, Hq, num_splits, D] fp32: each split's normalised output
    partial_lse: torch.Tensor  # [T, Hq, num_splits] fp32: log2-sum-exp2 of each split's scores (-inf: empty)


def decode_config(head_dim: int) -> KernelConfig:
    """Decode is bandwidth bound: 16 GQA rows (mma.sync), key blocks of 32-64 tokens, two cp.async
    stages, 8 warps to keep registers low (ptxas, Triton 3.7.1, sm_90, bf16 / fp8 KV: D=128 98 / 128
    registers, D=256 166 / 208, no spills). Not yet timed on the H200."""
    if _INTERPRET:
        return KernelConfig(16, 16, 1, 1)
    if head_dim <= 128:
        return KernelConfig(16, 64, 8, 2)
    return KernelConfig(16, 32, 8, 2)


def extend_config(head_dim: int) -> KernelConfig:
    """Extend is compute bound: 128-row tiles on wgmma, 8 warps (two warpgroups). D=256 (Qwen3-Next's
    attention) timed on the H200 over 27 tiles (bench/attention_tune.py, FP8 K/V, 16 query heads on 2
    K/V heads: results/2026-12-04-h200-attention-tune-h16-kv2-d256-fp8.md): 128-key blocks, 2 stages, the
    fastest at every shape, 1.4-1.6x the 32-key blocks chosen before from register counts (an agent
    turn's 1K queries over 33K keys: 1.92 ms against 3.07 a layer; 290-303 TFLOP/s). D <= 128 (ptxas,
    Triton 3.7.1, sm_90, bf16 / fp8 KV: D=64 128 / 128 registers, D=128 180 / 193, no spills) not yet
    timed."""
    if _INTERPRET:
        return KernelConfig(32, 16, 1, 1)
    if head_dim <= 128:
        return KernelConfig(128, 64, 8, 3)
    return KernelConfig(128, 128, 8, 2)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def kv_split_count(num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """Splits per (sequence, KV head) for the split-KV kernels, from static sizes only: the KV head count
    and the longest context the caller can ever pass (its pool or model length), never the batch size or
    this step's page-table width. A row's splits then depend on its own sequence alone, so its result
    does not depend on the batch it runs in, nor on whether the step replays a CUDA graph or runs eagerly
    (a restored prefix answers exactly as the cold run did). About four programs per SM for one sequence,
    at most MAX_KV_SPLITS, and no more than keeps >= 256 keys per split at `max_context`."""
    if device.type == "cuda":
        sm_count = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    else:
        sm_count = 1
    wanted = triton.next_power_of_2(triton.cdiv(4 * sm_count, max(1, num_kv_heads)))
    return max(1, min(wanted, MAX_KV_SPLITS, triton.cdiv(max_context, 256)))


def decode_workspace(
    num_tokens: int, num_q_heads: int, head_dim: int, num_kv_splits: int, device: torch.device
) -> DecodeWorkspace:
    """Scratch for the split-KV path of `paged_attention` with up to num_tokens query rows (q.shape[0])."""
    return DecodeWorkspace(
        torch.empty(num_tokens, num_q_heads, num_kv_splits, head_dim, dtype=torch.float32, device=device),
        torch.empty(num_tokens, num_q_heads, num_kv_splits, dtype=torch.float32, device=device),
    )


@triton.jit
def _attend_block(
    acc,
    m_i,
    l_i,
    q,
    kv_ptr,
    page_row_ptr,
    start_n,
    key_end,
    q_pos,
    offs_n,
    offs_d,
    d_mask,
    kv_head_offset,
    stride_kv_tok,
    stride_kv_kv,
    qk_scale,
    PAGE_SIZE: tl.constexpr,
    MODE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step over keys start_n .. start_n + BLOCK_N - 1 of one sequence.

    q [M, BLOCK_D] in the compute dtype; acc [M, BLOCK_D], m_i, l_i [M] fp32 (log2 domain). MODE:
    MODE_FULL (every key < key_end and visible to every row), MODE_KEY_BOUND (keys >= key_end masked),
    MODE_CAUSAL (also keys after each row's q_pos [M] masked). In the first two modes every row must see at
    least one key in the first block it visits, or its max stays -inf and exp2 gives NaN (callers guarantee
    it); MODE_CAUSAL leaves a row that sees none empty (acc, l_i 0; m_i -inf)."""
    compute_dtype = q.dtype
    pos = start_n + offs_n
    if MODE == MODE_FULL:
        page = tl.load(page_row_ptr + pos // PAGE_SIZE)
        kv_mask = d_mask[None, :]
    else:
        key_valid = pos < key_end
        page = tl.load(page_row_ptr + pos // PAGE_SIZE, mask=key_valid, other=0)
        kv_mask = key_valid[:, None] & d_mask[None, :]
    slot = tl.cast(page, tl.int64) * PAGE_SIZE + pos % PAGE_SIZE
    kv_offsets = slot[:, None] * stride_kv_tok + kv_head_offset + offs_d[None, :]
    k = tl.load(kv_ptr + kv_offsets, mask=kv_mask, other=0.0)
    qk = tl.dot(q, tl.trans(tl.cast(k, compute_dtype)), input_precision=DOT_PRECISION) * qk_scale
    if MODE == MODE_KEY_BOUND:
        qk = tl.where(key_valid[None, :], qk, float("-inf"))
    elif MODE == MODE_CAUSAL:
        qk = tl.where(key_valid[None, :] & (pos[None, :] <= q_pos[:, None]), qk, float("-inf"))
    # In MODE_CAUSAL a row may have seen no key yet (a split that starts past its position).
    return online_softmax_step(
        acc, m_i, l_i, qk, q, kv_ptr + kv_offsets + stride_kv_kv, kv_mask, MODE == MODE_CAUSAL, DOT_PRECISION
    )


@triton.jit
def online_softmax_step(
    acc, m_i, l_i, qk, q, v_ptrs, v_mask, EMPTY_ROWS: tl.constexpr, DOT_PRECISION: tl.constexpr
):  # fmt: skip
    """acc, m, l after the scores qk [M, N] (log2 domain, -inf where masked) of the keys whose values
    `v_ptrs` [N, BLOCK_D] point at (loaded where `v_mask`), p x v in q's dtype. EMPTY_ROWS: a row may
    have seen no key yet (all -inf so far): its shift is 0 then, so exp2 gives 0 rather than NaN and the
    row stays empty."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    if EMPTY_ROWS:  # noqa: SIM108 (a compile-time branch)
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_shift = m_new
    alpha = tl.exp2(m_i - m_shift)
    p = tl.exp2(qk - m_shift[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_ptrs, mask=v_mask, other=0.0)
    pv = tl.dot(tl.cast(p, q.dtype), tl.cast(v, q.dtype), input_precision=DOT_PRECISION)
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i


@triton.jit
def gqa_rows(q_block, kv_head, num_tokens, GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr):
    """A GQA-packed program's rows: row r is token q_block * BLOCK_Q + r // GROUP (of `num_tokens`) and
    query head kv_head * GROUP + r % GROUP; (tokens, heads, which rows are real) [BLOCK_M]."""
    offs_m = tl.arange(0, BLOCK_M)
    tok = q_block * BLOCK_Q + offs_m // GROUP
    heads = kv_head * GROUP + offs_m % GROUP
    return tok, heads, (offs_m < BLOCK_Q * GROUP) & (tok < num_tokens)


# Arguments that vary with the batch (sequence and token counts, the page table's width) are not
# specialized on: Triton would compile a variant per value class (1, a multiple of 16, other) the first
# time a request brings one, stalling every running request for seconds (seen through the server on
# the H200: a 4.1 s TTFT); one variant serves every batch. runner/warmup.py compiles the rest.
@triton.jit(do_not_specialize=["stride_pt_seq"])
def _split_kernel(
    q_ptr,
    kv_ptr,
    page_table_ptr,
    cu_seqlens_q_ptr,
    seq_lens_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    stride_q_tok,
    stride_q_head,
    stride_kv_tok,
    stride_kv_kv,
    stride_kv_head,
    stride_pt_seq,
    stride_po_tok,
    stride_po_head,
    stride_po_split,
    stride_lse_tok,
    stride_lse_head,
    qk_scale,
    num_splits,
    num_kv_heads,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1) % num_kv_heads
    q_block = tl.program_id(1) // num_kv_heads
    split = tl.program_id(2)
    q_row = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_row
    if q_block * BLOCK_Q >= q_len:
        return  # no query here this step (stage 2 skips such rows too, so the scratch is never read)
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len  # keys cached before this step's first query
    first_pos = context + q_block * BLOCK_Q  # the block's first query position
    key_end = context + tl.minimum(q_block * BLOCK_Q + BLOCK_Q, q_len)  # its last one + 1
    # Device-side split: a multiple of BLOCK_N, so only the sequence's last block is partial.
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    lo = split * split_len
    hi = tl.minimum(lo + split_len, key_end)
    # Keys 0..first_pos are visible to every row of the block: whole blocks of them need no mask.
    full_end = lo + tl.maximum(tl.minimum(hi, first_pos + 1) - lo, 0) // BLOCK_N * BLOCK_N

    offs_h = tl.arange(0, BLOCK_H)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    tok = q_block * BLOCK_Q + offs_h // GROUP
    row_valid = (offs_h < BLOCK_Q * GROUP) & (tok < q_len)
    heads = kv_head * GROUP + offs_h % GROUP
    rows = tl.cast(q_row + tok, tl.int64)
    # Padding rows are zeros at position seq_len (they see every key): finite scores, never stored.
    q_pos = tl.where(row_valid, context + tok, seq_len)
    q_offsets = rows[:, None] * stride_q_tok + heads[:, None] * stride_q_head + offs_d[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_valid[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    page_row_ptr = page_table_ptr + tl.cast(seq, tl.int64) * stride_pt_seq
    kv_head_offset = kv_head * stride_kv_head
    for start_n in range(lo, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_block(
            acc, m_i, l_i, q, kv_ptr, page_row_ptr, start_n, hi, q_pos, offs_n, offs_d, d_mask,
            kv_head_offset, stride_kv_tok, stride_kv_kv, qk_scale, PAGE_SIZE, MODE_FULL, DOT_PRECISION,
        )  # fmt: skip
    for start_n in range(full_end, hi, BLOCK_N):
        acc, m_i, l_i = _attend_block(
            acc, m_i, l_i, q, kv_ptr, page_row_ptr, start_n, hi, q_pos, offs_n, offs_d, d_mask,
            kv_head_offset, stride_kv_tok, stride_kv_kv, qk_scale, PAGE_SIZE, MODE_CAUSAL, DOT_PRECISION,
        )  # fmt: skip

    # A row without keys in this split (an empty split, or one past its position) has l_i == 0: it writes
    # zeros and lse = -inf, which stage 2 weighs 0.
    nonempty = l_i > 0
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    partial = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    po_offsets = (
        rows[:, None] * stride_po_tok
        + heads[:, None] * stride_po_head
        + split * stride_po_split
        + offs_d[None, :]
    )
    tl.store(partial_out_ptr + po_offsets, partial, mask=row_valid[:, None] & d_mask[None, :])
    lse_offsets = rows * stride_lse_tok + heads * stride_lse_head + split
    tl.store(partial_lse_ptr + lse_offsets, lse, mask=row_valid)


@triton.jit(do_not_specialize=["num_seqs"])
def _merge_kernel(
    partial_out_ptr,
    partial_lse_ptr,
    out_ptr,
    cu_seqlens_q_ptr,
    num_seqs,
    stride_po_tok,
    stride_po_head,
    stride_po_split,
    stride_lse_tok,
    stride_lse_head,
    stride_o_tok,
    stride_o_head,
    v_scale,
    num_splits,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    row = tl.program_id(0)
    head = tl.program_id(1)
    if row < tl.load(cu_seqlens_q_ptr) or row >= tl.load(cu_seqlens_q_ptr + num_seqs):
        return  # not a query row of this batch: stage 1 wrote nothing for it
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM
    row_offset = tl.cast(row, tl.int64)
    lse = tl.load(
        partial_lse_ptr + row_offset * stride_lse_tok + head * stride_lse_head + offs_s,
        mask=s_mask,
        other=float("-inf"),
    )
    lse_max = tl.max(lse, 0)
    # All splits empty (seq_len 0): keep exp2 away from -inf - -inf; the result is then 0.
    weights = tl.exp2(lse - tl.where(lse_max == float("-inf"), 0.0, lse_max))
    po_offsets = (
        row_offset * stride_po_tok
        + head * stride_po_head
        + offs_s[:, None] * stride_po_split
        + offs_d[None, :]
    )
    partial = tl.load(partial_out_ptr + po_offsets, mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    total = tl.sum(weights, 0)
    merged = tl.sum(weights[:, None] * partial, 0) / tl.where(total > 0, total, 1.0) * v_scale
    o_offsets = row_offset * stride_o_tok + head * stride_o_head + offs_d
    tl.store(out_ptr + o_offsets, tl.cast(merged, out_ptr.dtype.element_ty), mask=d_mask)


@triton.jit(do_not_specialize=["num_seqs", "stride_pt_seq"])
def _extend_kernel(
    q_ptr,
    kv_ptr,
    out_ptr,
    page_table_ptr,
    cu_seqlens_q_ptr,
    seq_lens_ptr,
    num_seqs,
    stride_q_tok,
    stride_q_head,
    stride_kv_tok,
    stride_kv_kv,
    stride_kv_head,
    stride_pt_seq,
    stride_o_tok,
    stride_o_head,
    qk_scale,
    v_scale,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_B: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    block_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    # Which sequence and which of its query blocks: sequence b owns blocks
    # blocks_end[b] - blocks[b] .. blocks_end[b] - 1 (none when it has no rows).
    offs_b = tl.arange(0, BLOCK_B)
    b_mask = offs_b < num_seqs
    q_starts = tl.load(cu_seqlens_q_ptr + offs_b, mask=b_mask, other=0)
    q_lens = tl.load(cu_seqlens_q_ptr + offs_b + 1, mask=b_mask, other=0) - q_starts
    blocks = (q_lens + BLOCK_Q - 1) // BLOCK_Q
    blocks_end = tl.cumsum(blocks, 0)
    if block_id >= tl.sum(blocks, 0):
        return  # the grid is an upper bound on the number of blocks
    seq = tl.sum(tl.cast(blocks_end <= block_id, tl.int32), 0)
    is_seq = offs_b == seq
    q_start = tl.sum(tl.where(is_seq, q_starts, 0), 0)
    q_len = tl.sum(tl.where(is_seq, q_lens, 0), 0)
    q_block = block_id - tl.sum(tl.where(is_seq, blocks_end - blocks, 0), 0)
    seq_len = tl.load(seq_lens_ptr + seq)

    tok, heads, row_valid = gqa_rows(q_block, kv_head, q_len, GROUP, BLOCK_Q, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    context = seq_len - q_len  # keys cached before this step's first query
    # Padding rows get position seq_len: they see every key, so their max never stays -inf.
    q_pos = tl.where(row_valid, context + tok, seq_len)
    rows = tl.cast(q_start + tok, tl.int64)
    q_offsets = rows[:, None] * stride_q_tok + heads[:, None] * stride_q_head + offs_d[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_valid[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    page_row_ptr = page_table_ptr + tl.cast(seq, tl.int64) * stride_pt_seq
    kv_head_offset = kv_head * stride_kv_head
    first_pos = context + q_block * BLOCK_Q
    key_end = context + tl.minimum(q_block * BLOCK_Q + BLOCK_Q, q_len)  # last query position + 1
    # Keys 0..first_pos are visible to every row of the block: whole blocks of them need no mask. Every
    # row sees a key in the first block it visits (key 0 is visible to all), so no max stays -inf.
    full_end = (first_pos + 1) // BLOCK_N * BLOCK_N
    for start_n in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_block(
            acc, m_i, l_i, q, kv_ptr, page_row_ptr, start_n, key_end, q_pos, offs_n, offs_d, d_mask,
            kv_head_offset, stride_kv_tok, stride_kv_kv, qk_scale, PAGE_SIZE, MODE_FULL, DOT_PRECISION,
        )  # fmt: skip
    for start_n in range(full_end, key_end, BLOCK_N):
        acc, m_i, l_i = _attend_block(
            acc, m_i, l_i, q, kv_ptr, page_row_ptr, start_n, key_end, q_pos, offs_n, offs_d, d_mask,
            kv_head_offset, stride_kv_tok, stride_kv_kv, qk_scale, PAGE_SIZE, MODE_CAUSAL, DOT_PRECISION,
        )  # fmt: skip

    result = acc / tl.where(l_i > 0, l_i, 1.0)[:, None] * v_scale
    o_offsets = rows[:, None] * stride_o_tok + heads[:, None] * stride_o_head + offs_d[None, :]
    tl.store(
        out_ptr + o_offsets,
        tl.cast(result, out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & d_mask[None, :],
    )


# Launches whose configured pipeline depth did not fit in shared memory and now run with one stage.
_SINGLE_STAGE: set[tuple[Any, ...]] = set()


def launch_kernel(
    kernel: Any,
    grid: tuple[int, ...],
    args: tuple[Any, ...],
    meta: dict[str, Any],
    config: KernelConfig,
    key: tuple,
) -> None:
    """Launches `kernel` with the config's warps and stages. The configs are not autotuned: should one
    need more shared memory than the GPU has, say so once and use a single pipeline stage for that key
    (kernel, config, constexprs, dtypes) from then on, instead of failing the request. The PDL launch options
    (ops/pdl.py) join `meta` here."""
    meta = {**meta, **launch_options()}
    key = (kernel.__name__, config, *sorted(meta.items()), *key)
    stages = 1 if key in _SINGLE_STAGE else config.num_stages
    try:
        kernel[grid](*args, **meta, num_warps=config.num_warps, num_stages=stages)
    except OutOfResources as error:
        if stages == 1:
            raise
        logger.warning("%s: %s with %d stages; using 1 stage", kernel.__name__, error, stages)
        _SINGLE_STAGE.add(key)
        kernel[grid](*args, **meta, num_warps=config.num_warps, num_stages=1)


def _check_inputs(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """Shape and layout checks only (no values are read: nothing syncs with the device)."""
    if q.dim() != 3 or kv_layer.dim() != 4 or kv_layer.shape[1] != 2:
        raise ValueError(
            f"expected q [T, Hq, D], kv_layer [slots, 2, Hkv, D]; got {q.shape}, {kv_layer.shape}"
        )
    if q.shape[2] != kv_layer.shape[3] or q.shape[1] % kv_layer.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} does not fit kv_layer {tuple(kv_layer.shape)}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"unsupported query dtype {q.dtype}")
    if _INTERPRET and q.dtype == torch.bfloat16:
        # The interpreter multiplies bf16 tiles as raw bits (triton #11584): refuse rather than be wrong.
        raise NotImplementedError("bf16 queries give wrong tl.dot results under TRITON_INTERPRET=1")
    if kv_layer.dtype not in (torch.float16, torch.bfloat16, torch.float32, FP8_KV_DTYPE):
        raise ValueError(f"unsupported KV dtype {kv_layer.dtype}")
    num_seqs = page_table.shape[0]
    if page_table.dim() != 2 or seq_lens.shape != (num_seqs,) or cu_seqlens_q.shape != (num_seqs + 1,):
        raise ValueError(
            f"page_table {tuple(page_table.shape)}, seq_lens {tuple(seq_lens.shape)} and cu_seqlens_q "
            f"{tuple(cu_seqlens_q.shape)} disagree on the number of sequences"
        )
    if out.shape != q.shape:
        raise ValueError(f"out {tuple(out.shape)} must have q's shape {tuple(q.shape)}")
    for name, tensor in (("q", q), ("kv_layer", kv_layer), ("out", out)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    for name, tensor in (("page_table", page_table), ("cu_seqlens_q", cu_seqlens_q), ("seq_lens", seq_lens)):
        if tensor.dtype not in (torch.int32, torch.int64) or tensor.stride(-1) != 1:
            raise ValueError(f"{name} must be a contiguous int32/int64 tensor")


def paged_attention(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    scale: float,
    *,
    max_query_len: int,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    out: torch.Tensor | None = None,
    num_kv_splits: int | None = None,
    workspace: DecodeWorkspace | None = None,
    split_kv: bool | None = None,
    extend_tiles: KernelConfig | None = None,
) -> torch.Tensor:
    """Paged causal attention (same semantics as `paged_attention_reference`), in Triton.

    q [T, Hq, D]; kv_layer [num_token_slots, 2, Hkv, D]; page_table [B, max_pages]; cu_seqlens_q [B+1];
    seq_lens [B] (keys including this step's tokens, already stored). max_query_len (a host int, at
    least the largest cu_seqlens_q difference) up to MAX_SPLIT_QUERY_LEN runs the split-KV kernels, more
    the extend kernel; `split_kv` forces one or the other.
    k_scale, v_scale: host floats, an FP8 pool's scales (real = stored * scale); ignored for other pools.
    out: optional [T, Hq, D] output; rows outside cu_seqlens_q[0]:cu_seqlens_q[B] are left untouched.
    Split-KV only: num_kv_splits (default: the workspace's, or `kv_split_count` at this page table's width:
    callers whose rows must not depend on their batch pass the count for their longest context) and workspace
    (default: allocated with torch.empty per call, which inside CUDA-graph capture comes from the graph's
    pool; shapes are static, so that is valid too). No host sync on either path.
    extend_tiles: the extend kernel's tiles instead of `extend_config(head_dim)` (the tuner's candidates,
    bench/attention_tune.py).
    """
    if out is None:
        out = torch.empty_like(q)
    _check_inputs(q, kv_layer, page_table, cu_seqlens_q, seq_lens, out)
    num_tokens, num_q_heads, head_dim = q.shape
    num_seqs = page_table.shape[0]
    if num_tokens == 0 or num_seqs == 0 or max_query_len <= 0:
        return out
    num_kv_heads = kv_layer.shape[2]
    group = num_q_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    if kv_layer.dtype != FP8_KV_DTYPE:
        k_scale = v_scale = 1.0
    qk_scale = float(scale) * float(k_scale) * LOG2E
    # fp32 inputs: exact fp32 products on the GPU too (the default would be TF32).
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    common = (
        q.stride(0),
        q.stride(1),
        kv_layer.stride(0),
        kv_layer.stride(1),
        kv_layer.stride(2),
        page_table.stride(0),
    )

    dtypes = (q.dtype, kv_layer.dtype, out.dtype)
    if not (max_query_len <= MAX_SPLIT_QUERY_LEN if split_kv is None else split_kv):
        config = extend_tiles or extend_config(head_dim)
        block_m = max(config.block_m, triton.next_power_of_2(group))
        block_q = block_m // group
        # Sum over sequences of ceil(qlen / block_q) is at most both of these.
        num_blocks = min(
            triton.cdiv(num_tokens, block_q) + num_seqs, num_seqs * triton.cdiv(max_query_len, block_q)
        )
        args = (
            q, kv_layer, out, page_table, cu_seqlens_q, seq_lens, num_seqs,
            *common, out.stride(0), out.stride(1), qk_scale, float(v_scale),
        )  # fmt: skip
        meta = dict(
            GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_D=block_d,
            HEAD_DIM=head_dim, PAGE_SIZE=page_size, BLOCK_B=max(16, triton.next_power_of_2(num_seqs)),
            DOT_PRECISION=precision,
        )  # fmt: skip
        launch_kernel(_extend_kernel, (num_blocks, num_kv_heads), args, meta, config, dtypes)
        return out

    if num_kv_splits is None:
        num_kv_splits = (
            workspace.partial_lse.shape[2]
            if workspace is not None
            else kv_split_count(num_kv_heads, page_table.shape[1] * page_size, q.device)
        )
    if workspace is None:
        workspace = decode_workspace(num_tokens, num_q_heads, head_dim, num_kv_splits, q.device)
    partial_out, partial_lse = workspace
    if (
        partial_out.shape[0] < num_tokens
        or partial_out.shape[1:] != (num_q_heads, num_kv_splits, head_dim)
        or partial_lse.shape[0] < num_tokens
        or partial_lse.shape[1:] != (num_q_heads, num_kv_splits)
        or partial_out.stride(-1) != 1
        or partial_lse.stride(-1) != 1
    ):
        raise ValueError(
            f"decode workspace {tuple(partial_out.shape)}/{tuple(partial_lse.shape)} does not fit "
            f"{num_tokens} query rows x {num_q_heads} heads x {num_kv_splits} splits x {head_dim}"
        )
    scratch_strides = (*partial_out.stride()[:3], *partial_lse.stride()[:2])
    config = decode_config(head_dim)
    block_h = max(config.block_m, triton.next_power_of_2(group))
    block_q = block_h // group
    args = (
        q, kv_layer, page_table, cu_seqlens_q, seq_lens, partial_out, partial_lse,
        *common, *scratch_strides, qk_scale, num_kv_splits, num_kv_heads,
    )  # fmt: skip
    meta = dict(
        GROUP=group, BLOCK_Q=block_q, BLOCK_H=block_h, BLOCK_N=config.block_n, BLOCK_D=block_d,
        HEAD_DIM=head_dim, PAGE_SIZE=page_size, DOT_PRECISION=precision,
    )  # fmt: skip
    grid = (num_seqs, num_kv_heads * triton.cdiv(max_query_len, block_q), num_kv_splits)
    launch_kernel(_split_kernel, grid, args, meta, config, dtypes)
    block_s = triton.next_power_of_2(num_kv_splits)
    _merge_kernel[(num_tokens, num_q_heads)](
        partial_out, partial_lse, out, cu_seqlens_q, num_seqs, *scratch_strides, out.stride(0),
        out.stride(1), float(v_scale), num_kv_splits,
        BLOCK_S=block_s, BLOCK_D=block_d, HEAD_DIM=head_dim, **launch_options(),
        num_warps=8 if block_s * block_d >= 8192 else 4,
    )  # fmt: skip
    return out


__all__ = [
    "MAX_SPLIT_QUERY_LEN",
    "DecodeWorkspace",
    "KernelConfig",
    "decode_config",
    "decode_workspace",
    "extend_config",
    "kv_split_count",
    "paged_attention",
]
