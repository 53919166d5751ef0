"""A linear layer with FP8 (e4m3) weights and one fp32 weight scale: y = x (weight * weight_scale)^T + bias.

The activation is quantized per row on every call (dynamic amax, on the device) and the product runs
in `torch._scaled_mm` on CUDA; elsewhere, or when K or N is not a multiple of 16 (cuBLASLt's FP8 rule),
the pure-torch reference computes the same math in fp32. `--weight-dtype fp8` swaps these in for
nn.Linear at load (layers/fp8_convert.py).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from morion.ops.fp8 import FP8_DTYPE, QuantizedRows, fp8_linear, fp8_linear_quantized, fp8_linear_reference
from morion.ops.log_once import log_once

logger = logging.getLogger(__name__)


class Fp8Linear(nn.Module):
    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, bias_dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=FP8_DTYPE), requires_grad=False
        )
        # A buffer, not a parameter: derived from the checkpoint's weight, never stored in one.
        self.register_buffer("weight_scale", torch.ones((), dtype=torch.float32))
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=bias_dtype), requires_grad=False) if bias else None
        )
        self.kernel_shapes = in_features % 16 == 0 and out_features % 16 == 0

    @classmethod
    def like(cls, linear: nn.Linear) -> Fp8Linear:
        """An (unfilled) FP8 layer of linear's shape, on the current default device (meta at load)."""
        bias = linear.bias
        return cls(
            linear.in_features, linear.out_features, bias is not None, None if bias is None else bias.dtype
        )

    def takes_quantized_rows(self, x: torch.Tensor) -> bool:
        """Whether `forward` takes x's rows as `QuantizedRows` (on CUDA, with the GEMM's shapes): a
        producer may then quantize them in its own kernel."""
        return x.is_cuda and self.kernel_shapes

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        """x [..., in_features] -> [..., out_features] in x's dtype; or rows quantized by their producer
        ([M, in_features] -> [M, out_features]; only where `takes_quantized_rows`)."""
        if isinstance(x, QuantizedRows):
            if not self.takes_quantized_rows(x.q):
                raise ValueError("quantized rows are taken on CUDA with K and N multiples of 16 only")
            return fp8_linear_quantized(x, self.weight, self.weight_scale, self.bias)
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] == 0:  # amax of nothing is undefined
            return x.new_empty(*x.shape[:-1], self.out_features)
        if x.is_cuda and self.kernel_shapes:
            log_once(logger, "FP8 linear: torch._scaled_mm, per-row activation and per-tensor weight scales")
            out = fp8_linear(rows, self.weight, self.weight_scale, self.bias)
        else:
            where = (
                f"{self.out_features}x{self.in_features}, not multiples of 16" if x.is_cuda else x.device.type
            )
            log_once(logger, f"FP8 linear: reference (dequantize + F.linear) for {where}")
            out = fp8_linear_reference(rows, self.weight, self.weight_scale, self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )
