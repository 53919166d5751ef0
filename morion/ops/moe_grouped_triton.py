"""The grouped MoE path's elementwise steps on CUDA (`ops.moe.moe_experts_grouped` with FP8 experts), one
kernel each where torch runs a chain over the P = T * k (token, slot) pairs:

1. `swiglu_quantize`: the down projection's input, silu(gate) * up * w (w the pair's routing weight, in
   the model's dtype: torch's three rounding points), quantized per row to e4m3 for the FP8 grouped GEMM
   (`quantize_fp8(act, per_row=True)`'s values). Torch ran three elementwise kernels and the quantizer,
   each reading or writing all P rows of I columns.
2. `combine_pairs`: each token's k expert outputs, read from their rows of the expert-sorted layout and
   summed in fp32 in slot order, rounded once to the model's dtype. Torch scattered the P rows back to
   pair order (`index_copy_`: all P x H written and read again), then summed.

At a 4K-token prefill chunk these chains were ~0.4 ms of a 48-layer model's layer
(results/2026-12-04-h200-session-notes-ecd66bc.md). Both kernels are one program per row (a pair, a
token), so a row's result never depends on the others, and every shape depends on T, k, I and H only:
the piecewise prefill graphs capture them. The torch code in `ops/moe.py` stays the reference and the CPU
path; `exp` is the special function unit's (the last fp32 bits of silu may differ from torch's, which a
bf16 rounding hides nearly always, as in the other fused SiLU kernels here).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from morion.ops.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE
from morion.ops.pdl import launch_options, wait_for_previous_kernel
from morion.ops.row_kernels_triton import fp8_row, rounded

_COMBINE_BLOCK = 512  # H columns a combine program sums


@triton.jit
def _swiglu_quantize_kernel(
    gate_up_ptr, weights_ptr, q_ptr, scale_ptr, inter_size, stride_row,
    FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous_kernel(USE_PDL)
    row = tl.cast(tl.program_id(0), tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < inter_size
    dtype = gate_up_ptr.dtype.element_ty
    base = gate_up_ptr + row * stride_row
    gate = tl.cast(tl.load(base + cols, mask=mask, other=0.0), tl.float32)
    up = tl.cast(tl.load(base + inter_size + cols, mask=mask, other=0.0), tl.float32)
    weight = rounded(tl.load(weights_ptr + row), dtype)
    act = rounded(tl.math.div_rn(gate, 1.0 + tl.exp(-gate)), dtype)  # silu, as torch's
    act = rounded(act * up, dtype)
    act = rounded(act * weight, dtype)
    q, scale = fp8_row(act, tl.max(tl.abs(act), axis=0), q_ptr, FP8_MAX, MIN_SCALE)
    tl.store(q_ptr + row * inter_size + cols, q, mask=mask)
    tl.store(scale_ptr + row, scale)


def swiglu_quantize(gate_up: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up [P, 2I] (gate columns first, unit stride on columns), weights [P] or [P, 1] (any float
    dtype, rounded to gate_up's as torch's `.to` does) -> (e4m3 [P, I], fp32 scale [P]): the values of
    `quantize_fp8(silu(gate) * up * weights.to(gate_up.dtype), per_row=True)` as torch rounds them."""
    rows, width = gate_up.shape
    inter_size = width // 2
    if gate_up.stride(1) != 1 or width % 2:
        raise ValueError(
            f"expected gate_up [P, 2I] with unit stride on its columns, got {tuple(gate_up.shape)}"
        )
    q = torch.empty(rows, inter_size, dtype=FP8_DTYPE, device=gate_up.device)
    scale = torch.empty(rows, dtype=torch.float32, device=gate_up.device)
    if rows:
        _swiglu_quantize_kernel[(rows,)](
            gate_up, weights.reshape(-1).contiguous(), q, scale, inter_size, gate_up.stride(0),
            FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE, BLOCK=triton.next_power_of_2(inter_size),
            **launch_options(),
        )  # fmt: skip
    return q, scale


@triton.jit
def _combine_pairs_kernel(
    values_ptr, position_ptr, out_ptr, hidden_size, stride_values, stride_out,
    TOP_K: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous_kernel(USE_PDL)
    token = tl.cast(tl.program_id(0), tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden_size
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for slot in tl.static_range(TOP_K):
        position = tl.cast(tl.load(position_ptr + token * TOP_K + slot), tl.int64)
        row = tl.load(values_ptr + position * stride_values + cols, mask=mask, other=0.0)
        total += tl.cast(row, tl.float32)
    tl.store(out_ptr + token * stride_out + cols, tl.cast(total, out_ptr.dtype.element_ty), mask=mask)


def combine_pairs(values: torch.Tensor, order: torch.Tensor, top_k: int, dtype: torch.dtype) -> torch.Tensor:
    """values [P, H] in expert-sorted order (row i is pair order[i], pair p = t * k + j) -> [T, H] in
    `dtype`: out[t] = the sum over j of pair t * k + j's row, in fp32 in slot order, rounded once."""
    pairs, hidden_size = values.shape
    if values.stride(1) != 1 or pairs % top_k:
        raise ValueError(f"expected values [T * {top_k}, H] with unit stride on H, got {tuple(values.shape)}")
    tokens = pairs // top_k
    out = torch.empty(tokens, hidden_size, dtype=dtype, device=values.device)
    if tokens:
        # Where each pair's row sits in the sorted layout: the inverse of `order`.
        position = torch.empty_like(order)
        position[order] = torch.arange(pairs, dtype=order.dtype, device=order.device)
        _combine_pairs_kernel[(tokens, triton.cdiv(hidden_size, _COMBINE_BLOCK))](
            values, position, out, hidden_size, values.stride(0), out.stride(0),
            TOP_K=top_k, BLOCK=_COMBINE_BLOCK, **launch_options(),
        )  # fmt: skip
    return out
