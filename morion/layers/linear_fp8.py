"""A linear layer with FP8 (e4m3) weights and one fp32 weight scale: y = x (weight * weight_scale)^T + bias.

The activation is quantized per row on every call (dynamic amax, on the device), or once for several
layers that read it (`linears_of_one_input`, `Fp8Linear.forward_quantized`), and the product runs in
`torch._scaled_mm` on CUDA; elsewhere, or when K or N is not a multiple of 16 (cuBLASLt's FP8 rule),
the pure-torch reference computes the same math in fp32. `--weight-dtype fp8` swaps these in for
nn.Linear at load (layers/fp8_convert.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import nn

from morion.ops import skinny_tiles
from morion.ops.fp8 import FP8_DTYPE, fp8_linear_quantized, fp8_linear_quantized_reference, quantize_fp8
from morion.ops.log_once import log_once
from morion.ops.moe_tiles import Tiles

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
        tile = self.skinny_tile(rows)
        if tile is not None:
            out = self.forward_skinny(rows, tile)
        else:
            out = self.forward_quantized(*quantize_fp8(rows, per_row=True), x.dtype)
        return out.view(*x.shape[:-1], self.out_features)

    def skinny_tile(self, rows: torch.Tensor) -> Tiles | None:
        """The device's tuned skinny-kernel tile for these rows [M, K] (a decode shape), or None."""
        return skinny_tiles.tile_for(rows, self.weight) if self.kernel_shapes else None

    def forward_skinny(self, rows: torch.Tensor, tile: Tiles) -> torch.Tensor:
        """rows [M, K] in the model dtype through the skinny kernel, which quantizes them itself."""
        from morion.ops.skinny_linear_triton import skinny_linear

        log_once(logger, "FP8 linear: skinny Triton kernel where tuned, rows quantized in the kernel")
        return skinny_linear(rows, self.weight, tile, weight_scale=self.weight_scale, bias=self.bias)

    def forward_quantized(
        self, q: torch.Tensor, row_scale: torch.Tensor, out_dtype: torch.dtype
    ) -> torch.Tensor:
        """An activation already quantized per row (q [M, K] e4m3, M > 0, row_scale [M] fp32: what
        `ops.fp8.quantize_fp8(x, per_row=True)` gives) -> [M, out_features] in `out_dtype`, as `forward`
        of the unquantized rows."""
        if q.is_cuda and self.kernel_shapes:
            log_once(logger, "FP8 linear: torch._scaled_mm, per-row activation and per-tensor weight scales")
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


def linears_of_one_input(x: torch.Tensor, layers: Sequence[nn.Module]) -> list[torch.Tensor]:
    """`[layer(x) for layer in layers]`, x [..., K]; where every layer is an `Fp8Linear`, x is quantized
    once for all of them (the same values each would quantize on its own: one kernel instead of
    len(layers))."""
    if x.numel() == 0 or not all(isinstance(layer, Fp8Linear) for layer in layers):
        return [layer(x) for layer in layers]
    rows = x.reshape(-1, x.shape[-1])
    tiles = [layer.skinny_tile(rows) for layer in layers]
    if all(tile is not None for tile in tiles):  # each skinny kernel quantizes the rows in its prologue
        outs = [layer.forward_skinny(rows, tile) for layer, tile in zip(layers, tiles, strict=True)]
    else:
        q, row_scale = quantize_fp8(rows, per_row=True)
        outs = [layer.forward_quantized(q, row_scale, x.dtype) for layer in layers]
    return [out.view(*x.shape[:-1], layer.out_features) for layer, out in zip(layers, outs, strict=True)]
