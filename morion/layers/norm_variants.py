"""The RMSNorm variants of the Qwen3-Next family.

- `ZeroCentredRMSNorm`: the weight is stored as an offset from one and applied as (1 + w), all in fp32,
  cast once at the end (Gemma-style). Every norm of the decoder trunk, q/k norms and the MTP norms.
- `GatedRMSNorm`: the Gated DeltaNet output norm, rmsnorm(x) * w * silu(z); *not* zero-centred.
- `SigmoidGatedRMSNorm`: the same with sigmoid(z), Qwen3.5's Gated DeltaNet output norm.

On CUDA each runs as one fused Triton kernel (ops/row_kernels_triton.py) with the same rounding
points; the torch code here is its reference.
`ZeroCentredRMSNorm.add_and_norm` is a pre-norm layer's residual add and norm, one kernel on CUDA
(ops/add_rms_norm_triton.py), with `quantize` also the normed rows' per-row FP8 quantization (in the same
kernel) for FP8 layers that read them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from morion.ops.add_rms_norm import AddNormResult, add_rms_norm_reference
from morion.ops.slot_partials import SlotPartials


def _rms_normalize(x32: torch.Tensor, eps: float) -> torch.Tensor:
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


class ZeroCentredRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from morion.ops import row_kernels_triton as rows

            if rows.supports(x):
                return rows.rms_norm_rows(x, self.weight, self.eps, rows.ZERO_CENTRED)
        # Unlike Llama's RMSNorm, the product with the weight is taken in fp32 and rounded once.
        return (_rms_normalize(x.float(), self.eps) * (1.0 + self.weight.float())).to(x.dtype)

    def add_and_norm(
        self, x: torch.Tensor | SlotPartials, residual: torch.Tensor, quantize: bool = False
    ) -> AddNormResult:
        """(norm(residual + x), residual + x), the sum rounded to the model dtype before the norm; with
        `quantize` (x [M, K]) also `quantize_fp8(normed, per_row=True)`, for FP8 layers reading normed.
        x may be a MoE block's unsummed output (`SlotPartials`): on CUDA the kernel adds its slots, else
        they are summed first (the same values)."""
        if residual.is_cuda:
            from morion.ops import add_rms_norm_triton as fused
            from morion.ops.row_kernels_triton import ZERO_CENTRED

            if fused.supports(x, residual):
                return fused.add_rms_norm_rows(x, residual, self.weight, self.eps, ZERO_CENTRED, quantize)
        if isinstance(x, SlotPartials):
            x = x.summed()
        return add_rms_norm_reference(x, residual, self, quantize)


class GatedRMSNorm(nn.Module):
    """Normalises over the last dim (one value head), then scales by w and gates by silu(z)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from morion.ops import row_kernels_triton as rows

            if rows.supports(x) and rows.supports(z) and z.shape == x.shape:
                return rows.rms_norm_rows(x, self.weight, self.eps, rows.GATED, gate=z)
        # Rounding points follow transformers' Qwen3NextRMSNormGated (and fla's fused kernel): the
        # normalised x is cast to the input dtype before the weight, the gate is applied in fp32.
        normed = self.weight * _rms_normalize(x.float(), self.eps).to(x.dtype)
        return (normed * F.silu(z.float())).to(x.dtype)


class SigmoidGatedRMSNorm(nn.Module):
    """rmsnorm(x) * w * sigmoid(z) per value head. Rounding points as transformers'
    `Qwen4ExpTextRMSNormGated`: the normalised x is cast to the input dtype before the weight, the gate is
    applied in fp32, the product cast once."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from morion.ops import row_kernels_triton as rows

            if rows.supports(x) and rows.supports(z) and z.shape == x.shape:
                return rows.rms_norm_rows(x, self.weight, self.eps, rows.SIGMOID_GATED, gate=z)
        normed = self.weight * _rms_normalize(x.float(), self.eps).to(x.dtype)
        return (normed * torch.sigmoid(z.float())).to(x.dtype)
