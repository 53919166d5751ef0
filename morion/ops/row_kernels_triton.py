"""Row-wise elementwise chains fused into one Triton kernel each: RMSNorm (four variants, one weight or one
per group of a row's width), per-row FP8 quantization, optionally of x * sigmoid(gate) (gated attention's
output, quantized for o_proj), and the dot product of two rows.

In eager torch each is a chain of 6-10 tiny kernels (upcast, square, mean, rsqrt, scale, cast, ...). A
decode step runs them for every layer, so even inside a CUDA graph their launch gaps added up to most of
the step (measured on an H200: ~2,000 kernels per step of a 12-layer Qwen3-Next, 60% of them elementwise).
Each kernel here is one program per row and reproduces the torch code's rounding points exactly, so the
pure-torch versions (layers/norm*.py, ops/fp8.py) remain the references. One program per row also makes
them batch invariant: a row's bits never depend on how many rows run beside it, where torch's reductions
split a row's sum by the number of rows (on an H200, Flash-Next's grouped norms in torch gave another
last bit at one row than beside others:
results/2026-12-02-h200-row-invariance-flash-next-12l-tuned-77ea040.json).

Rows: x is [R, K], [T, H, K] or [T, G, R, K] with a unit stride on K, read in place through its strides (a
[T, H, K] view of a wider projection, such as the query half of Qwen3-Next's gated q_proj; a [T, G, R, K]
view of a group-first one, such as the z part of Qwen3-Next's in_proj_qkvz, R value heads per key-head
group G). K <= MAX_ROW.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from morion.ops.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE
from morion.ops.pdl import launch_options, wait_for_previous_kernel

MAX_ROW = 16384

# RMSNorm variants (`mode`):
LLAMA = 0  # weight * round(x * r): the product in the weight's dtype (layers/norm.py)
ZERO_CENTRED = 1  # round(x * r * (1 + weight)) in fp32 (layers/norm_variants.ZeroCentredRMSNorm)
GATED = 2  # round(round(weight * round(x * r)) * silu(z)) (layers/norm_variants.GatedRMSNorm)
SIGMOID_GATED = 3  # the same with sigmoid(z) (layers/norm_variants.SigmoidGatedRMSNorm)
GATED_MODES = (GATED, SIGMOID_GATED)


@triton.jit
def _load_row(ptr, row, groups, per_group, stride_t, stride_g, stride_r, cols, mask):
    """Row `row` of a [T, G, R, K] tensor (2-D and 3-D ones as such with G = R = 1 or R = 1: see `_rows`),
    its columns `cols`, in fp32."""
    row64 = tl.cast(row, tl.int64)
    outer = row64 // per_group
    offset = (outer // groups) * stride_t + (outer % groups) * stride_g + (row64 % per_group) * stride_r
    return tl.cast(tl.load(ptr + offset + cols, mask=mask, other=0.0), tl.float32)


@triton.jit
def rms_norm_row(x, w_ptr, z, out_ptr, K, cols, mask, eps, MODE: tl.constexpr):
    """The RMSNorm of one fp32 row x (variant MODE; z the gate row for GATED), in fp32, to be cast once
    into out_ptr's dtype. Every kernel that normalises rows goes through here, so a row gets the same
    bits whichever kernel (plain or fused with the residual add) normalises it. x may be a 2-D tile of
    rows ([rows, BLOCK], cols and mask then for its columns): each row is normalised on its own."""
    normed = x * tl.rsqrt(tl.sum(x * x, axis=-1, keep_dims=True) / K + eps)
    w = tl.cast(tl.load(w_ptr + cols, mask=mask, other=0.0), tl.float32)
    out_dtype = out_ptr.dtype.element_ty
    if MODE == 0:
        out = w * tl.cast(tl.cast(normed, out_dtype), tl.float32)
    elif MODE == 1:
        out = normed * (1.0 + w)
    else:
        gated = tl.cast(tl.cast(w * tl.cast(tl.cast(normed, out_dtype), tl.float32), out_dtype), tl.float32)
        # silu(z) = z / (1 + e^-z); sigmoid(z) = 1 / (1 + e^-z), an IEEE division as torch's.
        out = gated * (z / (1.0 + tl.exp(-z))) if MODE == 2 else gated * tl.math.div_rn(1.0, 1.0 + tl.exp(-z))
    return out


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, z_ptr, out_ptr,
    K, groups, per_group, stride_xt, stride_xg, stride_xr, stride_zt, stride_zg, stride_zr, stride_wg,
    eps,
    MODE: tl.constexpr, BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous_kernel(USE_PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < K
    x = _load_row(x_ptr, row, groups, per_group, stride_xt, stride_xg, stride_xr, cols, mask)
    z = x
    if MODE >= 2:
        z = _load_row(z_ptr, row, groups, per_group, stride_zt, stride_zg, stride_zr, cols, mask)
    # The weight of the row's group (stride_wg = K: one weight row per group; 0: one for all rows).
    group = (tl.cast(row, tl.int64) // per_group) % groups
    out = rms_norm_row(x, w_ptr + group * stride_wg, z, out_ptr, K, cols, mask, eps, MODE)
    tl.store(out_ptr + tl.cast(row, tl.int64) * K + cols, tl.cast(out, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _quantize_fp8_rows_kernel(
    x_ptr, z_ptr, q_ptr, scale_ptr, K, groups, per_group, stride_xt, stride_xg, stride_xr,
    z_head_dim, stride_zt, stride_zh,
    FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, SIGMOID_GATED: tl.constexpr, BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous_kernel(USE_PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < K
    x = _load_row(x_ptr, row, groups, per_group, stride_xt, stride_xg, stride_xr, cols, mask)
    if SIGMOID_GATED:
        # Row `row` of x [T, K] times sigmoid of the gate [T, H, D] (H * D = K, a strided view), rounded as
        # torch rounds x * torch.sigmoid(z) in x's dtype: the sigmoid, then the product.
        dtype = x_ptr.dtype.element_ty
        heads, dims = cols // z_head_dim, cols % z_head_dim
        z_offset = tl.cast(row, tl.int64) * stride_zt + heads * stride_zh + dims
        z = tl.cast(tl.load(z_ptr + z_offset, mask=mask, other=0.0), tl.float32)
        sigmoid = tl.cast(tl.cast(tl.math.div_rn(1.0, 1.0 + tl.exp(-z)), dtype), tl.float32)
        x = tl.cast(tl.cast(x * sigmoid, dtype), tl.float32)
    q, scale = fp8_row(x, tl.max(tl.abs(x), axis=0), q_ptr, FP8_MAX, MIN_SCALE)
    tl.store(q_ptr + tl.cast(row, tl.int64) * K + cols, q, mask=mask)
    tl.store(scale_ptr + row, scale)


@triton.jit
def rounded(x, dtype):
    """x rounded to `dtype` (as torch stores an op's result), back in fp32."""
    return tl.cast(tl.cast(x, dtype), tl.float32)


@triton.jit
def fp8_row(x, amax, q_ptr, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    """(e4m3 codes in q_ptr's dtype, fp32 scale) of the fp32 values x whose absolute maximum is amax:
    `ops.fp8.quantize_fp8`'s per-row values. Every kernel that quantizes a row goes through here."""
    # IEEE-rounded divisions (Triton's `/` is approximate on the GPU): the same scale and values as torch.
    scale = tl.maximum(tl.math.div_rn(amax, FP8_MAX), MIN_SCALE)
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX), FP8_MAX)
    return tl.cast(q, q_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), scale


class _Rows(NamedTuple):
    """A tensor's rows as `_load_row` walks them: x[t, g, r] for R = groups * per_group * T rows."""

    count: int
    groups: int
    per_group: int
    strides: tuple[int, int, int]  # of t, g and r


def _rows(x: torch.Tensor) -> _Rows:
    """The rows of a [R, K], [T, H, K] or [T, G, R, K] tensor with unit stride on K."""
    if x.dim() == 2:
        return _Rows(x.shape[0], 1, 1, (x.stride(0), 0, 0))
    if x.dim() == 3:
        return _Rows(x.shape[0] * x.shape[1], x.shape[1], 1, (x.stride(0), x.stride(1), 0))
    if x.dim() == 4:
        count = x.shape[0] * x.shape[1] * x.shape[2]
        return _Rows(count, x.shape[1], x.shape[2], (x.stride(0), x.stride(1), x.stride(2)))
    raise ValueError(f"expected [R, K], [T, H, K] or [T, G, R, K], got {tuple(x.shape)}")


def supports(x: torch.Tensor) -> bool:
    """Whether these kernels take x: 2-D to 4-D, unit stride on the last dim, a row of at most MAX_ROW."""
    return x.dim() in (2, 3, 4) and x.stride(-1) == 1 and 0 < x.shape[-1] <= MAX_ROW


def rms_norm_rows(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    mode: int,
    gate: torch.Tensor | None = None,
    weight_per_group: bool = False,
) -> torch.Tensor:
    """RMSNorm of every row of x (variant `mode`; GATED multiplies by silu(gate), SIGMOID_GATED by
    sigmoid(gate), gate shaped like x, strides of its own). One weight [K] for every row, or with
    `weight_per_group` and x [T, G, K] one per group: weight [G * K], row g of it for x[:, g]
    (Qwen3.8-Flash-Next's per-stream norms, layers/grouped_norm.py).
    Returns a contiguous tensor of x's shape and dtype."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = _rows(x)
    if rows.count == 0:
        return out
    z = gate if gate is not None else x
    key = x.shape[-1]
    if weight_per_group and (x.dim() != 3 or weight.numel() != x.shape[1] * key):
        raise ValueError(f"a weight per group needs x [T, G, K] and weight [G * K], got {tuple(x.shape)} "
                         f"and {tuple(weight.shape)}")  # fmt: skip
    _rms_norm_kernel[(rows.count,)](
        x, weight, z, out, key, rows.groups, rows.per_group, *rows.strides, *_rows(z).strides,
        key if weight_per_group else 0, eps, MODE=mode, BLOCK=triton.next_power_of_2(key), **launch_options(),
    )  # fmt: skip
    return out


@triton.jit
def _dot_rows_kernel(
    a_ptr, b_ptr, out_ptr, K, stride_a, stride_b, BLOCK: tl.constexpr, USE_PDL: tl.constexpr
):
    wait_for_previous_kernel(USE_PDL)
    row = tl.cast(tl.program_id(0), tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < K
    a = tl.load(a_ptr + row * stride_a + cols, mask=mask, other=0.0)
    b = tl.load(b_ptr + row * stride_b + cols, mask=mask, other=0.0)
    # torch's (a * b).sum(-1): the products rounded to the inputs' dtype, summed in fp32, rounded once.
    products = tl.cast(tl.cast(tl.cast(a, tl.float32) * tl.cast(b, tl.float32), a.dtype), tl.float32)
    tl.store(out_ptr + row, tl.cast(tl.sum(products, axis=0), out_ptr.dtype.element_ty))


def dot_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(a * b).sum(-1) of rows a, b [R, K] (unit stride on K, one dtype), [R] in their dtype: one program
    per row summing its K in one fixed order, so a row's bits never depend on R (torch's reduction picks
    its split of K by the number of rows)."""
    if a.shape != b.shape or a.dim() != 2 or a.dtype != b.dtype:
        raise ValueError(f"dot_rows takes two [R, K] tensors of one dtype, got {tuple(a.shape)} {a.dtype} "
                         f"and {tuple(b.shape)} {b.dtype}")  # fmt: skip
    out = torch.empty(a.shape[0], dtype=a.dtype, device=a.device)
    if a.shape[0]:
        _dot_rows_kernel[(a.shape[0],)](
            a, b, out, a.shape[1], a.stride(0), b.stride(0), BLOCK=triton.next_power_of_2(a.shape[1]),
            **launch_options(),
        )  # fmt: skip
    return out


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, K] -> (e4m3 [R, K], fp32 scale [R]), the values of `ops.fp8.quantize_fp8(x, per_row=True)`."""
    return _quantize(x, None)


def quantize_fp8_sigmoid_gated_rows(x: torch.Tensor, gate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H, D] contiguous times sigmoid(gate [T, H, D], unit stride on D), each token's row of H * D
    quantized: (e4m3 [T, H * D], fp32 scale [T]), the values of `ops.fp8.quantize_fp8_sigmoid_gated` up
    to the sigmoid's rounding (see there)."""
    if not (x.is_contiguous() and gate.shape == x.shape and gate.stride(-1) == 1):
        raise ValueError(f"expected x contiguous and a gate of its shape {tuple(x.shape)}, unit stride on D")
    return _quantize(x.view(x.shape[0], -1), gate)


def _quantize(x: torch.Tensor, gate: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    rows = _rows(x)
    q = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    if rows.count == 0:
        return q, scale
    key = x.shape[-1]
    z, z_head_dim, stride_zt, stride_zh = (
        (x, 1, 0, 0) if gate is None else (gate, gate.shape[-1], *gate.stride()[:2])
    )
    _quantize_fp8_rows_kernel[(rows.count,)](
        x, z, q, scale, key, rows.groups, rows.per_group, *rows.strides, z_head_dim, stride_zt, stride_zh,
        FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE, SIGMOID_GATED=gate is not None,
        BLOCK=triton.next_power_of_2(key), **launch_options(),
    )  # fmt: skip
    return q, scale
