"""The pre-norm residual step fused into one kernel: residual = residual + x, then RMSNorm(residual).

A pre-norm decoder layer does this twice (before its mixer and before its MLP, the first fused with
the previous layer's MLP residual): in eager torch an add kernel and a norm kernel each time. Here one
program per row (batch-invariant: a row's result never depends on the others) loads both rows once and
returns both results, with the eager sequence's rounding points: the sum rounded to the residual's dtype
(as `residual + x` stores it), then normalised exactly as `row_kernels_triton.rms_norm_rows` normalises
a row (the same `rms_norm_row`), so the fused and the unfused CUDA paths give the same bits.

With `quantize` the same program also quantizes the normed row per row for the FP8 layers that read it
(Qwen3-Next's mixer input projections and MoE experts), where `quantize_fp8_rows` would be a kernel of
its own after this one: from the normed values rounded to the model dtype, as that kernel loads them,
through the same `fp8_row`, so the codes and scales are its bits. (One less kernel after each of the two
norms of an FP8 layer: ~96 of a decode step's ~1,045 on the 80B preset.)

x may also be a MoE block's unsummed slot rows (`SlotPartials`): the program adds them first, as the
fused MoE's sum kernel would (`moe_decode_triton.slot_sum`), one kernel fewer after each MoE block.

The pure-torch reference is ops/add_rms_norm.py's `add_rms_norm_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from morion.ops.add_rms_norm import AddNormResult
from morion.ops.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE, QuantizedRows
from morion.ops.moe_decode_triton import slot_sum
from morion.ops.pdl import launch_options, wait_for_previous_kernel
from morion.ops.row_kernels_triton import GATED_MODES, MAX_ROW, fp8_row, rms_norm_row
from morion.ops.slot_partials import SlotPartials


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, residual_ptr, w_ptr, out_ptr, new_residual_ptr, q_ptr, scale_ptr,
    K, stride_x, stride_residual, eps,
    MODE: tl.constexpr, QUANTIZE: tl.constexpr, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
    SLOTS: tl.constexpr, BLOCK: tl.constexpr, VECTOR: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous_kernel(USE_PDL)
    row = tl.cast(tl.program_id(0), tl.int64)
    # Declared contiguous in runs of VECTOR (16 bytes of the rows' dtype), the widest access of the row's
    # loads and stores anyway: a cap on the e4m3 store's, which would take 16 values a thread and pull the
    # whole row into that layout on sm_90. The norm's sum of squares would then run in another order, and
    # the normed bits would differ from the kernel's without QUANTIZE (tests/ops/test_hopper_compile.py).
    cols = tl.max_contiguous(tl.arange(0, BLOCK), VECTOR)
    mask = cols < K
    if SLOTS == 0:
        x = tl.cast(tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0), tl.float32)
    else:
        # x_ptr holds the row's SLOTS fp32 partials ([R, SLOTS, K], `SlotPartials`): added in slot order
        # and rounded once to the stream's dtype, the values moe_decode_triton's sum kernel would store.
        acc = slot_sum(x_ptr, row, K, cols, mask, SLOTS, BLOCK)
        x = tl.cast(tl.cast(acc, new_residual_ptr.dtype.element_ty), tl.float32)
    residual = tl.cast(tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0), tl.float32)
    # Rounded once to the stream's dtype, as torch's `residual + x` stores it, before it is normalised.
    summed = tl.cast(residual + x, new_residual_ptr.dtype.element_ty)
    tl.store(new_residual_ptr + row * K + cols, summed, mask=mask)
    summed = tl.cast(summed, tl.float32)
    out = tl.cast(
        rms_norm_row(summed, w_ptr, summed, out_ptr, K, cols, mask, eps, MODE), out_ptr.dtype.element_ty
    )
    tl.store(out_ptr + row * K + cols, out, mask=mask)
    if QUANTIZE:
        # The stored (rounded) values, as quantize_fp8_rows would load them; masked columns are 0 (a zero
        # row and weight), as that kernel's `other`, so they leave the amax alone.
        out = tl.cast(out, tl.float32)
        q, scale = fp8_row(out, tl.max(tl.abs(out), axis=0), q_ptr, FP8_MAX, MIN_SCALE)
        tl.store(q_ptr + row * K + cols, q, mask=mask)
        tl.store(scale_ptr + row, scale)


def supports(x: torch.Tensor | SlotPartials, residual: torch.Tensor) -> bool:
    """Whether the kernel takes the pair: [R, K] rows of one dtype and shape, unit stride on K; or x as
    the [R, S, K] fp32 partials of a MoE block (contiguous) summing to residual's dtype."""
    rows_ok = residual.dim() == 2 and residual.stride(-1) == 1 and 0 < residual.shape[-1] <= MAX_ROW
    if isinstance(x, SlotPartials):
        values = x.values
        return (
            rows_ok
            and values.dim() == 3
            and values.dtype == torch.float32
            and values.is_contiguous()
            and values.shape[1] > 0
            and x.shape == residual.shape
            and x.dtype == residual.dtype
        )
    return rows_ok and x.shape == residual.shape and x.dtype == residual.dtype and x.stride(-1) == 1


def add_rms_norm_rows(
    x: torch.Tensor | SlotPartials,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    mode: int,
    quantize: bool = False,
) -> AddNormResult:
    """residual + x and its RMSNorm (variant `mode` of row_kernels_triton: LLAMA or ZERO_CENTRED) for
    [R, K] rows (`supports`), with `quantize` also the normed rows quantized per row (e4m3 [R, K], fp32
    scales [R]: `quantize_fp8_rows`' values). x may be a MoE block's `SlotPartials`, added up here as
    `SlotPartials.summed` would. The results are new contiguous tensors; the inputs are left as they
    are."""
    if mode in GATED_MODES:
        raise ValueError("the gated RMSNorm has no residual form")
    shape, device = residual.shape, residual.device
    normed = torch.empty(shape, dtype=residual.dtype, device=device)
    summed = torch.empty(shape, dtype=residual.dtype, device=device)
    quantized = None
    if quantize:
        quantized = QuantizedRows(
            torch.empty(shape, dtype=FP8_DTYPE, device=device),
            torch.empty(shape[0], dtype=torch.float32, device=device),
        )
    if shape[0] == 0:
        return AddNormResult(normed, summed, quantized)
    key = shape[-1]
    block = triton.next_power_of_2(key)
    if isinstance(x, SlotPartials):
        rows, stride_x, slots = x.values, 0, x.values.shape[1]  # the kernel walks [R, S, K] itself
    else:
        rows, stride_x, slots = x, x.stride(0), 0
    # Without `quantize` the code and scale pointers are never read or written (the branch compiles out).
    q, scale = quantized if quantized is not None else (normed, normed)
    vector = min(16 // residual.element_size(), block)
    _add_rms_norm_kernel[(shape[0],)](
        rows, residual, weight, normed, summed, q, scale, key, stride_x, residual.stride(0), eps,
        MODE=mode, QUANTIZE=quantize, FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE, SLOTS=slots, BLOCK=block,
        VECTOR=vector, **launch_options(),
    )  # fmt: skip
    return AddNormResult(normed, summed, quantized)
