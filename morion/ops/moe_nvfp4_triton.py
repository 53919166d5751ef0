"""Routed experts with NVFP4 weights on CUDA: weight-only 4-bit kernels (Hopper has no FP4 tensor cores).

The contract of `ops.moe.moe_experts_reference` with NVFP4 experts (ops/nvfp4.py; layers/moe.py's
StackedExperts): gate_up_proj [E, 2I, H/2] and down_proj [E, H, I/2] uint8 codes, e4m3 block scales
[E, 2I, H/16] and [E, H, I/16], fp32 global scales [E, 2] (gate rows, up rows) and [E, 1]. The codes and
scales are read as they are stored, 4.5 bits a weight, and expanded in registers: each byte j of a row
holds the codes of columns 2j (low nibble) and 2j+1 (high), so a tile is two half tiles, the even and the
odd columns, each multiplied with the activations' even or odd columns (two `tl.dot`s of half the K: no
register shuffle to interleave them). A code becomes its value x 2^-14 through its fp16 bit pattern
(sign to bit 15, the 3 magnitude bits to bits 11-9; subnormals included), then times its block scale in
fp16: the product is a multiple of 2^-24 (0.5 x 2^-14 times e4m3's step 2^-9) below 0.17 with at most 6
significant bits, so exact in fp16 (subnormal or not) and in the bf16 the MMA takes. The products
accumulate in fp32; the global scale x 2^14 multiplies each output once, in the epilogue. So the
kernels' only roundings are the activations' dtype at the MMA inputs and fp32 sums, where the reference
rounds each dequantized weight (code x block x global) to the activations' dtype.

Two expansions of the same weights (`Tiles.expand`, chosen per device and shape by ops/moe_tune.py):
"byte" gathers each code byte's block scale (8 loads and e4m3 conversions of one scale) and "group" loads
a tile's block scales once each, as a [BLOCK_K / 16, BLOCK_N] tile, and broadcasts them over the codes
held as [BLOCK_K / 16, 8, BLOCK_N] (merged to the MMA's [BLOCK_K / 2, BLOCK_N] in the same order). Its
weights are "byte"'s bit for bit, so with `tl.dot` its results are too. Its "gemv" tiles widen the fp16
weights to fp32 directly ("byte" converts them to the activations' dtype first, exactly but with an F2F
a weight on the SM's slow conversion unit, then widens those) and keep a [BLOCK_K / 16, 8, BLOCK_N] fp32
accumulator, summed over K once at the end, not once per K tile: the same exact products in another fp32
summation order. For the 80B's gate/up "gemv" tile that is ~40% fewer instructions a loop (sm_90 SASS).
Scaling after the dot (a group's code x activation sums, then x block scale) would add a rounding per
group and save only the fp16 multiply (two weights an instruction): not done.

Two ways to find a program's rows, the kernels otherwise shared:

- `moe_experts_nvfp4` (decode, speculative verify: up to MAX_PAIRS (token, expert) pairs): the
  fused decode kernels' structure (ops/moe_decode_triton.py) and helpers: a program per (pair, column
  block); the first pair routed to an expert (its leader) computes all of that expert's pairs, so each
  weight tile is read once per call; no sort, fixed tiles, batch invariant, capturable.
- `moe_experts_nvfp4(..., grouped=True)` (prefill): pairs sorted by expert on the device (as
  `moe_experts_grouped` does) and cut into tiles of BLOCK_M rows of one expert; a program per (tile,
  column block). The tile table is built with torch ops, no host sync (at most cdiv(P, BLOCK_M) +
  min(E, P) tiles: each expert leaves at most one partial tile), so it is capturable too.

Both write act [P, I] and pair_out [P, H] (fp32, the routing weight applied) per pair, and sum each
token's k pairs in slot order (`moe_decode_triton.sum_slots`; with `unsummed`, the decode kernels leave
that sum to the kernel after the MoE block, as the FP8 ones do: ops/slot_partials.py): deterministic,
no atomics. PDL
(ops/pdl.py): each kernel's programs wait for the kernel before it first of all.

Split K (`Tiles.split_k` = S > 1, the decode kernels only; the grouped ones refuse it: ops/moe_split_k.py,
shared with the FP8 kernels): `_split_k_sum_kernel` adds a pair's S partials in slice order and applies
what the fused epilogue applies (global scales and SiLU(gate) x up into act; global scale and routing
weight into pair_out), through the same helpers. A separate kernel, not the next kernel's prologue: the
down kernel's every (column block, slice) program would redo the SwiGLU of its act rows, and its K loop
would read S fp32 partials where it reads act.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from morion.ops.moe_decode_triton import (
    GROUPED_BLOCK_M,
    MAX_PAIRS,
    MMA_GEMV,
    _expert_rows,
    _mma,
    _rows_at,
    _rows_first,
    _zero_acc,
    expert_tiles,
    sum_slots,
)
from morion.ops.moe_decode_triton import _mma_options as decode_mma_options
from morion.ops.moe_split_k import (
    SPLIT_SUM_BLOCK,
    k_slice,
    split_partials,
    split_sum_program,
    store_partial,
    sum_slices,
)
from morion.ops.moe_tiles import Tiles, tuned_grouped_on, tuned_tiles_on
from morion.ops.nvfp4 import GROUP_SIZE
from morion.ops.pdl import launch_options, wait_for_previous_kernel
from morion.ops.slot_partials import SlotPartials

# The half tiles hold code x block scale x 2^-14 (exact in fp16); the epilogue's global scale undoes it.
GLOBAL_FACTOR = tl.constexpr(2.0**14)
# Compiled kernels read only constexpr globals (the interpreter reads any: CPU tests cannot catch this).
_SCALE_BYTES = tl.constexpr(GROUP_SIZE // 2)  # code bytes per block scale
_GROUP_COLUMNS = tl.constexpr(GROUP_SIZE)  # weight columns per block scale
# How the kernels expand codes to weights (`Tiles.expand`): a gathered block scale per code byte, or one
# load per block scale broadcast over its bytes (with an fp32 CUDA-core GEMV of its own in "gemv" tiles).
EXPAND_BYTE = tl.constexpr(0)
EXPAND_GROUP = tl.constexpr(1)
_EXPAND_MODES = {"byte": EXPAND_BYTE.value, "group": EXPAND_GROUP.value}
_DECODE_BLOCK_M = 16  # rows per MMA tile in the decode kernels: the smallest `tl.dot` takes

# Default tiles (ops/moe_tiles.py: a tuned file of this device and shape wins). BLOCK_K counts weight
# columns: 128 is 64 bytes of codes and 8 block scales per row of the tile.
DECODE_GATE_UP_TILES = Tiles(32, 128, 4, 4)
DECODE_DOWN_TILES = Tiles(64, 128, 4, 3)
GROUPED_TILES = Tiles(64, 128, 4, 3)


@triton.jit
def _nibble_halves(packed):
    """fp16 bit patterns (uint16) of the low and high nibbles' code values x 2^-14 of the code bytes
    `packed`: sign (code bit 3) to bit 15, magnitude (bits 2-0) to bits 11-9 (subnormals included)."""
    packed = tl.cast(packed, tl.uint16)
    even = ((packed & 0x7) << 9) | ((packed & 0x8) << 12)
    odd = ((packed & 0x70) << 5) | ((packed & 0x80) << 8)
    return even, odd


@triton.jit
def _nvfp4_half_tiles(
    codes_ptr, scales_ptr, cols, cols_ok, k0, size_k, stride_cn, stride_sn,
    BLOCK_K: tl.constexpr, DTYPE: tl.constexpr,
):  # fmt: skip
    """Weights of columns k0 .. k0 + BLOCK_K - 1 for output rows `cols` of one expert's matrix, as two
    [BLOCK_K / 2, BLOCK_N] tiles in DTYPE: the even columns k0 + 2j and the odd ones k0 + 2j + 1 (the low
    and high nibbles of byte k0 / 2 + j), each code x its block scale x 2^-14, exactly (`GLOBAL_FACTOR`
    undoes the 2^-14). EXPAND_BYTE: each byte loads and converts its own block scale."""
    byte = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    mask = (byte < size_k // 2)[:, None] & cols_ok[None, :]
    packed = tl.load(codes_ptr + cols[None, :] * stride_cn + byte[:, None], mask=mask, other=0)
    even, odd = _nibble_halves(packed)
    # Byte j holds columns 2j and 2j + 1: both in block scale 2j // 16 = j // 8.
    scale_ptrs = scales_ptr + cols[None, :] * stride_sn + (byte // _SCALE_BYTES)[:, None]
    scale = tl.cast(tl.load(scale_ptrs, mask=mask, other=0.0), tl.float16)  # e4m3 -> fp16: exact
    w_even = tl.cast(even, tl.float16, bitcast=True) * scale
    w_odd = tl.cast(odd, tl.float16, bitcast=True) * scale
    return tl.cast(w_even, DTYPE), tl.cast(w_odd, DTYPE)


@triton.jit
def _nvfp4_group_tiles(
    codes_ptr, scales_ptr, cols, cols_ok, k0, size_k, stride_cn, stride_sn,
    BLOCK_K: tl.constexpr, DTYPE: tl.constexpr,
):  # fmt: skip
    """`_nvfp4_half_tiles`' weights, each [BLOCK_K / 16, 8, BLOCK_N]: [g, i, n] is byte 8g + i of the
    tile (columns 16g + 2i and 16g + 2i + 1). EXPAND_GROUP: the tile's block scales load as one
    [BLOCK_K / 16, BLOCK_N] tile (one address per scale, not per byte) and convert once each, then
    broadcast over their 8 bytes in registers. The same values as `_nvfp4_half_tiles`, bit for bit."""
    group = k0 // _GROUP_COLUMNS + tl.arange(0, BLOCK_K // _GROUP_COLUMNS)
    byte = group[:, None] * _SCALE_BYTES + tl.arange(0, _SCALE_BYTES)[None, :]
    mask = (byte < size_k // 2)[:, :, None] & cols_ok[None, None, :]
    packed = tl.load(codes_ptr + cols[None, None, :] * stride_cn + byte[:, :, None], mask=mask, other=0)
    even, odd = _nibble_halves(packed)
    scale_mask = (group < size_k // _GROUP_COLUMNS)[:, None] & cols_ok[None, :]
    scale = tl.load(scales_ptr + cols[None, :] * stride_sn + group[:, None], mask=scale_mask, other=0.0)
    scale = tl.cast(scale, tl.float16)[:, None, :]  # e4m3 -> fp16: exact, once per block scale
    w_even = tl.cast(even, tl.float16, bitcast=True) * scale
    w_odd = tl.cast(odd, tl.float16, bitcast=True) * scale
    return tl.cast(w_even, DTYPE), tl.cast(w_odd, DTYPE)


@triton.jit
def _rows_times_nvfp4(
    rows_ptr, rows_ok, codes_ptr, scales_ptr, cols, cols_ok, size_k, k_begin, k_end, stride_cn, stride_sn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr, EXPAND: tl.constexpr,
):  # fmt: skip
    """fp32 [BLOCK_M, BLOCK_N]: the rows at `rows_ptr` ([BLOCK_M, 1] row starts, unit stride along K)
    times the NVFP4 matrix's rows `cols` (code x block scale; the global scale is the caller's), over K
    columns k_begin .. k_end - 1 (`moe_split_k.k_slice`). "gemv" tiles of the group expansion run
    `_gemv_group`; the others the MMA mode's `_mma` on half tiles."""
    if EXPAND == EXPAND_GROUP and MMA == MMA_GEMV:
        acc = _gemv_group(
            rows_ptr, rows_ok, codes_ptr, scales_ptr, cols, cols_ok, size_k, k_begin, k_end, stride_cn,
            stride_sn, BLOCK_N, BLOCK_K,
        )  # fmt: skip
    else:
        acc = _zero_acc(BLOCK_M, BLOCK_N, MMA)
        for k0 in range(k_begin, k_end, BLOCK_K):
            ks = k0 + 2 * tl.arange(0, BLOCK_K // 2)
            mask = rows_ok[:, None] & (ks < size_k)[None, :]  # K is even: the odd column is there too
            a_even = tl.load(rows_ptr + ks[None, :], mask=mask, other=0.0)
            a_odd = tl.load(rows_ptr + ks[None, :] + 1, mask=mask, other=0.0)
            if EXPAND == EXPAND_GROUP:
                w_even, w_odd = _nvfp4_group_tiles(
                    codes_ptr, scales_ptr, cols, cols_ok, k0, size_k, stride_cn, stride_sn, BLOCK_K,
                    a_even.dtype,
                )  # fmt: skip
                w_even = tl.reshape(w_even, (BLOCK_K // 2, BLOCK_N))
                w_odd = tl.reshape(w_odd, (BLOCK_K // 2, BLOCK_N))
            else:
                w_even, w_odd = _nvfp4_half_tiles(
                    codes_ptr, scales_ptr, cols, cols_ok, k0, size_k, stride_cn, stride_sn, BLOCK_K,
                    a_even.dtype,
                )  # fmt: skip
            acc = _mma(a_even, w_even, acc, MMA, DOT_PRECISION)
            acc = _mma(a_odd, w_odd, acc, MMA, DOT_PRECISION)
        acc = _rows_first(acc, MMA)
    return acc


@triton.jit
def _gemv_group(
    row_ptr, row_ok, codes_ptr, scales_ptr, cols, cols_ok, size_k, k_begin, k_end, stride_cn, stride_sn,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """[1, BLOCK_N] fp32: one row (BLOCK_M = 1) times the matrix's rows `cols`, on the CUDA cores with
    `_nvfp4_group_tiles`' weights made fp32 straight from fp16 (no detour through the rows' dtype: the
    same values). Products (activation x code x block scale) are exact in fp32 and accumulate per
    (byte position, column) over the K tiles, summed over K once at the end: per row, so batch
    invariant."""
    acc = tl.zeros((BLOCK_K // _GROUP_COLUMNS, _SCALE_BYTES, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        group = k0 // _GROUP_COLUMNS + tl.arange(0, BLOCK_K // _GROUP_COLUMNS)
        ks = group[:, None] * _GROUP_COLUMNS + 2 * tl.arange(0, _SCALE_BYTES)[None, :]
        mask = row_ok[:, None] & (ks < size_k)  # [1, 1] & [BLOCK_K / 16, 8]
        row_ptrs = row_ptr + ks
        a_even = tl.cast(tl.load(row_ptrs, mask=mask, other=0.0), tl.float32)
        a_odd = tl.cast(tl.load(row_ptrs + 1, mask=mask, other=0.0), tl.float32)
        w_even, w_odd = _nvfp4_group_tiles(
            codes_ptr, scales_ptr, cols, cols_ok, k0, size_k, stride_cn, stride_sn, BLOCK_K, tl.float32
        )
        acc += a_even[:, :, None] * w_even
        acc += a_odd[:, :, None] * w_odd
    return tl.reshape(tl.sum(tl.sum(acc, axis=1), axis=0), (1, BLOCK_N))


@triton.jit
def _swiglu_store(gate, up, global_ptr, expert, act_ptr, pairs, rows_ok, cols, cols_ok, inter_size):
    """act[p, cols] = silu(gate) * up from the unscaled sums (code x block scale x 2^-14), each times its
    projection's global scale x 2^14, for the pairs p of these rows."""
    gate = gate * (tl.load(global_ptr + expert * 2) * GLOBAL_FACTOR)
    up = up * (tl.load(global_ptr + expert * 2 + 1) * GLOBAL_FACTOR)
    act = gate / (1.0 + tl.exp(-gate)) * up
    out = act_ptr + pairs[:, None] * inter_size + cols[None, :]
    tl.store(out, tl.cast(act, act_ptr.dtype.element_ty), mask=rows_ok[:, None] & cols_ok[None, :])


@triton.jit
def _routed_store(
    acc, global_ptr, expert, routing_ptr, pair_out_ptr, pairs, rows_ok, cols, cols_ok, hidden_size
):
    """pair_out[p, cols] = routing[p] * acc x global scale x 2^14 in fp32 for the pairs p of these rows."""
    routing = tl.cast(tl.load(routing_ptr + pairs, mask=rows_ok, other=0.0), tl.float32)
    acc = acc * (tl.load(global_ptr + expert) * GLOBAL_FACTOR) * routing[:, None]
    out = pair_out_ptr + pairs[:, None] * hidden_size + cols[None, :]
    tl.store(out, acc, mask=rows_ok[:, None] & cols_ok[None, :])


@triton.jit
def _gate_up_rows(
    x_ptr, pairs, rows_ok, codes_ptr, scales_ptr, global_ptr, act_ptr, partial_ptr, expert, cols, cols_ok,
    num_pairs, top_k, hidden_size, inter_size, stride_x, stride_ce, stride_cn, stride_se, stride_sn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr, EXPAND: tl.constexpr, SPLIT_K: tl.constexpr,
):  # fmt: skip
    """act[p] = silu(x[t] Wg^T) * (x[t] Wu^T) for the pairs p (token t = p // top_k) of these rows; with
    SPLIT_K > 1 this slice's gate and up sums to the partials instead (gate, then up, in a row of 2I)."""
    x_rows = x_ptr + (pairs // top_k)[:, None] * stride_x
    gate_codes = codes_ptr + expert * stride_ce
    gate_scales = scales_ptr + expert * stride_se
    up_codes = gate_codes + inter_size * stride_cn
    up_scales = gate_scales + inter_size * stride_sn
    k_begin, k_end = k_slice(hidden_size, SPLIT_K, BLOCK_K)
    gate = _rows_times_nvfp4(
        x_rows, rows_ok, gate_codes, gate_scales, cols, cols_ok, hidden_size, k_begin, k_end, stride_cn,
        stride_sn, BLOCK_M, BLOCK_N, BLOCK_K, MMA, DOT_PRECISION, EXPAND,
    )  # fmt: skip
    up = _rows_times_nvfp4(
        x_rows, rows_ok, up_codes, up_scales, cols, cols_ok, hidden_size, k_begin, k_end, stride_cn,
        stride_sn, BLOCK_M, BLOCK_N, BLOCK_K, MMA, DOT_PRECISION, EXPAND,
    )  # fmt: skip
    if SPLIT_K == 1:
        _swiglu_store(gate, up, global_ptr, expert, act_ptr, pairs, rows_ok, cols, cols_ok, inter_size)
    else:
        store_partial(partial_ptr, gate, pairs, rows_ok, cols, cols_ok, num_pairs, 2 * inter_size, 0)
        store_partial(partial_ptr, up, pairs, rows_ok, cols, cols_ok, num_pairs, 2 * inter_size, inter_size)


@triton.jit
def _down_rows(
    act_ptr, pairs, rows_ok, codes_ptr, scales_ptr, global_ptr, routing_ptr, pair_out_ptr, partial_ptr,
    expert, cols, cols_ok, num_pairs, hidden_size, inter_size, stride_ce, stride_cn, stride_se, stride_sn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr, EXPAND: tl.constexpr, SPLIT_K: tl.constexpr,
):  # fmt: skip
    """pair_out[p] = routing[p] * (act[p] Wd^T) in fp32 for the pairs p of these rows; with SPLIT_K > 1
    this slice's sums to the partials instead."""
    k_begin, k_end = k_slice(inter_size, SPLIT_K, BLOCK_K)
    acc = _rows_times_nvfp4(
        act_ptr + pairs[:, None] * inter_size, rows_ok, codes_ptr + expert * stride_ce,
        scales_ptr + expert * stride_se, cols, cols_ok, inter_size, k_begin, k_end, stride_cn, stride_sn,
        BLOCK_M, BLOCK_N, BLOCK_K, MMA, DOT_PRECISION, EXPAND,
    )  # fmt: skip
    if SPLIT_K == 1:
        _routed_store(
            acc, global_ptr, expert, routing_ptr, pair_out_ptr, pairs, rows_ok, cols, cols_ok, hidden_size
        )
    else:
        store_partial(partial_ptr, acc, pairs, rows_ok, cols, cols_ok, num_pairs, hidden_size, 0)


# Batch-dependent counts are not specialized on (see ops/moe_decode_triton.py): one variant serves all.
# The grouped kernels' loops over an expert's rows run once (a tile has at most BLOCK_M rows) or not at
# all (an unused tile).
@triton.jit(do_not_specialize=["num_pairs"])
def _gate_up_kernel(
    x_ptr, codes_ptr, scales_ptr, global_ptr, ids_ptr, tiles_ptr, order_ptr, act_ptr, partial_ptr,
    num_pairs, top_k, hidden_size, inter_size, stride_x, stride_ce, stride_cn, stride_se, stride_sn,
    GROUPED: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MMA: tl.constexpr, EXPAND: tl.constexpr,
    SPLIT_K: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous_kernel(USE_PDL)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_ok = cols < inter_size
    expert, first, count, match, rank = _expert_rows(ids_ptr, tiles_ptr, num_pairs, GROUPED, BLOCK_P, BLOCK_M)
    for start in range(0, count, BLOCK_M):
        pairs, rows_ok = _rows_at(order_ptr, first, match, rank, start, count, GROUPED, BLOCK_P, BLOCK_M)
        _gate_up_rows(
            x_ptr, pairs, rows_ok, codes_ptr, scales_ptr, global_ptr, act_ptr, partial_ptr, expert, cols,
            cols_ok, num_pairs, top_k, hidden_size, inter_size, stride_x, stride_ce, stride_cn, stride_se,
            stride_sn, BLOCK_M, BLOCK_N, BLOCK_K, MMA, DOT_PRECISION, EXPAND, SPLIT_K,
        )  # fmt: skip


@triton.jit(do_not_specialize=["num_pairs"])
def _down_kernel(
    act_ptr, codes_ptr, scales_ptr, global_ptr, ids_ptr, tiles_ptr, order_ptr, routing_ptr, pair_out_ptr,
    partial_ptr, num_pairs, hidden_size, inter_size, stride_ce, stride_cn, stride_se, stride_sn,
    GROUPED: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MMA: tl.constexpr, EXPAND: tl.constexpr,
    SPLIT_K: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous_kernel(USE_PDL)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_ok = cols < hidden_size
    expert, first, count, match, rank = _expert_rows(ids_ptr, tiles_ptr, num_pairs, GROUPED, BLOCK_P, BLOCK_M)
    for start in range(0, count, BLOCK_M):
        pairs, rows_ok = _rows_at(order_ptr, first, match, rank, start, count, GROUPED, BLOCK_P, BLOCK_M)
        _down_rows(
            act_ptr, pairs, rows_ok, codes_ptr, scales_ptr, global_ptr, routing_ptr, pair_out_ptr,
            partial_ptr, expert, cols, cols_ok, num_pairs, hidden_size, inter_size, stride_ce, stride_cn,
            stride_se, stride_sn, BLOCK_M, BLOCK_N, BLOCK_K, MMA, DOT_PRECISION, EXPAND, SPLIT_K,
        )  # fmt: skip


@triton.jit(do_not_specialize=["num_pairs"])
def _split_k_sum_kernel(
    partial_ptr, global_ptr, ids_ptr, routing_ptr, out_ptr, num_pairs, width,
    SWIGLU: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """Split K's epilogue, a program per (pair, column block): the pair's SPLIT_K partials added in slice
    order, then the fused kernels' epilogue. SWIGLU: partial [S, P, 2I] (gate, then up) into act [P, I]
    (width I); else partial [S, P, H] into pair_out [P, H] (width H)."""
    wait_for_previous_kernel(USE_PDL)
    pairs, rows_ok, cols, cols_ok = split_sum_program(num_pairs, width, BLOCK_N)
    expert = tl.load(ids_ptr + tl.program_id(0))
    if SWIGLU:
        gate = sum_slices(partial_ptr, pairs, cols, cols_ok, num_pairs, 2 * width, SPLIT_K, BLOCK_N)
        up = sum_slices(partial_ptr + width, pairs, cols, cols_ok, num_pairs, 2 * width, SPLIT_K, BLOCK_N)
        _swiglu_store(gate, up, global_ptr, expert, out_ptr, pairs, rows_ok, cols, cols_ok, width)
    else:
        acc = sum_slices(partial_ptr, pairs, cols, cols_ok, num_pairs, width, SPLIT_K, BLOCK_N)
        _routed_store(acc, global_ptr, expert, routing_ptr, out_ptr, pairs, rows_ok, cols, cols_ok, width)


def _mma_options(tiles: Tiles, block_m: int) -> dict[str, int]:
    """The decode kernels' MMA options for `tiles` (weight-only BF16 math: every mode is exact), with
    `block_m` rows per MMA tile, the code expansion (EXPAND) and the K slices (SPLIT_K)."""
    if tiles.block_k < 32 or tiles.block_k & (tiles.block_k - 1):
        # Each half tile (BLOCK_K / 2 columns) is a tl.dot's K: at least 16.
        raise ValueError(f"NVFP4 tiles need BLOCK_K a power of two of at least 32, got {tuple(tiles)}")
    if tiles.expand not in _EXPAND_MODES:
        raise ValueError(
            f"unknown NVFP4 tile expand {tiles.expand!r}: expected one of {sorted(_EXPAND_MODES)}"
        )
    if tiles.split_k < 1:
        raise ValueError(f"NVFP4 tiles need split_k of at least 1, got {tuple(tiles)}")
    options = decode_mma_options(tiles, fp8=False)
    if tiles.mma != "gemv":
        options["BLOCK_M"] = block_m
    return {**options, "EXPAND": _EXPAND_MODES[tiles.expand], "SPLIT_K": tiles.split_k}


def _sum_split_k(
    partial: torch.Tensor,
    global_scale: torch.Tensor,
    ids: torch.Tensor,
    routing: torch.Tensor,
    out: torch.Tensor,
    swiglu: bool,
) -> None:
    """`_split_k_sum_kernel` on partial [S, P, N]: act (`swiglu`) or pair_out [P, width] from them."""
    split_k, num_pairs, width = partial.shape[0], out.shape[0], out.shape[1]
    _split_k_sum_kernel[(num_pairs, triton.cdiv(width, SPLIT_SUM_BLOCK))](
        partial, global_scale, ids, routing, out, num_pairs, width,
        SWIGLU=swiglu, SPLIT_K=split_k, BLOCK_N=SPLIT_SUM_BLOCK, **launch_options(), num_warps=2,
    )  # fmt: skip


def _run(
    hidden: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    grouped_block_m: int | None,
    gate_up_tiles: Tiles,
    down_tiles: Tiles,
    unsummed: bool,
) -> torch.Tensor | SlotPartials:
    """The kernels on one batch: grouped with tiles of `grouped_block_m` rows, else the decode ones;
    `unsummed`: the slots before their sum."""
    tokens, top_k = topk_ids.shape
    num_pairs = tokens * top_k
    gate_up_scale, down_scale, gate_up_scale_2, down_scale_2 = scales
    num_experts, hidden_size, inter_size = down_proj.shape[0], down_proj.shape[1], down_proj.shape[2] * 2
    act = torch.empty(num_pairs, inter_size, dtype=hidden.dtype, device=hidden.device)
    pair_out = torch.empty(num_pairs, hidden_size, dtype=torch.float32, device=hidden.device)
    ids = topk_ids.reshape(-1).contiguous()
    routing = topk_weights.reshape(-1).contiguous()
    grouped = grouped_block_m is not None
    if grouped:
        tiles, order = expert_tiles(topk_ids, num_experts, grouped_block_m)
        programs, block_m, block_p = tiles.shape[0], grouped_block_m, 1
    else:
        tiles = order = ids  # unread
        programs, block_m, block_p = num_pairs, _DECODE_BLOCK_M, triton.next_power_of_2(num_pairs)
    common = dict(
        GROUPED=grouped,
        DOT_PRECISION="ieee" if hidden.dtype == torch.float32 else "tf32",
        BLOCK_P=block_p,
    )
    t = gate_up_tiles
    partial = split_partials(t.split_k, num_pairs, 2 * inter_size, act)
    _gate_up_kernel[(programs, triton.cdiv(inter_size, t.block_n), t.split_k)](
        hidden, gate_up_proj, gate_up_scale, gate_up_scale_2, ids, tiles, order, act, partial,
        num_pairs, top_k, hidden_size, inter_size, hidden.stride(0), gate_up_proj.stride(0),
        gate_up_proj.stride(1), gate_up_scale.stride(0), gate_up_scale.stride(1),
        **common, **_mma_options(t, block_m), BLOCK_N=t.block_n, BLOCK_K=t.block_k,
        **launch_options(), num_warps=t.num_warps, num_stages=t.num_stages,
    )  # fmt: skip
    if t.split_k > 1:
        _sum_split_k(partial, gate_up_scale_2, ids, routing, act, swiglu=True)
    t = down_tiles
    partial = split_partials(t.split_k, num_pairs, hidden_size, pair_out)
    _down_kernel[(programs, triton.cdiv(hidden_size, t.block_n), t.split_k)](
        act, down_proj, down_scale, down_scale_2, ids, tiles, order, routing, pair_out, partial,
        num_pairs, hidden_size, inter_size, down_proj.stride(0), down_proj.stride(1),
        down_scale.stride(0), down_scale.stride(1),
        **common, **_mma_options(t, block_m), BLOCK_N=t.block_n, BLOCK_K=t.block_k,
        **launch_options(), num_warps=t.num_warps, num_stages=t.num_stages,
    )  # fmt: skip
    if t.split_k > 1:
        _sum_split_k(partial, down_scale_2, ids, routing, pair_out, swiglu=False)
    slots = pair_out.view(tokens, top_k, hidden_size)
    return SlotPartials(slots, hidden.dtype) if unsummed else sum_slots(slots, hidden.dtype)


def moe_experts_nvfp4(
    hidden: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    gate_up_scale: torch.Tensor,
    down_scale: torch.Tensor,
    gate_up_scale_2: torch.Tensor,
    down_scale_2: torch.Tensor,
    grouped: bool = False,
    block_m: int | None = None,
    gate_up_tiles: Tiles | None = None,
    down_tiles: Tiles | None = None,
    unsummed: bool = False,
) -> torch.Tensor | SlotPartials:
    """The contract of `moe_experts_reference` with NVFP4 experts; hidden [T, H] in bf16, fp16 or fp32.
    `unsummed`: each token's slots before their sum (`SlotPartials`, as `moe_expert_partials`), for the
    kernel after the block to add.
    The decode kernels (at most MAX_PAIRS (token, expert) pairs; tiles: the device's tuned file for this
    shape, else the defaults), or with `grouped` the grouped kernels (any number of tokens: prefill;
    `block_m` rows of one expert per tile, a power of two of at least 16; rows and tiles from the tuned
    file's grouped entry (ops/moe_tune_grouped.py), else GROUPED_BLOCK_M and GROUPED_TILES; split_k = 1
    only). `block_m` and `*_tiles` override either."""
    scales = (gate_up_scale, down_scale, gate_up_scale_2, down_scale_2)
    if gate_up_proj.dtype != torch.uint8 or any(scale is None for scale in scales):
        raise ValueError("NVFP4 experts need uint8 codes and all four scales")
    if hidden.stride(-1) != 1 or gate_up_proj.stride(-1) != 1 or down_proj.stride(-1) != 1:
        raise ValueError("NVFP4 experts need unit stride along H and along the codes' last dim")
    tokens, top_k = topk_ids.shape
    if not grouped and tokens * top_k > MAX_PAIRS:
        raise ValueError(f"{tokens} tokens x top-{top_k} = {tokens * top_k} pairs, more than {MAX_PAIRS}")
    if tokens == 0:
        empty = hidden.new_zeros(0, top_k, hidden.shape[1], dtype=torch.float32)
        return SlotPartials(empty, hidden.dtype) if unsummed else torch.zeros_like(hidden)
    tuned = None
    if grouped:
        entry = tuned_grouped_on(hidden.device, gate_up_proj, down_proj)
        defaults = (entry.gate_up, entry.down) if entry is not None else (GROUPED_TILES, GROUPED_TILES)
        block_m = block_m or (entry.block_m if entry is not None else GROUPED_BLOCK_M)
    else:
        tuned = tuned_tiles_on(hidden.device, gate_up_proj, down_proj)
        defaults = tuned or (DECODE_GATE_UP_TILES, DECODE_DOWN_TILES)
    gate_up_tiles, down_tiles = gate_up_tiles or defaults[0], down_tiles or defaults[1]
    if grouped and (gate_up_tiles.split_k != 1 or down_tiles.split_k != 1):
        # A grouped tile has up to BLOCK_M rows and prefill has many tiles: the grid is full without it.
        raise ValueError("split_k is for the NVFP4 decode kernels; the grouped kernels take split_k = 1")
    return _run(
        hidden,
        gate_up_proj,
        down_proj,
        topk_weights,
        topk_ids,
        tuple(scale.contiguous() for scale in scales),
        block_m if grouped else None,
        gate_up_tiles,
        down_tiles,
        unsummed,
    )
