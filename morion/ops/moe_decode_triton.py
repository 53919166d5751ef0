"""Fused Triton MoE experts for small token counts (decode, speculative verify): the contract of
`ops.moe.moe_experts_reference` in three kernels (four with FP8 experts, whose token rows are first
quantized per row by `quantize_fp8`, as on the grouped path, unless they come quantized: Qwen3-Next's
post-attention norm quantizes them in its own kernel), instead of the grouped path's two grouped
GEMMs wrapped in about fifteen sort, gather, activation, quantization and combine kernels.

With pair p = t * k + j the j-th routing choice of token t, and P = T * k:

1. gate_up: act[p] = silu(x[t] Wg^T) * (x[t] Wu^T) over the expert's [2I, H] matrix (gate rows first),
   SiLU-mul in the epilogue; with FP8 experts x[t] is the e4m3 row of `quantize_fp8(x, per_row=True)`,
   its scale applied in the epilogue; [P, I] in fp32 for FP8 experts (quantized by the next kernel), else
   in the weights' dtype (where the reference rounds it too).
2. down: pair_out[p] = w[t, j] * (act[p] Wd^T), [P, H] fp32; with FP8 experts act[p] is quantized per row
   in the prologue, exactly as `quantize_fp8` does: in registers when one BLOCK_K spans all I values
   (one pass, weights and rows loaded together), else with the row's amax taken from gate_up's epilogue
   (each program writes its column block's amax of each row: the max of those is the row's, exactly),
   one load before the loop where a pass over the row used to come first.
With `Tiles.split_k` = S > 1 (ops/moe_split_k.py) kernel 1 or 2 sums S slices of its K in programs of
their own into fp32 partials, and `_split_k_sum_kernel` adds them in slice order and applies the
epilogue above (the SwiGLU and act's amax per its own column block; or the scales and routing weight): one
launch more for more programs at one token, where a grid of k pairs x N / BLOCK_N is about one wave.

3. sum: out[t] = sum over j of pair_out[t * k + j] in fp32 and in slot order, rounded once to x's dtype
   (`moe_experts_triton`). `moe_expert_partials` stops before it and returns pair_out as `SlotPartials`,
   for the kernel after the block to add (`slot_sum`: Qwen3-Next's residual add + norm, Flash-Next's
   hyper-connection inject).

Past MAX_PAIRS (prefill, `--moe-kernel triton`) the same kernels run grouped (`grouped=True`): the pairs
sorted by expert on the device (`expert_tiles`, no host sync, a table whose size follows T, k and E only),
a program per (tile of GROUPED_BLOCK_M rows of one expert, column block), tl.dot tiles whose FP8 products
join the fp32 sum every GROUPED_PROMOTE_K of them (the device's tuned grouped entry may choose other rows
and tiles: ops/moe_tune_grouped.py). A row's result still ignores its batch.

Grouping by expert without a sort. A program of kernels 1 and 2 is (pair p, column block). With tl.dot
tiles it reads the P expert ids and goes on only if p is the first pair routed to its expert (the
expert's leader); the leader then computes all of that expert's pairs, BLOCK_M rows at a time, so each
weight tile is read once per call however many tokens chose the expert. Every other program finds no
rows and ends. A GEMV tile takes one row, so a leader would compute its expert's rows one after another:
a shared expert stacked with the routed ones (every token's slot k - 1) made one program loop over all
T rows while the rest of the grid had finished. GEMV tiles skip the grouping instead: each program
computes its own pair, the same arithmetic for the row, and an expert's rows run side by side (its
weight tile read from L2 after the first).

Invariants:
- Capturable: every shape and grid depends only on T, k and the weights; nothing is read back on the
  host. BLOCK_P (the ids vector, next power of two of P) is a compile-time constant, so each CUDA-graph
  bucket compiles once, in its warm-up.
- Deterministic: no atomics. Each pair_out row is written by one program per column block, and the sum
  runs in slot order.
- Batch invariant: a token's result does not depend on the other tokens of the call. Activation scales
  are per row, a row of a `tl.dot` tile never mixes with the others, and the tile shapes are fixed (they
  do not change with T).

The tiles (ops/moe_tiles.py, tuned per device and shape by ops/moe_tune.py) choose each kernel's MMA
mode: `tl.dot` as it is or with swapped operands, or a CUDA-core GEMV, one row per tile, either summing
each K tile's products over K ("gemv") or accumulating them per (K position, column) across the K tiles
and summing over K once ("gemv_acc"). e4m3 and bf16 products are exact in fp32: the modes differ only in
their fp32 summation order.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from morion.ops.fp8 import FP8_MAX, MIN_SCALE, QuantizedRows, rows_quantized
from morion.ops.moe_split_k import (
    SPLIT_SUM_BLOCK,
    k_slice,
    split_partials,
    split_sum_program,
    store_partial,
    sum_slices,
)
from morion.ops.moe_tiles import GroupedTiles, Tiles, tuned_grouped_on, tuned_tiles_on
from morion.ops.pdl import launch_options, wait_for_previous_kernel
from morion.ops.slot_partials import SlotPartials

# The ids vector of one call fits a program's registers up to here (T = 64 at top-10: 640 pairs).
MAX_PAIRS = 1024
_BLOCK_M = 16  # rows (pairs of one expert) per MMA tile: the smallest `tl.dot` takes
GROUPED_BLOCK_M = 64  # rows (pairs of one expert) per tile of the grouped kernels (prefill)
# FP8 products of a row that the tensor core sums in its reduced-precision accumulator before they join
# a grouped tile's fp32 sum (`_mma`'s PROMOTE_K, at most the tile's BLOCK_K): 128, as CUTLASS's FP8 GEMMs
# promote every four 32-deep MMA instructions (torch._scaled_grouped_mm, what `auto` runs, among them).
# 0 (every instruction, what these kernels did first) makes each add wait for its wgmma: on the H200 the
# FP8 grouped mode then took 2,175 us a layer at 1K tokens against torch's 958, where the bf16 one,
# which has no such wait, streamed its weights at 3 TB/s (results/2026-12-05-session-35-notes.md).
GROUPED_PROMOTE_K = 128
_SUM_BLOCK = 512


# Defaults by the weights' element size in bytes (BLOCK_K spans 128 bytes of a weight row), for shapes
# without a tuned file (ops/moe_tiles.py): at T = 1 and Qwen3-Next's shapes, 10 x 16 programs per kernel,
# each streaming 128 KiB (gate_up) or 64 KiB (down) of FP8 weights. The same tiles for every T keep
# results batch invariant.
GATE_UP_TILES = {1: Tiles(32, 128, 4, 4), 2: Tiles(32, 64, 4, 4), 4: Tiles(32, 32, 4, 4)}
DOWN_TILES = {1: Tiles(128, 128, 4, 3), 2: Tiles(128, 64, 4, 3), 4: Tiles(128, 32, 4, 3)}
# The grouped mode's (gate_up, down) tiles, by element size, where the device's tuned file has none
# (ops/moe_tune_grouped.py): tl.dot over GROUPED_BLOCK_M rows of one expert. `--moe-kernel triton` runs
# the grouped mode past MAX_PAIRS; `auto` runs it where a tuned file measured it ahead of torch's grouped
# GEMMs (layers/moe.py).
GROUPED_TILES = {
    1: (Tiles(64, 128, 4, 3), Tiles(128, 128, 4, 3)),
    2: (Tiles(64, 64, 4, 3), Tiles(128, 64, 4, 3)),
    4: (Tiles(32, 32, 4, 2), Tiles(64, 32, 4, 2)),
}


@triton.jit
def _expert_group(ids_ptr, num_pairs, BLOCK_P: tl.constexpr):
    """This program's expert (that of pair program_id(0)) and its rows: `count` is the number of pairs
    routed to it if this pair is its first one, else 0; `match` marks those pairs and `rank` numbers them
    in pair order (valid where `match`)."""
    pair = tl.program_id(0)
    offs = tl.arange(0, BLOCK_P)
    ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1)
    expert = tl.load(ids_ptr + tl.program_id(0))
    match = ids == expert
    matched = tl.cast(match, tl.int32)
    first = tl.min(tl.where(match, offs, BLOCK_P), axis=0)
    count = tl.where(first == pair, tl.sum(matched, axis=0), 0)
    rank = tl.cumsum(matched, axis=0) - 1
    return tl.cast(expert, tl.int64), count, match, rank


@triton.jit
def _group_rows(match, rank, start, count, BLOCK_P: tl.constexpr, BLOCK_M: tl.constexpr):
    """The pairs of the group's rows start .. start + BLOCK_M - 1, and which of those rows exist."""
    rows = start + tl.arange(0, BLOCK_M)
    offs = tl.arange(0, BLOCK_P)
    chosen = match[None, :] & (rank[None, :] == rows[:, None])
    pairs = tl.sum(tl.where(chosen, offs[None, :], 0), axis=1)
    return pairs, rows < count


@triton.jit
def _expert_rows(
    ids_ptr, tiles_ptr, num_pairs, GROUPED: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_M: tl.constexpr
):  # fmt: skip
    """This program's expert, its first row and row count, and what `_rows_at` finds its rows with:
    grouped, tile program_id(0) of the table (expert, first row, end row) over the pairs sorted by expert
    (an unused tile has no rows; `match` and `rank` unused); one-row (GEMV) tiles, pair program_id(0)
    alone (`match` holds the pair, `rank` unused); else the decode kernels' leader group (a count only
    for the expert's first pair)."""
    if GROUPED:
        tile = tl.program_id(0)
        expert = tl.cast(tl.load(tiles_ptr + tile * 3), tl.int64)
        first = tl.load(tiles_ptr + tile * 3 + 1)
        count = tl.load(tiles_ptr + tile * 3 + 2) - first
        match = first
        rank = first
    elif BLOCK_M == 1:
        pair = tl.program_id(0)
        expert = tl.cast(tl.load(ids_ptr + tl.program_id(0)), tl.int64)
        first = 0
        count = 1
        match = pair
        rank = pair
    else:
        expert, count, match, rank = _expert_group(ids_ptr, num_pairs, BLOCK_P)
        first = 0
    return expert, first, count, match, rank


@triton.jit
def _rows_at(
    order_ptr, first, match, rank, start, count,
    GROUPED: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """The pairs of the expert's rows start .. start + BLOCK_M - 1, and which of those rows exist."""
    if GROUPED:
        rows = start + tl.arange(0, BLOCK_M)
        rows_ok = rows < count
        pairs = tl.load(order_ptr + first + rows, mask=rows_ok, other=0)
    elif BLOCK_M == 1:
        pairs = match + tl.arange(0, 1)
        rows_ok = pairs >= 0
    else:
        pairs, rows_ok = _group_rows(match, rank, start, count, BLOCK_P, BLOCK_M)
    return pairs, rows_ok


# How a tile multiplies its rows by the weights (`Tiles.mma`): tl.dot with the rows as the MMA's M side;
# tl.dot with the operands swapped (the weight columns on the M side, big enough for Hopper's wgmma);
# or no MMA (one row per tile, products and sums on the CUDA cores, as a GEMV).
MMA_DOT = tl.constexpr(0)
MMA_SWAPPED = tl.constexpr(1)
MMA_GEMV = tl.constexpr(2)
_MMA_MODES = {"dot": MMA_DOT.value, "swapped": MMA_SWAPPED.value, "gemv": MMA_GEMV.value}
# The MoE decode kernels' own GEMV, "gemv_acc" (the skinny linear and NVFP4 kernels refuse it): a row's
# products accumulate per (K position, column) in a [BLOCK_K, BLOCK_N] fp32 accumulator, in the weight
# tile's own layout, across the K tiles, and are summed over K once at the end, where "gemv" sums each
# tile's products over K (across threads, and across warps through shared memory, every K tile). The
# accumulator holds BLOCK_K x BLOCK_N / (32 x warps) registers a thread: tiles must stay small.
# Weights widen by Triton's cast (e4m3: the hardware's two-a-time unpack to fp16, then fp32); placing
# e4m3 bits in an fp16 by integer ops compiled to 1.5x to 2.6x the loop's sm_90 instructions.
MMA_GEMV_ACC = tl.constexpr(3)
_DECODE_MMA_MODES = {**_MMA_MODES, "gemv_acc": MMA_GEMV_ACC.value}


@triton.jit
def _zero_acc(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MMA: tl.constexpr, BLOCK_K: tl.constexpr = 0):
    """An fp32 accumulator for rows x columns, kept transposed for swapped operands (`_mma`), and for
    MMA_GEMV_ACC (one row) K positions x columns: its callers pass their BLOCK_K."""
    if MMA == MMA_SWAPPED:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    elif MMA == MMA_GEMV_ACC:
        acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    return acc


@triton.jit
def _mma(a, w, acc, MMA: tl.constexpr, DOT_PRECISION: tl.constexpr, PROMOTE_K: tl.constexpr = -1):
    """acc + a @ w for rows a [BLOCK_M, BLOCK_K] and weights w [BLOCK_K, BLOCK_N]: by tl.dot, by tl.dot
    as w^T @ a^T into the transposed accumulator (not with FP8 weights: `exact_mma`), or as fp32
    products summed over K (e4m3 and bf16 products are exact in fp32, so only the summation order
    differs from the MMA's). Each row's result is its own dot products in every mode, independent of
    the other rows. PROMOTE_K >= 0 (the grouped kernels, whose 64-row tiles make Hopper's wgmma): the
    tensor core sums at most PROMOTE_K FP8 products of a row in its reduced-precision accumulator before
    they join the fp32 sum (`max_num_imprecise_acc`; 0: after every MMA instruction), never all of K
    (Triton's default on sm_90); -1 leaves tl.dot as it is."""
    if MMA == MMA_GEMV:
        products = tl.cast(a, tl.float32)[:, :, None] * tl.cast(w, tl.float32)[None, :, :]
        acc = acc + tl.sum(products, axis=1)
    elif MMA == MMA_GEMV_ACC:
        acc = acc + tl.cast(tl.trans(a), tl.float32) * tl.cast(w, tl.float32)
    elif MMA == MMA_SWAPPED:
        acc = tl.dot(tl.trans(w), tl.trans(a), acc, input_precision=DOT_PRECISION)
    elif PROMOTE_K >= 0:
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION, max_num_imprecise_acc=PROMOTE_K)
    else:
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _rows_first(acc, MMA: tl.constexpr):
    """The accumulator as [BLOCK_M, BLOCK_N]: MMA_GEMV_ACC's summed over K here, once."""
    if MMA == MMA_SWAPPED:
        acc = tl.trans(acc)
    elif MMA == MMA_GEMV_ACC:
        acc = tl.sum(acc, axis=0)[None, :]
    return acc


# Arguments that vary with the batch (sequence and token counts, the page table's width) are not
# specialized on: Triton would compile a variant per value class (1, a multiple of 16, other) the first
# time a request brings one, stalling every running request for seconds (seen through the server on
# the H200: a 4.1 s TTFT); one variant serves every batch. runner/warmup.py compiles the rest.
@triton.jit
def _swiglu_epilogue(
    acc_gate, acc_up, pairs, rows_ok, tokens, expert, cols, cols_ok, x_scale_ptr, w_scale_ptr, act_ptr,
    amax_ptr, stride_se, inter_size, FP8: tl.constexpr,
):  # fmt: skip
    """act[p, cols] = silu(gate) * up for the pairs p of these rows from their sums over all of K (with FP8
    experts: unscaled, times the row's and the columns' scales here), and with FP8 experts this column
    block's share of each row's amax at amax[p, program_id(1)] of num_programs(1) blocks: the down kernel
    takes the row's amax as their max (exact, in any order) instead of a pass over the row before its
    loop. The gate_up kernel's epilogue, or the split-K sum kernel's."""
    if FP8:
        x_scale = tl.load(x_scale_ptr + tokens, mask=rows_ok, other=0.0)[:, None]
        scales = w_scale_ptr + expert * stride_se + cols
        acc_gate = acc_gate * x_scale * tl.load(scales, mask=cols_ok, other=0.0)[None, :]
        acc_up = acc_up * x_scale * tl.load(scales + inter_size, mask=cols_ok, other=0.0)[None, :]
    act = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up
    out = act_ptr + pairs[:, None] * inter_size + cols[None, :]
    tl.store(out, tl.cast(act, act_ptr.dtype.element_ty), mask=rows_ok[:, None] & cols_ok[None, :])
    if FP8:
        part = tl.max(tl.where(rows_ok[:, None] & cols_ok[None, :], tl.abs(act), 0.0), axis=1)
        tl.store(amax_ptr + pairs * tl.num_programs(1) + tl.program_id(1), part, mask=rows_ok)


@triton.jit(do_not_specialize=["num_pairs"])
def _gate_up_kernel(
    x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, ids_ptr, tiles_ptr, order_ptr, act_ptr, amax_ptr, partial_ptr,
    num_pairs, top_k, hidden_size, inter_size, stride_x, stride_we, stride_wn, stride_se,
    GROUPED: tl.constexpr, FP8: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    MMA: tl.constexpr, SPLIT_K: tl.constexpr, PROMOTE_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous_kernel(USE_PDL)
    expert, first, count, match, rank = _expert_rows(ids_ptr, tiles_ptr, num_pairs, GROUPED, BLOCK_P, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_ok = cols < inter_size
    w_gate = w_ptr + expert * stride_we + cols[None, :] * stride_wn
    w_up = w_gate + inter_size * stride_wn
    k_begin, k_end = k_slice(hidden_size, SPLIT_K, BLOCK_K)
    for start in range(0, count, BLOCK_M):
        pairs, rows_ok = _rows_at(order_ptr, first, match, rank, start, count, GROUPED, BLOCK_P, BLOCK_M)
        tokens = pairs // top_k
        x_rows = x_ptr + tokens[:, None] * stride_x
        acc_gate = _zero_acc(BLOCK_M, BLOCK_N, MMA, BLOCK_K)
        acc_up = _zero_acc(BLOCK_M, BLOCK_N, MMA, BLOCK_K)
        for k0 in range(k_begin, k_end, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            ks_ok = ks < hidden_size
            w_mask = ks_ok[:, None] & cols_ok[None, :]
            w_g = tl.load(w_gate + ks[:, None], mask=w_mask, other=0.0)
            w_u = tl.load(w_up + ks[:, None], mask=w_mask, other=0.0)
            x = tl.load(x_rows + ks[None, :], mask=rows_ok[:, None] & ks_ok[None, :], other=0.0)
            x = tl.cast(x, w_g.dtype)
            acc_gate = _mma(x, w_g, acc_gate, MMA, DOT_PRECISION, PROMOTE_K)
            acc_up = _mma(x, w_u, acc_up, MMA, DOT_PRECISION, PROMOTE_K)
        acc_gate = _rows_first(acc_gate, MMA)
        acc_up = _rows_first(acc_up, MMA)
        if SPLIT_K == 1:
            _swiglu_epilogue(
                acc_gate, acc_up, pairs, rows_ok, tokens, expert, cols, cols_ok, x_scale_ptr, w_scale_ptr,
                act_ptr, amax_ptr, stride_se, inter_size, FP8,
            )  # fmt: skip
        else:
            width = 2 * inter_size
            store_partial(partial_ptr, acc_gate, pairs, rows_ok, cols, cols_ok, num_pairs, width, 0)
            store_partial(partial_ptr, acc_up, pairs, rows_ok, cols, cols_ok, num_pairs, width, inter_size)


@triton.jit
def _row_scale(
    amax_ptr,
    pairs,
    rows_ok,
    amax_blocks,
    AMAX_BLOCK: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
):
    """The FP8 scale of each act row, as `quantize_fp8(act, per_row=True)`'s: its amax over all I columns
    is the max of the column blocks' amax that the SwiGLU epilogue wrote, one load a row. IEEE-rounded
    division (Triton's `/` is approximate on the GPU): torch's scale."""
    blocks = tl.arange(0, AMAX_BLOCK)
    parts = tl.load(
        amax_ptr + pairs[:, None] * amax_blocks + blocks[None, :],
        mask=rows_ok[:, None] & (blocks < amax_blocks)[None, :],
        other=0.0,
    )
    return tl.maximum(tl.math.div_rn(tl.max(parts, axis=1), FP8_MAX), MIN_SCALE)


@triton.jit
def _routed_epilogue(
    acc, a_scale, pairs, rows_ok, expert, cols, cols_ok, w_scale_ptr, routing_ptr, pair_out_ptr, stride_se,
    hidden_size, FP8: tl.constexpr,
):  # fmt: skip
    """pair_out[p, cols] = routing[p] * acc in fp32 for the pairs p of these rows, from their sums over all
    of I (with FP8 experts: unscaled, times the act row's and the columns' scales here). The down kernel's
    epilogue, or the split-K sum kernel's."""
    if FP8:
        w_scale = tl.load(w_scale_ptr + expert * stride_se + cols, mask=cols_ok, other=0.0)
        acc = acc * a_scale[:, None] * w_scale[None, :]
    routing = tl.cast(tl.load(routing_ptr + pairs, mask=rows_ok, other=0.0), tl.float32)
    out = pair_out_ptr + pairs[:, None] * hidden_size + cols[None, :]
    tl.store(out, acc * routing[:, None], mask=rows_ok[:, None] & cols_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def _down_kernel(
    act_ptr, amax_ptr, w_ptr, w_scale_ptr, ids_ptr, tiles_ptr, order_ptr, topk_weights_ptr, pair_out_ptr,
    partial_ptr, num_pairs, hidden_size, inter_size, amax_blocks, stride_we, stride_wn, stride_se,
    GROUPED: tl.constexpr, FP8: tl.constexpr, DOT_PRECISION: tl.constexpr, FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, SINGLE_PASS: tl.constexpr, MMA: tl.constexpr, AMAX_BLOCK: tl.constexpr,
    SPLIT_K: tl.constexpr, PROMOTE_K: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous_kernel(USE_PDL)
    expert, first, count, match, rank = _expert_rows(ids_ptr, tiles_ptr, num_pairs, GROUPED, BLOCK_P, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_ok = cols < hidden_size
    w_cols = w_ptr + expert * stride_we + cols[None, :] * stride_wn
    k_begin, k_end = k_slice(inter_size, SPLIT_K, BLOCK_K)
    for start in range(0, count, BLOCK_M):
        pairs, rows_ok = _rows_at(order_ptr, first, match, rank, start, count, GROUPED, BLOCK_P, BLOCK_M)
        act_rows = act_ptr + pairs[:, None] * inter_size
        a_scale = tl.full((BLOCK_M,), 1.0, tl.float32)  # unquantized act: unread
        if SINGLE_PASS:
            # BLOCK_K spans all I columns: the weight tile and the activation rows are loaded at once,
            # with no dependent second pass, and the row scale comes from the rows in registers.
            ks = tl.arange(0, BLOCK_K)
            ks_ok = ks < inter_size
            w = tl.load(w_cols + ks[:, None], mask=ks_ok[:, None] & cols_ok[None, :], other=0.0)
            a = tl.load(act_rows + ks[None, :], mask=rows_ok[:, None] & ks_ok[None, :], other=0.0)
            if FP8:
                a_scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(a), axis=1), FP8_MAX), MIN_SCALE)
                a = tl.minimum(tl.maximum(tl.math.div_rn(a, a_scale[:, None]), -FP8_MAX), FP8_MAX)
                a = tl.cast(a, w.dtype, fp_downcast_rounding="rtne")
            acc = _mma(a, w, _zero_acc(BLOCK_M, BLOCK_N, MMA, BLOCK_K), MMA, DOT_PRECISION, PROMOTE_K)
            acc = _rows_first(acc, MMA)
        else:
            if FP8:
                # The row's scale first: one load of gate_up's column blocks' amax.
                a_scale = _row_scale(amax_ptr, pairs, rows_ok, amax_blocks, AMAX_BLOCK, FP8_MAX, MIN_SCALE)
            acc = _zero_acc(BLOCK_M, BLOCK_N, MMA, BLOCK_K)
            for k0 in range(k_begin, k_end, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                ks_ok = ks < inter_size
                w = tl.load(w_cols + ks[:, None], mask=ks_ok[:, None] & cols_ok[None, :], other=0.0)
                a = tl.load(act_rows + ks[None, :], mask=rows_ok[:, None] & ks_ok[None, :], other=0.0)
                if FP8:
                    a = tl.minimum(tl.maximum(tl.math.div_rn(a, a_scale[:, None]), -FP8_MAX), FP8_MAX)
                    a = tl.cast(a, w.dtype, fp_downcast_rounding="rtne")
                acc = _mma(a, w, acc, MMA, DOT_PRECISION, PROMOTE_K)
            acc = _rows_first(acc, MMA)
        if SPLIT_K == 1:
            _routed_epilogue(
                acc, a_scale, pairs, rows_ok, expert, cols, cols_ok, w_scale_ptr, topk_weights_ptr,
                pair_out_ptr, stride_se, hidden_size, FP8,
            )  # fmt: skip
        else:
            store_partial(partial_ptr, acc, pairs, rows_ok, cols, cols_ok, num_pairs, hidden_size, 0)


@triton.jit(do_not_specialize=["num_pairs"])
def _split_k_sum_kernel(
    partial_ptr, x_scale_ptr, amax_in_ptr, w_scale_ptr, ids_ptr, routing_ptr, out_ptr, amax_out_ptr,
    num_pairs, top_k, width, amax_blocks, stride_se,
    SWIGLU: tl.constexpr, FP8: tl.constexpr, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
    SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, AMAX_BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """Split K's epilogue (ops/moe_split_k.py), a program per (pair, column block): the pair's SPLIT_K
    partials added in slice order, then the fused kernel's epilogue. SWIGLU: partial [S, P, 2I] (gate,
    then up) into act [P, I] (width I) and, with FP8 experts, act's amax per this kernel's column block
    (amax_out); else partial [S, P, H] into pair_out [P, H] (width H), the act rows' scales from amax_in."""
    wait_for_previous_kernel(USE_PDL)
    pairs, rows_ok, cols, cols_ok = split_sum_program(num_pairs, width, BLOCK_N)
    expert = tl.cast(tl.load(ids_ptr + tl.program_id(0)), tl.int64)
    if SWIGLU:
        gate = sum_slices(partial_ptr, pairs, cols, cols_ok, num_pairs, 2 * width, SPLIT_K, BLOCK_N)
        up = sum_slices(partial_ptr + width, pairs, cols, cols_ok, num_pairs, 2 * width, SPLIT_K, BLOCK_N)
        _swiglu_epilogue(
            gate, up, pairs, rows_ok, pairs // top_k, expert, cols, cols_ok, x_scale_ptr, w_scale_ptr,
            out_ptr, amax_out_ptr, stride_se, width, FP8,
        )  # fmt: skip
    else:
        acc = sum_slices(partial_ptr, pairs, cols, cols_ok, num_pairs, width, SPLIT_K, BLOCK_N)
        a_scale = tl.full((1,), 1.0, tl.float32)  # unquantized act: unread
        if FP8:
            a_scale = _row_scale(amax_in_ptr, pairs, rows_ok, amax_blocks, AMAX_BLOCK, FP8_MAX, MIN_SCALE)
        _routed_epilogue(
            acc, a_scale, pairs, rows_ok, expert, cols, cols_ok, w_scale_ptr, routing_ptr, out_ptr, stride_se,
            width, FP8,
        )  # fmt: skip


@triton.jit
def slot_sum(values_ptr, token, hidden, cols, mask, SLOTS: tl.constexpr, BLOCK: tl.constexpr):
    """The fp32 sum of `token`'s SLOTS rows of values [T, SLOTS, hidden] (a MoE block's weighted pair
    outputs, `SlotPartials`) at `cols` [BLOCK], in slot order: the one order of every kernel that adds
    them (the sum kernel here, the residual add + norm and the hyper-connection inject), so each gives
    the others' bits."""
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for slot in tl.static_range(SLOTS):
        acc += tl.load(values_ptr + (token * SLOTS + slot) * hidden + cols, mask=mask, other=0.0)
    return acc


@triton.jit
def _sum_slots_kernel(
    pair_out_ptr, out_ptr, hidden_size, stride_out,
    SLOTS: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous_kernel(USE_PDL)
    token = tl.cast(tl.program_id(0), tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cols_ok = cols < hidden_size
    acc = slot_sum(pair_out_ptr, token, hidden_size, cols, cols_ok, SLOTS, BLOCK)
    tl.store(out_ptr + token * stride_out + cols, tl.cast(acc, out_ptr.dtype.element_ty), mask=cols_ok)


def expert_tiles(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tiles int32 [cdiv(P, block_m) + min(E, P), 3], order int32 [P]): `order` lists the pairs p = t * k
    + j sorted by expert (stable); tile i covers rows tiles[i, 1] .. tiles[i, 2] - 1 of that order, at
    most block_m, all routed to expert tiles[i, 0]. Tiles past the last expert's are empty (end = first
    row). Device-side torch ops, no host sync: the table's size depends only on P and E."""
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    ends = torch.cumsum(counts, 0)
    tiles_per_expert = (counts + block_m - 1) // block_m
    tile_ends = torch.cumsum(tiles_per_expert, 0)
    tile = torch.arange(
        triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs), device=flat.device, dtype=torch.int64
    )
    expert = torch.searchsorted(tile_ends, tile, right=True)  # the first expert whose tiles end after it
    used = expert < num_experts
    expert = expert.clamp_(max=num_experts - 1)
    first = ends[expert] - counts[expert] + (tile - (tile_ends[expert] - tiles_per_expert[expert])) * block_m
    end = torch.where(used, torch.minimum(first + block_m, ends[expert]), first)
    return torch.stack((expert, first, end), dim=1).to(torch.int32), order.to(torch.int32)


def exact_mma(tiles: Tiles, fp8: bool) -> bool:
    """Whether `tiles` keeps every product in a full fp32 sum. Swapped FP8 operands do not on Hopper: the
    weight columns fill wgmma's M side, and Triton lets FP8 wgmma add all of K in the tensor core's
    reduced-precision accumulator (measured on the H200: 1e-2 from the fp32 reference where the other
    modes are at 4e-7, enough to flip the re-quantized SwiGLU output). So they are never run."""
    return not (fp8 and tiles.mma == "swapped")


def _mma_options(tiles: Tiles, fp8: bool, modes: dict[str, int] = _MMA_MODES) -> dict[str, int]:
    """A kernel's MMA mode (one of `modes`: the MoE decode kernels take _DECODE_MMA_MODES) and rows per
    tile for `tiles`: one row for a GEMV tile, else _BLOCK_M."""
    if tiles.mma not in modes:
        raise ValueError(f"unknown MoE tile mma {tiles.mma!r}: expected one of {sorted(modes)}")
    if not exact_mma(tiles, fp8):
        raise ValueError(f"MoE tile {tuple(tiles)}: swapped operands lose precision with FP8 weights")
    gemv = modes[tiles.mma] in (MMA_GEMV.value, MMA_GEMV_ACC.value)
    return {"MMA": modes[tiles.mma], "BLOCK_M": 1 if gemv else _BLOCK_M}


def _check_split_k(gate_up_tiles: Tiles, down_tiles: Tiles, inter_size: int, grouped: bool) -> None:
    """Split K (ops/moe_split_k.py) is for the decode kernels' two-pass tiles: the grouped kernels and a
    one-pass down tile (BLOCK_K spanning all of I: one K tile, nothing to split) refuse it."""
    for kernel, tiles in (("gate_up", gate_up_tiles), ("down", down_tiles)):
        if tiles.split_k < 1:
            raise ValueError(f"MoE {kernel} tile {tuple(tiles)}: split_k must be at least 1")
        if tiles.split_k > 1 and grouped:
            raise ValueError("split_k is for the MoE decode kernels; the grouped kernels take split_k = 1")
    if down_tiles.split_k > 1 and down_tiles.block_k >= inter_size:
        raise ValueError(
            f"MoE down tile {tuple(down_tiles)}: a one-pass tile (BLOCK_K >= I) takes split_k = 1"
        )


def moe_expert_partials(
    hidden: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    gate_up_scale: torch.Tensor | None = None,
    down_scale: torch.Tensor | None = None,
    gate_up_tiles: Tiles | None = None,
    down_tiles: Tiles | None = None,
    quantized: QuantizedRows | None = None,
    grouped: bool = False,
    block_m: int | None = None,
    promote_k: int | None = None,
) -> SlotPartials:
    """The contract of `moe_experts_reference` up to its last step, each token's sum over its slots: the
    weighted output of every (token, slot) pair, [T, k, H] fp32 (`SlotPartials`; `moe_experts_triton`
    adds them up; the kernel after a Qwen3-Next or Flash-Next block does it itself). hidden [T, H] (unit
    stride on H); gate_up_proj [E, 2I, H] and down_proj [E, H, I] with unit stride on their last dim,
    e4m3 with `gate_up_scale` [E, 2I] and `down_scale` [E, H] (fp32), or bf16, fp16 or fp32;
    topk_weights, topk_ids [T, k] with T * k <= MAX_PAIRS. Tiles: the device's tuned file for this shape
    (ops/moe_tiles.py), else the defaults; `*_tiles` override both (the tuner's sweep). FP8 experts read
    hidden's rows from `quantized` where given (`quantize_fp8(hidden, per_row=True)`'s values, made by the
    norm before: its kernel does it), else quantize them here.

    `grouped`: any number of tokens (prefill): each program a tile of `block_m` rows of one expert over
    the pairs sorted by expert on the device (`expert_tiles`), tl.dot tiles, FP8 products summed in fp32
    every `promote_k` of them (`_mma`); the tiles, `block_m` and `promote_k` from the device's tuned
    file's grouped entry where it has one, else GROUPED_TILES, GROUPED_BLOCK_M and GROUPED_PROMOTE_K
    (arguments override them: the tuner's sweep). The same contract, the results within rounding of the
    decode kernels' (another summation order)."""
    tokens, top_k = topk_ids.shape
    num_pairs = tokens * top_k
    if not grouped and num_pairs > MAX_PAIRS:
        raise ValueError(f"{tokens} tokens x top-{top_k} = {num_pairs} pairs, more than {MAX_PAIRS}")
    hidden_size, inter_size = down_proj.shape[1], down_proj.shape[2]
    if tokens == 0:
        return SlotPartials(hidden.new_zeros(0, top_k, hidden_size, dtype=torch.float32), hidden.dtype)
    fp8 = gate_up_scale is not None and down_scale is not None
    width = gate_up_proj.element_size()
    tuned = None
    if grouped:
        choice = grouped_choice(hidden, gate_up_proj, down_proj)
        tuned = (choice.gate_up, choice.down)
        block_m = block_m or choice.block_m
        promote_k = choice.promote_k if promote_k is None else promote_k
        if block_m < 16 or block_m & (block_m - 1) or promote_k < 0:
            raise ValueError(
                f"grouped MoE tiles take block_m a power of two of at least 16 and promote_k >= 0, got "
                f"{block_m} and {promote_k}"
            )
    else:
        tuned = tuned_tiles_on(hidden.device, gate_up_proj, down_proj)
    gate_up_tiles = gate_up_tiles or (tuned[0] if tuned else GATE_UP_TILES[width])
    down_tiles = down_tiles or (tuned[1] if tuned else DOWN_TILES[width])
    if grouped and (gate_up_tiles.mma != "dot" or down_tiles.mma != "dot"):
        raise ValueError("the grouped MoE kernels take tl.dot tiles (mma 'dot') only")
    _check_split_k(gate_up_tiles, down_tiles, inter_size, grouped)
    if fp8:
        # A kernel of its own (or the norm's before: `quantized`), not the gate_up prologue: there every
        # (pair, N tile) program re-quantized its rows for each K block, spilling registers; with it, the
        # only per-token change on that path, the 80B's decode step went from 5.7 to 9.6 ms on the H200
        # (results/2026-12-02-h200-session-notes-e5d0a5d.md).
        x, x_scale = rows_quantized(hidden, quantized)
    else:
        x, x_scale, gate_up_scale, down_scale = hidden, hidden, gate_up_proj, down_proj  # scales unread
    # Where the reference rounds its SwiGLU output (unquantized weights), or what FP8 quantizes (fp32).
    act_dtype = torch.float32 if fp8 else gate_up_proj.dtype
    act = torch.empty(num_pairs, inter_size, dtype=act_dtype, device=hidden.device)
    # FP8: each act row's amax per column block of the kernel that writes act (gate_up, or its split-K
    # sum), for the down kernel's row scale.
    act_block = SPLIT_SUM_BLOCK if gate_up_tiles.split_k > 1 else gate_up_tiles.block_n
    amax_blocks = triton.cdiv(inter_size, act_block) if fp8 else 1
    amax = torch.empty(num_pairs, amax_blocks, dtype=torch.float32, device=hidden.device) if fp8 else act
    pair_out = torch.empty(num_pairs, hidden_size, dtype=torch.float32, device=hidden.device)
    ids = topk_ids.reshape(-1).contiguous()
    routing = topk_weights.reshape(-1).contiguous()
    if grouped:
        tiles, order = expert_tiles(topk_ids, gate_up_proj.shape[0], block_m)
        programs, block_p, rows = tiles.shape[0], 1, {"BLOCK_M": block_m}
    else:
        tiles = order = ids  # unread
        programs, block_p, rows = num_pairs, triton.next_power_of_2(num_pairs), {}
    common = dict(
        GROUPED=grouped,
        FP8=fp8,
        DOT_PRECISION="ieee" if gate_up_proj.dtype == torch.float32 else "tf32",
        BLOCK_P=block_p,
    )
    # The act rows' FP8 scales: the down kernel's and the split-K sum kernel's.
    scale_rows = dict(FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE, AMAX_BLOCK=triton.next_power_of_2(amax_blocks))
    t = gate_up_tiles
    partial = split_partials(t.split_k, num_pairs, 2 * inter_size, act)
    _gate_up_kernel[(programs, triton.cdiv(inter_size, t.block_n), t.split_k)](
        x, x_scale, gate_up_proj, gate_up_scale, ids, tiles, order, act, amax, partial,
        num_pairs, top_k, hidden_size, inter_size,
        x.stride(0), gate_up_proj.stride(0), gate_up_proj.stride(1), gate_up_scale.stride(0),
        **common, **{**_mma_options(t, fp8, _DECODE_MMA_MODES), **rows}, BLOCK_N=t.block_n,
        BLOCK_K=t.block_k, SPLIT_K=t.split_k, PROMOTE_K=_promote(grouped, promote_k, t),
        **launch_options(), num_warps=t.num_warps, num_stages=t.num_stages,
    )  # fmt: skip
    if t.split_k > 1:
        _sum_split_k(partial, x_scale, amax, gate_up_scale, ids, routing, act, top_k, fp8, scale_rows)
    t = down_tiles
    partial = split_partials(t.split_k, num_pairs, hidden_size, pair_out)
    _down_kernel[(programs, triton.cdiv(hidden_size, t.block_n), t.split_k)](
        act, amax, down_proj, down_scale, ids, tiles, order, routing, pair_out, partial,
        num_pairs, hidden_size, inter_size, amax_blocks,
        down_proj.stride(0), down_proj.stride(1), down_scale.stride(0),
        **common, **{**_mma_options(t, fp8, _DECODE_MMA_MODES), **rows}, **scale_rows,
        SINGLE_PASS=t.block_k >= inter_size, BLOCK_N=t.block_n, BLOCK_K=t.block_k, SPLIT_K=t.split_k,
        PROMOTE_K=_promote(grouped, promote_k, t), **launch_options(), num_warps=t.num_warps,
        num_stages=t.num_stages,
    )  # fmt: skip
    if t.split_k > 1:
        _sum_split_k(partial, x_scale, amax, down_scale, ids, routing, pair_out, top_k, fp8, scale_rows)
    return SlotPartials(pair_out.view(tokens, top_k, hidden_size), hidden.dtype)


def grouped_choice(hidden: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> GroupedTiles:
    """The grouped kernels' tiles for these experts on hidden's device: the device's tuned ones, else the
    defaults."""
    tuned = tuned_grouped_on(hidden.device, gate_up_proj, down_proj)
    if tuned is not None:
        return tuned
    return GroupedTiles(GROUPED_BLOCK_M, GROUPED_PROMOTE_K, *GROUPED_TILES[gate_up_proj.element_size()])


def _promote(grouped: bool, promote_k: int | None, tiles: Tiles) -> int:
    """`_mma`'s PROMOTE_K for a kernel of these tiles: -1 (tl.dot as it is) for the decode kernels, else
    `promote_k` capped at the tile's BLOCK_K (Triton refuses more than the dot's K for FP8)."""
    return min(promote_k, tiles.block_k) if grouped and promote_k is not None else -1


def _sum_split_k(
    partial: torch.Tensor,
    x_scale: torch.Tensor,
    amax: torch.Tensor,
    w_scale: torch.Tensor,
    ids: torch.Tensor,
    routing: torch.Tensor,
    out: torch.Tensor,
    top_k: int,
    fp8: bool,
    scale_rows: dict[str, Any],
) -> None:
    """`_split_k_sum_kernel` on partial [S, P, N]: act [P, I] (N = 2I: the SwiGLU, with FP8 experts act's
    amax per column block into `amax`) or pair_out [P, H] (N = H: the act rows' scales from `amax`)."""
    split_k, num_pairs, width = partial.shape[0], out.shape[0], out.shape[1]
    _split_k_sum_kernel[(num_pairs, triton.cdiv(width, SPLIT_SUM_BLOCK))](
        partial, x_scale, amax, w_scale, ids, routing, out, amax, num_pairs, top_k, width, amax.shape[-1],
        w_scale.stride(0), SWIGLU=partial.shape[2] == 2 * width, FP8=fp8, **scale_rows, SPLIT_K=split_k,
        BLOCK_N=SPLIT_SUM_BLOCK, **launch_options(), num_warps=2,
    )  # fmt: skip


def moe_experts_triton(*args: Any, **options: Any) -> torch.Tensor:
    """`moe_expert_partials` (the same arguments) with each token's slots summed: the contract of
    `moe_experts_reference`, [T, H] in hidden's dtype."""
    return moe_expert_partials(*args, **options).summed()


def sum_slots(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """values [T, S, H] fp32 (contiguous) -> [T, H] in `dtype`: each token's S slots added in slot order
    in fp32, rounded once (`SlotPartials.summed`)."""
    tokens, slots, hidden_size = values.shape
    out = torch.empty(tokens, hidden_size, dtype=dtype, device=values.device)
    if tokens:
        _sum_slots_kernel[(tokens, triton.cdiv(hidden_size, _SUM_BLOCK))](
            values, out, hidden_size, out.stride(0), SLOTS=slots, BLOCK=_SUM_BLOCK, **launch_options()
        )
    return out
