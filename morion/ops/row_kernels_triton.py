"""Row-wise elementwise chains fused into one Triton kernel each: RMSNorm (three variants) and per-row FP8
quantization, optionally of x * sigmoid(gate) (gated attention's output, quantized for o_proj).

In eager torch each is a chain of 6-10 tiny kernels (upcast, square, mean, rsqrt, scale, cast, ...). A
decode step runs them for every layer, so even inside a CUDA graph their launch gaps added up to most of
the step (measured on an H200: ~2,000 kernels per step of a 12-layer Qwen3-Next, 60% of them elementwise).
Each kernel here is one program per row and reproduces the torch code's rounding points exactly, so the
pure-torch versions (layers/norm*.py, ops/fp8.py) remain the references.

Rows: x is [R, K] or [T, H, K] with a unit stride on K (a [T, H, K] view of a wider projection, such as
the query half of Qwen3-Next's gated q_proj, is read in place). K <= MAX_ROW.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from morion.ops.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE

MAX_ROW = 16384

# RMSNorm variants (`mode`):
LLAMA = 0  # weight * round(x * r): the product in the weight's dtype (layers/norm.py)
ZERO_CENTRED = 1  # round(x * r * (1 + weight)) in fp32 (layers/norm_variants.ZeroCentredRMSNorm)
GATED = 2  # round(round(weight * round(x * r)) * silu(z)) (layers/norm_variants.GatedRMSNorm)


@triton.jit
def _load_row(ptr, row, inner, stride_outer, stride_inner, cols, mask):
    """Row `row` of a [R, K] or [T, H, K] tensor (see `_rows`), its columns `cols`, in fp32."""
    row64 = tl.cast(row, tl.int64)
    offset = (row64 // inner) * stride_outer + (row64 % inner) * stride_inner
    return tl.cast(tl.load(ptr + offset + cols, mask=mask, other=0.0), tl.float32)


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, z_ptr, out_ptr,
    K, inner, stride_xo, stride_xi, stride_zo, stride_zi,
    eps,
    MODE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < K
    x = _load_row(x_ptr, row, inner, stride_xo, stride_xi, cols, mask)
    normed = x * tl.rsqrt(tl.sum(x * x, axis=0) / K + eps)
    w = tl.cast(tl.load(w_ptr + cols, mask=mask, other=0.0), tl.float32)
    out_dtype = out_ptr.dtype.element_ty
    if MODE == 0:
        out = w * tl.cast(tl.cast(normed, out_dtype), tl.float32)
    elif MODE == 1:
        out = normed * (1.0 + w)
    else:
        z = _load_row(z_ptr, row, inner, stride_zo, stride_zi, cols, mask)
        gated = tl.cast(tl.cast(w * tl.cast(tl.cast(normed, out_dtype), tl.float32), out_dtype), tl.float32)
        out = gated * (z / (1.0 + tl.exp(-z)))
    tl.store(out_ptr + tl.cast(row, tl.int64) * K + cols, tl.cast(out, out_dtype), mask=mask)


@triton.jit
def _quantize_fp8_rows_kernel(
    x_ptr, z_ptr, q_ptr, scale_ptr, K, inner, stride_xo, stride_xi, z_head_dim, stride_zt, stride_zh,
    FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, SIGMOID_GATED: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < K
    x = _load_row(x_ptr, row, inner, stride_xo, stride_xi, cols, mask)
    if SIGMOID_GATED:
        # Row `row` of x [T, K] times sigmoid of the gate [T, H, D] (H * D = K, a strided view), rounded as
        # torch rounds x * torch.sigmoid(z) in x's dtype: the sigmoid, then the product.
        dtype = x_ptr.dtype.element_ty
        heads, dims = cols // z_head_dim, cols % z_head_dim
        z_offset = tl.cast(row, tl.int64) * stride_zt + heads * stride_zh + dims
        z = tl.cast(tl.load(z_ptr + z_offset, mask=mask, other=0.0), tl.float32)
        sigmoid = tl.cast(tl.cast(tl.math.div_rn(1.0, 1.0 + tl.exp(-z)), dtype), tl.float32)
        x = tl.cast(tl.cast(x * sigmoid, dtype), tl.float32)
    # IEEE-rounded divisions (Triton's `/` is approximate on the GPU): the same scale and values as torch.
    scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), axis=0), FP8_MAX), MIN_SCALE)
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX), FP8_MAX)
    q = tl.cast(q, q_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
    tl.store(q_ptr + tl.cast(row, tl.int64) * K + cols, q, mask=mask)
    tl.store(scale_ptr + row, scale)


def _rows(x: torch.Tensor) -> tuple[int, int, int, int]:
    """(rows, inner, outer stride, inner stride) of a [R, K] or [T, H, K] tensor with unit stride on K."""
    if x.dim() == 2:
        return x.shape[0], 1, x.stride(0), 0
    if x.dim() == 3:
        return x.shape[0] * x.shape[1], x.shape[1], x.stride(0), x.stride(1)
    raise ValueError(f"expected [R, K] or [T, H, K], got {tuple(x.shape)}")


def supports(x: torch.Tensor) -> bool:
    """Whether these kernels take x: 2-D or 3-D, unit stride on the last dim, a row of at most MAX_ROW."""
    return x.dim() in (2, 3) and x.stride(-1) == 1 and 0 < x.shape[-1] <= MAX_ROW


def rms_norm_rows(
    x: torch.Tensor, weight: torch.Tensor, eps: float, mode: int, gate: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm of every row of x (variant `mode`; GATED multiplies by silu(gate), gate shaped like x).
    Returns a contiguous tensor of x's shape and dtype."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    num_rows, inner, stride_xo, stride_xi = _rows(x)
    if num_rows == 0:
        return out
    z = gate if gate is not None else x
    _, _, stride_zo, stride_zi = _rows(z)
    key = x.shape[-1]
    _rms_norm_kernel[(num_rows,)](
        x, weight, z, out, key, inner, stride_xo, stride_xi, stride_zo, stride_zi, eps,
        MODE=mode, BLOCK=triton.next_power_of_2(key),
    )  # fmt: skip
    return out


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, K] -> (e4m3 [R, K], fp32 scale [R]), the values of `ops.fp8.quantize_fp8(x, per_row=True)`."""
    num_rows, inner, stride_xo, stride_xi = _rows(x)
    return _quantize(x, num_rows, inner, stride_xo, stride_xi, None)


def quantize_fp8_sigmoid_gated_rows(x: torch.Tensor, gate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H, D] contiguous times sigmoid(gate [T, H, D], unit stride on D), each token's row of H * D
    quantized: (e4m3 [T, H * D], fp32 scale [T]), the values of `ops.fp8.quantize_fp8_sigmoid_gated` up
    to the sigmoid's rounding (see there)."""
    if not (x.is_contiguous() and gate.shape == x.shape and gate.stride(-1) == 1):
        raise ValueError(f"expected x contiguous and a gate of its shape {tuple(x.shape)}, unit stride on D")
    rows = x.view(x.shape[0], -1)
    return _quantize(rows, rows.shape[0], 1, rows.stride(0), 0, gate)


def _quantize(
    x: torch.Tensor, num_rows: int, inner: int, stride_xo: int, stride_xi: int, gate: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    if num_rows == 0:
        return q, scale
    key = x.shape[-1]
    z, z_head_dim, stride_zt, stride_zh = (
        (x, 1, 0, 0) if gate is None else (gate, gate.shape[-1], *gate.stride()[:2])
    )
    _quantize_fp8_rows_kernel[(num_rows,)](
        x, z, q, scale, key, inner, stride_xo, stride_xi, z_head_dim, stride_zt, stride_zh,
        FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE, SIGMOID_GATED=gate is not None,
        BLOCK=triton.next_power_of_2(key),
    )  # fmt: skip
    return q, scale
