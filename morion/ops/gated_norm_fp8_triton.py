"""The Gated DeltaNet output's gated RMSNorm and out_proj's FP8 activation quantization in one kernel.

With FP8 out_proj weights the layer's output goes through two row kernels: the gated norm of each value
head (row_kernels_triton GATED) and then the per-row quantization of the token's [HV * Dv] activation
(`quantize_fp8_rows`). Here one program per token does both: it normalises the token's HV heads as a
[HV, Dv] tile (`rms_norm_row`, the norm kernel's own arithmetic, each head on its own), rounds them to
the model dtype as the norm kernel stores them, and quantizes the row from that (`fp8_row`, the
quantization kernel's own arithmetic). The reference is the two steps in torch:
`quantize_fp8(GatedRMSNorm(x, z).reshape(T, -1), per_row=True)` (or SigmoidGatedRMSNorm, Qwen3.5's).

One program per token: a token's result does not depend on its batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from morion.ops.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE
from morion.ops.pdl import launch_options, wait_for_previous_kernel
from morion.ops.row_kernels_triton import GATED, GATED_MODES, fp8_row, rms_norm_row

# The tile is [HV, Dv] in registers: the 80B model's 32 x 128 (the quantization kernel's rows go to 16K).
MAX_TILE = 16384


@triton.jit
def _gated_norm_fp8_kernel(
    x_ptr, z_ptr, w_ptr, q_ptr, scale_ptr,
    HEADS, K, per_group, stride_zt, stride_zg, stride_zr, eps,
    FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, MODE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous_kernel(USE_PDL)
    token = tl.cast(tl.program_id(0), tl.int64)
    heads = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_K)
    mask_k = cols < K
    mask = (heads < HEADS)[:, None] & mask_k[None, :]
    # x is contiguous [T, HV, Dv]; z any [T, G, r, Dv] view (value head h at group h // r, index h % r).
    row_offsets = heads[:, None] * K + cols[None, :]
    x = tl.cast(tl.load(x_ptr + token * HEADS * K + row_offsets, mask=mask, other=0.0), tl.float32)
    z_offsets = (heads // per_group)[:, None] * stride_zg + (heads % per_group)[:, None] * stride_zr
    z = tl.load(z_ptr + token * stride_zt + z_offsets + cols[None, :], mask=mask, other=0.0)
    normed = rms_norm_row(x, w_ptr, tl.cast(z, tl.float32), x_ptr, K, cols, mask_k, eps, MODE)
    # Rounded to the model dtype as the norm kernel stores it: the quantization sees the same values.
    normed = tl.cast(tl.cast(normed, x_ptr.dtype.element_ty), tl.float32)
    normed = tl.where(mask, normed, 0.0)
    amax = tl.max(tl.max(tl.abs(normed), axis=1), axis=0)
    q, scale = fp8_row(normed, amax, q_ptr, FP8_MAX, MIN_SCALE)
    tl.store(q_ptr + token * HEADS * K + row_offsets, q, mask=mask)
    tl.store(scale_ptr + token, scale)


def supports(x: torch.Tensor, z: torch.Tensor) -> bool:
    """x contiguous [T, HV, Dv]; z [T, HV, Dv] or [T, G, r, Dv] (G * r = HV) with unit stride on Dv."""
    if x.dim() != 3 or not x.is_contiguous() or z.stride(-1) != 1 or z.shape[-1] != x.shape[-1]:
        return False
    heads = z.shape[1] * (z.shape[2] if z.dim() == 4 else 1)
    if z.dim() not in (3, 4) or z.shape[0] != x.shape[0] or heads != x.shape[1]:
        return False
    return triton.next_power_of_2(x.shape[1]) * triton.next_power_of_2(x.shape[2]) <= MAX_TILE


def gated_rms_norm_fp8_rows(
    x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, mode: int = GATED
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated RMSNorm of every value head of x ([T, HV, Dv]; gate z as `supports` takes it; `mode`
    GATED or SIGMOID_GATED of row_kernels_triton), each token's [HV * Dv] result quantized per row:
    (e4m3 [T, HV * Dv], fp32 scale [T]), for `Fp8Linear.forward_quantized`."""
    if mode not in GATED_MODES:
        raise ValueError(f"mode {mode} is not a gated RMSNorm")
    tokens, heads, key = x.shape
    q = torch.empty(tokens, heads * key, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(tokens, dtype=torch.float32, device=x.device)
    if tokens:
        per_group = z.shape[2] if z.dim() == 4 else 1
        stride_zr = z.stride(2) if z.dim() == 4 else 0
        _gated_norm_fp8_kernel[(tokens,)](
            x, z, weight, q, scale, heads, key, per_group, z.stride(0), z.stride(1), stride_zr, eps,
            FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE, MODE=mode,
            BLOCK_H=triton.next_power_of_2(heads), BLOCK_K=triton.next_power_of_2(key), **launch_options(),
        )  # fmt: skip
    return q, scale
