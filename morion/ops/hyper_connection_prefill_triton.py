"""The up half of Qwen3.8-Flash-Next's hyper-connection mix (layers/hyper_connection.py) for prefill-sized
token counts (T > hyper_connection_triton.MAX_TOKENS), in one Triton kernel of `tl.dot` tiles.

The eager mix is about fifteen kernels, and past its down GEMM and silu five of them pass over
[T, n * H] tensors: the up GEMM's output, sigmoid's input and output, the gate product's three operands,
the mean's input. At Flash-Next's shape (n * H = 10,240) a 4K-token prefill piece moves ~0.6 GB a mix
that way, 97 mixes a forward. `up_mix` takes the rows the eager code has before them, act =
silu(W_down(normed) / n) [T, R] and normed [T, n * H], and returns the block input [T, H]:

    gate  = sigmoid(act W_up^T)                         tl.dot over R, for the program's BLOCK_C hidden
                                                        columns of every stream at once (n * BLOCK_C rows
                                                        of W_up, row s * H + c for column c of stream s)
    mixed = mean over the streams of (gate * normed)    in the epilogue: normed read once, [T, H] written

so past silu the mix reads normed once and writes its [T, H] result: ~105 MB a 4K piece. act stays the
eager code's (two small kernels over [T, R]): computing it in the kernel's prologue would redo its exps
and divisions once per column block, 80 times at Flash-Next's shape.

Rounding points: the eager code's in the weights' dtype, as the decode kernels keep them
(ops/hyper_connection_triton.py): the up GEMM's fp32 sum, sigmoid and gate * normed each rounded to
the dtype; the mean sums the n products in fp32, times the fp32 reciprocal of n, rounded
once. Left different: the GEMM's summation order (cuBLAS's differs too between shapes), the exp of
sigmoid (an ulp), and the mean's order over n. fp32 tiles multiply in IEEE fp32, not TF32 (16-bit
ones ignore the precision setting).

Invariants:
- Batch invariant: a token row's result does not depend on T or on the other rows (fixed tiles; a row of
  a tl.dot tile never mixes with another; no split over R). The eager code's cuBLAS GEMMs give no such
  promise; the down GEMM before this kernel stays cuBLAS's.
- Capturable: the grid depends only on T and the weights' shapes, nothing is read back on the host (the
  piecewise prefill graphs capture the mixes of their pieces).
- PDL (ops/pdl.py): each program waits for the kernel before it first of all.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from morion.ops.hyper_connection_triton import sigmoid_rn, stream_lanes
from morion.ops.pdl import launch_options, wait_for_previous_kernel
from morion.ops.row_kernels_triton import rounded

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class UpMixTiles(NamedTuple):
    """block_t token rows and block_c hidden columns of each of the n streams a program (n * block_c rows
    of W_up, the tl.dot's N side), R in block_r steps, warps. A tile is fixed for every T, so a row's
    bits never depend on its batch; another tile may sum R in another order or take other MMA
    instructions, so its last bits may differ from this one's."""

    block_t: int = 64
    block_c: int = 32
    block_r: int = 64
    warps: int = 4


# 64 token rows, 32 hidden columns of each of the n streams (N = 128 for n = 4), R in steps of 64 (five
# at Flash-Next's R = 320). A program's W_up slice (80 KiB at R = 320) stays in L2 across the token
# blocks, which run after all column blocks of the one before them. Untimed so far:
# scripts/hc_prefill_ab.py times it and other tiles against the eager code on a GPU.
DEFAULT_TILES = UpMixTiles()


@triton.jit(do_not_specialize=["num_tokens"])
def _up_mix_tiles_kernel(
    act_ptr, up_w_ptr, normed_ptr, mixed_ptr,
    num_tokens, hidden, lowrank, hc_count, stride_act, stride_normed, inv_count,
    HC_BLOCK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
    PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous_kernel(USE_PDL)
    dtype = mixed_ptr.dtype.element_ty
    tokens = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    tokens_ok = tokens < num_tokens
    _, up_rows, lanes_ok = stream_lanes(hidden, hc_count, HC_BLOCK, BLOCK_C)  # W_up's rows, normed's columns
    depth = tl.arange(0, BLOCK_R)

    acc = tl.zeros((BLOCK_T, HC_BLOCK * BLOCK_C), dtype=tl.float32)
    for start in range(0, lowrank, BLOCK_R):
        r = start + depth
        r_ok = r < lowrank
        act_mask = tokens_ok[:, None] & r_ok[None, :]
        act = tl.load(act_ptr + tokens[:, None] * stride_act + r[None, :], mask=act_mask, other=0.0)
        w = tl.load(
            up_w_ptr + up_rows[None, :] * lowrank + r[:, None],
            mask=r_ok[:, None] & lanes_ok[None, :],
            other=0.0,
        )
        acc = tl.dot(act, w, acc, input_precision=PRECISION)
    gate = rounded(sigmoid_rn(rounded(acc, dtype)), dtype)
    mask = tokens_ok[:, None] & lanes_ok[None, :]
    normed = tl.load(normed_ptr + tokens[:, None] * stride_normed + up_rows[None, :], mask=mask, other=0.0)
    products = tl.where(mask, rounded(gate * tl.cast(normed, tl.float32), dtype), 0.0)
    mixed = tl.sum(tl.reshape(products, (BLOCK_T, HC_BLOCK, BLOCK_C)), axis=1) * inv_count
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    out_mask = tokens_ok[:, None] & (cols[None, :] < hidden)
    tl.store(mixed_ptr + tokens[:, None] * hidden + cols[None, :], tl.cast(mixed, dtype), mask=out_mask)


def supports(act: torch.Tensor, up: torch.Tensor, normed: torch.Tensor, hc_count: int) -> bool:
    """Whether `up_mix` takes act [T, R] and normed [T, n * H] (unit stride on their last dimension) with
    a contiguous W_up [n * H, R], all of one dtype of DTYPES."""
    width, lowrank = up.shape
    return (
        width % hc_count == 0
        and act.dim() == normed.dim() == 2
        and act.shape == (normed.shape[0], lowrank)
        and normed.shape[1] == width
        and act.stride(1) == normed.stride(1) == 1
        and up.is_contiguous()
        and act.dtype == up.dtype == normed.dtype
        and up.dtype in DTYPES
    )


def up_mix(
    act: torch.Tensor,
    up: torch.Tensor,
    normed: torch.Tensor,
    hc_count: int,
    tiles: UpMixTiles = DEFAULT_TILES,
) -> torch.Tensor:
    """The block input [T, H] = mean over the streams of sigmoid(act W_up^T) * normed, for shapes
    `supports` takes."""
    num_tokens, width = normed.shape
    hidden, lowrank = width // hc_count, up.shape[1]
    mixed = torch.empty(num_tokens, hidden, dtype=normed.dtype, device=normed.device)
    if num_tokens == 0:
        return mixed
    grid = (triton.cdiv(hidden, tiles.block_c), triton.cdiv(num_tokens, tiles.block_t))
    _up_mix_tiles_kernel[grid](
        act, up, normed, mixed,
        num_tokens, hidden, lowrank, hc_count, act.stride(0), normed.stride(0), 1.0 / hc_count,
        HC_BLOCK=triton.next_power_of_2(hc_count),
        BLOCK_T=tiles.block_t, BLOCK_C=tiles.block_c, BLOCK_R=tiles.block_r,
        PRECISION="ieee" if normed.dtype == torch.float32 else "tf32", **launch_options(),
        num_warps=tiles.warps,
    )  # fmt: skip
    return mixed
