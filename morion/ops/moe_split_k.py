"""Split K for the fused MoE decode kernels (FP8 and bf16: ops/moe_decode_triton.py; NVFP4:
ops/moe_nvfp4_triton.py), `Tiles.split_k` = S > 1.

At one token a decode kernel's grid is k pairs x N / BLOCK_N column blocks, about one wave of the H200's
132 SMs, each program looping over all of K. Split K adds a slice axis: program s sums K columns
s x span .. (s + 1) x span - 1, span = cdiv(cdiv(K, BLOCK_K), S) x BLOCK_K (whole K tiles; a slice past K
sums nothing), into an fp32 partial [S, P, N] (N = 2I: gate then up; or H), unscaled. A small kernel of
each module then adds a pair's S partials in slice order (`sum_slices`) and applies the epilogue the
fused kernel applies at S = 1. Slices depend only on K, S and BLOCK_K, the sums' order on neither P nor
the other pairs: deterministic and batch invariant, the same products as S = 1 in another fp32 order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Columns per program of the split-K sum kernels: 4 fp32 a thread at 2 warps (16-byte loads); at one token
# of Flash-Next's shapes 11 x 3 programs for act, 11 x 10 for pair_out.
SPLIT_SUM_BLOCK = 256


@triton.jit
def k_slice(size_k, SPLIT_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """(k_begin, k_end): the K columns this program sums, slice program_id(2) of SPLIT_K, each of whole
    BLOCK_K tiles (a slice past K is empty). They depend on K, SPLIT_K and BLOCK_K only, never on the
    batch. SPLIT_K = 1: all of K, the loop of the kernels before split K."""
    if SPLIT_K == 1:
        k_begin = 0
        k_end = size_k
    else:
        span = tl.cdiv(tl.cdiv(size_k, BLOCK_K), SPLIT_K) * BLOCK_K
        k_begin = tl.program_id(2) * span
        k_end = tl.minimum(k_begin + span, size_k)
    return k_begin, k_end


@triton.jit
def store_partial(partial_ptr, acc, pairs, rows_ok, cols, cols_ok, num_pairs, width, offset):
    """This program's K-slice sums (unscaled fp32) of the pairs' rows at columns offset + cols of
    partial [SPLIT_K, P, width], slice program_id(2)."""
    out = partial_ptr + (tl.program_id(2) * num_pairs + pairs[:, None]) * width + offset + cols[None, :]
    tl.store(out, acc, mask=rows_ok[:, None] & cols_ok[None, :])


@triton.jit
def sum_slices(
    partial_ptr, pairs, cols, cols_ok, num_pairs, row_width, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr
):
    """[1, BLOCK_N] fp32: the pair's partials [s, pair, cols] (rows of `row_width`) added for s = 0, 1, ..
    SPLIT_K - 1, in that order: the same bits in every batch and every run."""
    acc = tl.zeros((1, BLOCK_N), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        ptrs = partial_ptr + (s * num_pairs + pairs[:, None]) * row_width + cols[None, :]
        acc += tl.load(ptrs, mask=cols_ok[None, :], other=0.0)
    return acc


@triton.jit
def split_sum_program(num_pairs, width, BLOCK_N: tl.constexpr):
    """A split-K sum kernel's program (pair, column block): the pair, as the one row [1] the fused
    kernels' epilogues take, whether it exists, and the columns with their mask."""
    pairs = tl.program_id(0) + tl.zeros((1,), dtype=tl.int32)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return pairs, pairs < num_pairs, cols, cols < width


def split_partials(split_k: int, num_pairs: int, width: int, out: torch.Tensor) -> torch.Tensor:
    """A kernel's fp32 partials [split_k, P, width] under split K; without it `out` (unread)."""
    if split_k == 1:
        return out
    return torch.empty(split_k, num_pairs, width, dtype=torch.float32, device=out.device)
