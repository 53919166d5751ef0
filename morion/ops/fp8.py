"""FP8 (e4m3) quantization and the FP8 linear op: `torch._scaled_mm` on CUDA beside a pure-torch reference.

A quantized tensor is a pair (q, scale) with real value = q * scale, the scale fp32 and either one for the
whole tensor (0-d) or one per row (`scale.shape == q.shape[:-1]`). Activation scales are computed on the
device from amax: no host sync, so a captured CUDA graph recomputes them on every replay.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
# An all-zero tensor or row gets this scale instead of 0, so it quantizes to zeros rather than NaNs.
MIN_SCALE = 1e-12
# quantize_fp8_ converts at most this many elements at a time, bounding its fp32 temporaries (64 MiB).
_CHUNK_ELEMENTS = 1 << 24


class QuantizedRows(NamedTuple):
    """Rows [M, K] quantized per row, `quantize_fp8(rows, per_row=True)`'s values: handed to the FP8
    layers that read them where they were quantized before (with the norm that made the rows)."""

    q: torch.Tensor  # e4m3 [M, K]
    scale: torch.Tensor  # fp32 [M]


def rows_quantized(rows: torch.Tensor, quantized: QuantizedRows | None) -> QuantizedRows:
    """rows [M, K] quantized per row: `quantized` where the op that made them did it already, else
    `quantize_fp8(rows, per_row=True)` now."""
    return quantized if quantized is not None else QuantizedRows(*quantize_fp8(rows, per_row=True))


def fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    """The fp32 scale that maps `amax` onto the largest e4m3 value. On CUDA torch divides by a Python
    scalar as a product with its reciprocal, which can be one ulp off the IEEE quotient that the Triton
    kernels (`row_kernels_triton.fp8_row`) and the CPU compute: compare their scales with this on the CPU."""
    return (amax.float() / FP8_MAX).clamp(min=MIN_SCALE)


def _expand(scale: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """A per-tensor (0-d) scale as is; a per-row scale [...] as [..., 1] to broadcast over q [..., K]."""
    return scale if scale.dim() == 0 else scale.unsqueeze(-1)


def _cast(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.float() / _expand(scale, x)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_fp8(x: torch.Tensor, per_row: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (e4m3 [..., K], fp32 scale: 0-d, or [...] with `per_row`). Per-row quantization of a
    CUDA tensor runs as one fused Triton kernel (same values)."""
    if per_row and x.is_cuda:
        from morion.ops import row_kernels_triton

        if row_kernels_triton.supports(x):
            return row_kernels_triton.quantize_fp8_rows(x)
    amax = x.abs().amax(dim=-1) if per_row else x.abs().amax()
    scale = fp8_scale(amax)
    return _cast(x, scale), scale


def quantize_fp8_sigmoid_gated(x: torch.Tensor, gate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H, D] * sigmoid(gate [T, H, D]) in x's dtype (the sigmoid rounded to it, then the product, as
    torch computes it), each token's row of H * D quantized: (e4m3 [T, H * D], fp32 scale [T]).

    On CUDA one Triton kernel, whose exp (the special function unit's) may differ from torch's in the
    last bits of fp32. Where those bits flip the sigmoid's rounding (rare: a few elements in 2^16) the
    gate factor differs by one ulp of x's dtype and the product by at most two, before the e4m3 rounding
    (16 times coarser than bf16's); the row's scale moves only if its largest element is one of them."""
    tokens = x.shape[0]
    if x.is_cuda and tokens:
        from morion.ops import row_kernels_triton

        if x.is_contiguous() and gate.stride(-1) == 1 and row_kernels_triton.supports(x.view(tokens, -1)):
            return row_kernels_triton.quantize_fp8_sigmoid_gated_rows(x, gate)
    return quantize_fp8((x * torch.sigmoid(gate)).flatten(1), per_row=True)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.to(torch.float32) * _expand(scale, q)).to(dtype)


def fake_quantize_fp8(x: torch.Tensor, per_row: bool = False) -> torch.Tensor:
    """x through quantize and dequantize, in fp32: what an FP8 kernel sees of an activation."""
    return dequantize_fp8(*quantize_fp8(x, per_row))


@torch.no_grad()
def quantize_fp8_(source: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> None:
    """Fills the e4m3 `weight` and its fp32 `scale` from `source` (weight's shape, any float dtype and
    device). The scale's shape picks the granularity: 0-d for one scale, `weight.shape[:-1]` for one per
    row. Works on weight's device, `_CHUNK_ELEMENTS` at a time, so the only large temporary is source's
    copy on that device."""
    if tuple(source.shape) != tuple(weight.shape):
        raise ValueError(f"source {tuple(source.shape)} does not match weight {tuple(weight.shape)}")
    per_row = scale.dim() > 0
    if per_row and tuple(scale.shape) != tuple(weight.shape[:-1]):
        raise ValueError(f"per-row scale {tuple(scale.shape)} does not match weight {tuple(weight.shape)}")
    source = source.to(weight.device)
    width = weight.shape[-1]
    rows = max(1, _CHUNK_ELEMENTS // max(width, 1))
    source_rows, weight_rows = source.reshape(-1, width), weight.view(-1, width)
    if per_row:
        scale_rows = scale.view(-1)
        for start in range(0, source_rows.shape[0], rows):
            q, s = quantize_fp8(source_rows[start : start + rows], per_row=True)
            weight_rows[start : start + rows].copy_(q)
            scale_rows[start : start + rows].copy_(s)
        return
    chunks = source_rows.split(rows)
    scale.copy_(fp8_scale(torch.stack([chunk.abs().amax() for chunk in chunks]).amax()))
    for start, chunk in zip(range(0, source_rows.shape[0], rows), chunks, strict=True):
        weight_rows[start : start + rows].copy_(_cast(chunk, scale))


_UNIT_SCALES: dict[torch.device, torch.Tensor] = {}


def _unit_scale(device: torch.device) -> torch.Tensor:
    """A 0-d fp32 one on `device`, made once (a fill kernel per FP8 linear would be ~250 launches per
    decode step of an 80B model). Only one made outside CUDA-graph capture is kept: one made inside a
    capture is filled only when that graph replays, so it belongs to that graph alone."""
    unit = _UNIT_SCALES.get(device)
    if unit is None:
        unit = torch.ones((), dtype=torch.float32, device=device)
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _UNIT_SCALES[device] = unit
    return unit


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] @ (weight [N, K] e4m3 * weight_scale (0-d fp32)).T + bias -> [M, N] in x's dtype.

    The activation is quantized per row, so a row's result never depends on the other rows of the batch
    (batched = single, and CUDA-graph padding rows cannot change real rows); the product is
    `fp8_linear_quantized`'s. Needs K and N multiples of 16.
    """
    return fp8_linear_quantized(*quantize_fp8(x, per_row=True), weight, weight_scale, bias, x.dtype)


def fp8_linear_quantized(
    q: torch.Tensor,
    row_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """`fp8_linear` of an activation already quantized per row (q [M, K] e4m3, row_scale [M] fp32), so
    that layers reading one input quantize it once. Rows of M = 0 are not allowed (cuBLASLt).

    Where the device tuned this shape for the skinny kernel (ops/skinny_tiles.py: decode sizes, where it
    measured faster), that one kernel applies both scales and the bias to its fp32 sums. Otherwise the
    GEMM runs `torch._scaled_mm` (cuBLASLt) with per-tensor scales, the recipe that is fastest at decode
    sizes (kernels-and-libraries.md §4: 1.6x over bf16 where the rowwise kernel gains nothing), and the
    row scales are applied to its output. `weight.t()` is the column-major operand cuBLASLt wants.
    """
    from morion.ops.skinny_tiles import tile_for

    tile = tile_for(q, weight)
    if tile is not None:
        from morion.ops.skinny_linear_triton import skinny_linear

        return skinny_linear(
            q, weight, tile, x_scale=row_scale, weight_scale=weight_scale, bias=bias, out_dtype=out_dtype
        )
    return scaled_mm_rows(q, row_scale, weight, weight_scale, bias, out_dtype)


def scaled_mm_rows(
    q: torch.Tensor,
    row_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """`fp8_linear_quantized` through cuBLASLt whatever the shape (what the skinny kernel is timed
    against: bench/skinny_tune.py)."""
    out = torch._scaled_mm(
        q, weight.t(), scale_a=_unit_scale(q.device), scale_b=weight_scale, out_dtype=out_dtype
    )
    # The fp32 row scales multiply in place, rounded once into the output dtype: one kernel, where casting
    # the scales to that dtype first would be two (and round them).
    out.mul_(row_scale.unsqueeze(-1))
    # The bias is added here rather than in the GEMM epilogue, whose bias dtype rules depend on out_dtype.
    return out if bias is None else out + bias


def fp8_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The same math as `fp8_linear` in fp32: the activation quantized per row, both operands
    dequantized, F.linear. Any shapes; the result in x's dtype."""
    return fp8_linear_quantized_reference(*quantize_fp8(x, per_row=True), weight, weight_scale, bias, x.dtype)


def fp8_linear_quantized_reference(
    q: torch.Tensor,
    row_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """`fp8_linear_quantized`'s math in fp32: both operands dequantized, F.linear. Any shapes."""
    out = F.linear(dequantize_fp8(q, row_scale), dequantize_fp8(weight, weight_scale))
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)
