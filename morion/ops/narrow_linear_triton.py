"""A linear layer with a few outputs (a gate: N <= MAX_OUTPUTS) whose rows do not depend on the batch.

cuBLAS picks its GEMM kernel by shape. For N = 1 (Qwen3-Next's `shared_expert_gate`) the kernel it picks
at M = 1 sums K in another order than the one it picks at M = 8, so a token's gate could round to another
BF16 value when it decoded beside other requests than when it decoded alone: rarely (once in a few hundred
steps of the 80B preset) but enough to make a restored answer part from its cold one after tens of
identical tokens (`results/2026-12-02-h200-decode-divergence-trace.md`). Here one program per row sums its
K in one fixed order (fp32 partial products per column of a BLOCK_K tile, then one tile reduction), the
same compiled kernel at every M: a row's result is the same alone, in any batch, in a CUDA graph or eager,
and in a prefill chunk of any length. Rounded once into x's dtype, as F.linear's fp32 accumulation is.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from morion.ops.pdl import launch_options, wait_for_previous_kernel

MAX_OUTPUTS = 16
_BLOCK_K = 256


@triton.jit
def _narrow_linear_kernel(
    x_ptr, w_ptr, out_ptr, K, N, stride_x, stride_w, stride_out,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous_kernel(USE_PDL)
    row = tl.cast(tl.program_id(0), tl.int64)
    cols = tl.arange(0, BLOCK_N)
    depth = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        k = start + depth
        x = tl.load(x_ptr + row * stride_x + k, mask=k < K, other=0.0)
        w = tl.load(
            w_ptr + cols[:, None] * stride_w + k[None, :],
            mask=(cols[:, None] < N) & (k[None, :] < K),
            other=0.0,
        )
        acc += tl.cast(x, tl.float32)[None, :] * tl.cast(w, tl.float32)
    out = tl.sum(acc, axis=1)
    tl.store(out_ptr + row * stride_out + cols, tl.cast(out, out_ptr.dtype.element_ty), mask=cols < N)


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel takes x [..., K] @ weight [N, K].T: N <= MAX_OUTPUTS, unit strides on K."""
    return (
        weight.dim() == 2
        and weight.shape[0] <= MAX_OUTPUTS
        and x.shape[-1] == weight.shape[1]
        and x.stride(-1) == 1
        and weight.stride(-1) == 1
    )


def narrow_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T -> [..., N] in x's dtype, every row summed in the same order."""
    rows = x.reshape(-1, x.shape[-1])
    outputs, depth = weight.shape
    out = torch.empty(rows.shape[0], outputs, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        _narrow_linear_kernel[(rows.shape[0],)](
            rows, weight, out, depth, outputs, rows.stride(0), weight.stride(0), out.stride(0),
            BLOCK_N=triton.next_power_of_2(outputs), BLOCK_K=_BLOCK_K, **launch_options(), num_warps=4,
        )  # fmt: skip
    return out.view(*x.shape[:-1], outputs)
