"""A linear layer with FP8 (e4m3) weights and one fp32 weight scale: y = x (weight * weight_scale)^T + bias.

The activation is quantized per row on every call (dynamic amax, on the device: one row kernel on
CUDA), or once for several layers that read it (`linears_of_one_input`, `Fp8Linear.forward_quantized`),
or by the op that made the rows (`QuantizedRows` of a fused residual add + norm: Qwen3-Next's decoder
layer hands them to its FP8 mixer projections and experts), and the product of the e4m3 rows runs on
CUDA in `ops.fp8.fp8_linear_quantized`: the skinny Triton kernel where the device tuned the shape (the
very op bench/skinny_tune.py timed), else
`torch._scaled_mm`; elsewhere, or when K or N is not a multiple of 16 (cuBLASLt's FP8 rule), the
pure-torch reference computes the same math in fp32. Rows are never handed to a kernel unquantized:
the skinny kernel's own quantization, re-done in each of its column programs, made the H200's decode
step slower (ops/skinny_linear_triton.py). `--weight-dtype fp8` swaps these in for nn.Linear at load
(layers/fp8_convert.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from morion.ops.fp8 import (
    FP8_DTYPE,
    QuantizedRows,
    fp8_linear_quantized,
    fp8_linear_quantized_reference,
    quantize_fp8,
    rows_quantized,
)
from morion.ops.log_once import log_once

if TYPE_CHECKING:
    from morion.layers.merged_linears import MergedLinears

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in_features] -> [..., out_features] in x's dtype."""
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] == 0:  # amax of nothing is undefined
            return x.new_empty(*x.shape[:-1], self.out_features)
        out = self.forward_quantized(*quantize_fp8(rows, per_row=True), x.dtype)
        return out.view(*x.shape[:-1], self.out_features)

    def forward_quantized(
        self, q: torch.Tensor, row_scale: torch.Tensor, out_dtype: torch.dtype
    ) -> torch.Tensor:
        """An activation already quantized per row (q [M, K] e4m3, M > 0, row_scale [M] fp32: what
        `ops.fp8.quantize_fp8(x, per_row=True)` gives) -> [M, out_features] in `out_dtype`, as `forward`
        of the unquantized rows."""
        if q.is_cuda and self.kernel_shapes:
            log_once(logger, "FP8 linear: e4m3 rows through the tuned skinny kernel, else torch._scaled_mm")
            return fp8_linear_quantized(q, row_scale, self.weight, self.weight_scale, self.bias, out_dtype)
        where = f"{self.out_features}x{self.in_features}, not multiples of 16" if q.is_cuda else q.device.type
        log_once(logger, f"FP8 linear: reference (dequantize + F.linear) for {where}")
        return fp8_linear_quantized_reference(
            q, row_scale, self.weight, self.weight_scale, self.bias, out_dtype
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )


def all_fp8(layers: Sequence[nn.Module]) -> bool:
    """Whether every layer is an `Fp8Linear`: `linears_of_one_input` then reads x quantized per row."""
    return all(isinstance(layer, Fp8Linear) for layer in layers)


def linears_of_one_input(
    x: torch.Tensor,
    layers: Sequence[nn.Module],
    quantized: QuantizedRows | None = None,
    merged: MergedLinears | None = None,
) -> list[torch.Tensor]:
    """`[layer(x) for layer in layers]`, x [..., K]; where every layer is an `Fp8Linear`, x is quantized
    once for all of them (the same values each would quantize on its own: one kernel instead of
    len(layers)), whichever product each layer then runs. `quantized`, x's rows already quantized per row
    (`quantize_fp8(x.reshape(-1, K), per_row=True)`'s values, e.g. by the norm that made x), is read
    instead of quantizing x again; only FP8 layers take it. `merged`: these layers' `MergedLinears`
    (layers/merged_linears.py), one launch for all of them where it runs the rows (outputs are then
    views of its output's columns)."""
    fp8 = all_fp8(layers)
    if quantized is not None and not fp8:
        raise ValueError("pre-quantized rows were given to layers that are not all FP8")
    if x.numel() == 0 or not fp8:
        return [layer(x) for layer in layers]
    q, row_scale = rows_quantized(x.reshape(-1, x.shape[-1]), quantized)
    outputs = merged.outputs(q, row_scale, x.dtype) if merged is not None else None
    if outputs is not None:
        return [out.unflatten(0, x.shape[:-1]) for out in outputs]
    return [
        layer.forward_quantized(q, row_scale, x.dtype).view(*x.shape[:-1], layer.out_features)
        for layer in layers
    ]
