"""The pre-norm residual step fused into one kernel: residual = residual + x, then RMSNorm(residual).

A pre-norm decoder layer does this twice (before its mixer and before its MLP, the first fused with
the previous layer's MLP residual): in eager torch an add kernel and a norm kernel each time. Here one
program per row (batch-invariant: a row's result never depends on the others) loads both rows once and
returns both results, with the eager sequence's rounding points: the sum rounded to the residual's dtype
(as `residual + x` stores it), then normalised exactly as `row_kernels_triton.rms_norm_rows` normalises
a row (the same `rms_norm_row`), so the fused and the unfused CUDA paths give the same bits.

The pure-torch reference is ops/add_rms_norm.py's `add_rms_norm_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from morion.ops.add_rms_norm import AddNormResult
from morion.ops.row_kernels_triton import GATED_MODES, MAX_ROW, rms_norm_row


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, residual_ptr, w_ptr, out_ptr, new_residual_ptr,
    K, stride_x, stride_residual, eps,
    MODE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.cast(tl.program_id(0), tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < K
    x = tl.cast(tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0), tl.float32)
    residual = tl.cast(tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0), tl.float32)
    # Rounded once to the stream's dtype, as torch's `residual + x` stores it, before it is normalised.
    summed = tl.cast(residual + x, new_residual_ptr.dtype.element_ty)
    tl.store(new_residual_ptr + row * K + cols, summed, mask=mask)
    summed = tl.cast(summed, tl.float32)
    out = rms_norm_row(summed, w_ptr, summed, out_ptr, K, cols, mask, eps, MODE)
    tl.store(out_ptr + row * K + cols, tl.cast(out, out_ptr.dtype.element_ty), mask=mask)


def supports(x: torch.Tensor, residual: torch.Tensor) -> bool:
    """Whether the kernel takes the pair: [R, K] rows of one dtype and shape, unit stride on K."""
    return (
        x.dim() == 2
        and x.shape == residual.shape
        and x.dtype == residual.dtype
        and x.stride(-1) == 1
        and residual.stride(-1) == 1
        and 0 < x.shape[-1] <= MAX_ROW
    )


def add_rms_norm_rows(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, mode: int
) -> AddNormResult:
    """residual + x and its RMSNorm (variant `mode` of row_kernels_triton: LLAMA or ZERO_CENTRED) for
    [R, K] rows (`supports`). Both results are new contiguous tensors; the inputs are left as they are."""
    if mode in GATED_MODES:
        raise ValueError("the gated RMSNorm has no residual form")
    normed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    summed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return AddNormResult(normed, summed)
    key = x.shape[-1]
    _add_rms_norm_kernel[(x.shape[0],)](
        x, residual, weight, normed, summed, key, x.stride(0), residual.stride(0), eps,
        MODE=mode, BLOCK=triton.next_power_of_2(key),
    )  # fmt: skip
    return AddNormResult(normed, summed)
