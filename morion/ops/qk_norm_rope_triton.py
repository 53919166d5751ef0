"""Gated attention's q/k heads in one Triton kernel: zero-centred RMSNorm of every query and key head, then
partial RoPE (rotate-half layout) on its first `rotary_dim` dims.

Eagerly that is two norm kernels and ~16 elementwise kernels per layer (cos/sin casts, products, negation,
concatenations, for q and for k). The reference is that eager sequence (`ZeroCentredRMSNorm` then
`layers/rotary.apply_rotary`, run by `layers/gated_attention.py` everywhere but CUDA), and this kernel
keeps its rounding points: the norm in fp32 rounded once to the model dtype, cos and sin rounded to the
model dtype, each product and the sum rounded to it. A head's partner dims (i + r/2 for the first half of
the rotated dims, i - r/2 for the second) are normed a second time from their own inputs, with the same
operations, so they carry the very bits of the normed head.

mRoPE and YaRN need nothing here: both live in the cos/sin rows the rotary embedding computes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from morion.ops.pdl import launch_options, wait_for_previous_kernel

MAX_HEAD_DIM = 1024


@triton.jit
def _norm_rope_head(
    src_ptr, w_ptr, cos_ptr, sin_ptr, dst_ptr, head_dim, rotary_dim, eps, BLOCK: tl.constexpr
):  # fmt: skip
    """One head: src [head_dim] (unit stride) normed and rotated into dst, cos/sin [rotary_dim] rows."""
    cols = tl.arange(0, BLOCK)
    mask = cols < head_dim
    out_dtype = dst_ptr.dtype.element_ty
    x = tl.cast(tl.load(src_ptr + cols, mask=mask, other=0.0), tl.float32)
    # As the row kernel (ops/row_kernels_triton.py, mode ZERO_CENTRED): the same expression, so the
    # same inverse RMS.
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / head_dim + eps)
    w = tl.cast(tl.load(w_ptr + cols, mask=mask, other=0.0), tl.float32)
    normed = tl.cast(tl.cast(x * inv_rms * (1.0 + w), out_dtype), tl.float32)

    half = rotary_dim // 2
    rotated = cols < rotary_dim
    partner = tl.where(cols < half, cols + half, cols - half)
    partner_mask = rotated & mask
    x_partner = tl.cast(tl.load(src_ptr + partner, mask=partner_mask, other=0.0), tl.float32)
    w_partner = tl.cast(tl.load(w_ptr + partner, mask=partner_mask, other=0.0), tl.float32)
    normed_partner = tl.cast(tl.cast(x_partner * inv_rms * (1.0 + w_partner), out_dtype), tl.float32)
    # rotate_half: (-second half, first half); negation is exact
    turned = tl.where(cols < half, -normed_partner, normed_partner)
    cos = tl.cast(tl.cast(tl.load(cos_ptr + cols, mask=partner_mask, other=0.0), out_dtype), tl.float32)
    sin = tl.cast(tl.cast(tl.load(sin_ptr + cols, mask=partner_mask, other=0.0), out_dtype), tl.float32)
    by_cos = tl.cast(tl.cast(normed * cos, out_dtype), tl.float32)
    by_sin = tl.cast(tl.cast(turned * sin, out_dtype), tl.float32)
    out = tl.where(rotated, by_cos + by_sin, normed)
    tl.store(dst_ptr + cols, tl.cast(out, out_dtype), mask=mask)


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr, k_ptr, q_w_ptr, k_w_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cos, stride_sin,
    num_q_heads, num_k_heads, head_dim, rotary_dim, eps,
    BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous_kernel(USE_PDL)
    # One program per (token, head), the query heads first: a head's result depends on its own row only.
    token = tl.cast(tl.program_id(0), tl.int64)
    head = tl.program_id(1)
    cos_row = cos_ptr + token * stride_cos
    sin_row = sin_ptr + token * stride_sin
    if head < num_q_heads:
        src = q_ptr + token * stride_qt + head * stride_qh
        dst = q_out_ptr + (token * num_q_heads + head) * head_dim
        _norm_rope_head(src, q_w_ptr, cos_row, sin_row, dst, head_dim, rotary_dim, eps, BLOCK)
    else:
        kv_head = head - num_q_heads
        src = k_ptr + token * stride_kt + kv_head * stride_kh
        dst = k_out_ptr + (token * num_k_heads + kv_head) * head_dim
        _norm_rope_head(src, k_w_ptr, cos_row, sin_row, dst, head_dim, rotary_dim, eps, BLOCK)


def supports(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether the kernel takes these: q [T, H, D] and k [T, Hkv, D] with unit stride on D (views of wider
    projections are fine), cos/sin [T, r] rows with unit stride, r even and at most D, D <= MAX_HEAD_DIM."""
    if q.dim() != 3 or k.dim() != 3 or cos.dim() != 2:
        return False
    tokens, _, head_dim = q.shape
    rotary_dim = cos.shape[-1]
    return (
        k.shape[0] == tokens
        and k.shape[2] == head_dim
        and 0 < head_dim <= MAX_HEAD_DIM
        and q.stride(-1) == 1
        and k.stride(-1) == 1
        and cos.shape == sin.shape == (tokens, rotary_dim)
        and cos.stride(-1) == 1
        and sin.stride(-1) == 1
        and rotary_dim % 2 == 0
        and 0 < rotary_dim <= head_dim
    )


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D], k [T, Hkv, D] (see `supports`), zero-centred norm weights [D] (applied as 1 + w),
    cos/sin [T, r] fp32: contiguous normed and rotated q and k in their dtypes."""
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    if tokens == 0:
        return q_out, k_out
    _qk_norm_rope_kernel[(tokens, num_q_heads + num_k_heads)](
        q, k, q_weight, k_weight, cos, sin, q_out, k_out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
        num_q_heads, num_k_heads, head_dim, cos.shape[-1], eps,
        BLOCK=triton.next_power_of_2(head_dim),
        # fp32 heads: no fused multiply-add of a product into the rotary's sum (torch rounds both
        # products); the sum of squares may then round differently from the row kernel's in its last bit.
        # In half dtypes each product is rounded to the dtype before the sum, so there is nothing to fuse,
        # and the sum of squares compiles as the row kernel's does (the same expression and block).
        enable_fp_fusion=q.dtype != torch.float32, **launch_options(),
    )  # fmt: skip
    return q_out, k_out


def norm_rope(
    x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """`qk_norm_rope` for one set of heads x [T, H, D] (QSA's index queries; `supports(x, x, cos, sin)`):
    the kernel's query heads alone, no key heads."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    tokens, heads, head_dim = x.shape
    if tokens == 0:
        return out
    _qk_norm_rope_kernel[(tokens, heads)](
        x, x, weight, weight, cos, sin, out, out,
        x.stride(0), x.stride(1), x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
        heads, 0, head_dim, cos.shape[-1], eps,
        BLOCK=triton.next_power_of_2(head_dim), enable_fp_fusion=x.dtype != torch.float32,
        **launch_options(),
    )  # fmt: skip
    return out
