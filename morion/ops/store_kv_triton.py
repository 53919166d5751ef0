"""K/V of a forward's new tokens into the paged pool in one kernel (`paged_attention.store_kv` on CUDA).

The torch code is about nine kernels a layer for an FP8 pool (k and v each to fp32, divided by the scale,
clamped; stacked; cast; scattered through a byte view), 96 of a decode step's kernels on the 80B preset's
12 attention layers. Here one program per (token, block of Hkv * D columns) loads its k and v, stores
value * (1 / scale) clamped to e4m3's range and rounded to nearest even (FP8 pools), or the values cast
to the pool's dtype, at the token's slot. The bits of the torch code: torch divides a CUDA tensor by a
number as a product with its fp32 reciprocal, and both casts round to nearest even. No host sync: a CUDA
graph captures it.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from morion.ops.fp8 import FP8_MAX
from morion.ops.pdl import launch_options, wait_for_previous_kernel

_BLOCK = 1024


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, slots_ptr, kv_ptr, width, stride_k, stride_v, stride_slot, stride_kv, inv_k, inv_v,
    FP8: tl.constexpr, FP8_MAX: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous_kernel(USE_PDL)
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    slot = tl.load(slots_ptr + token).to(tl.int64)
    k = tl.load(k_ptr + token * stride_k + cols, mask=mask, other=0.0)
    v = tl.load(v_ptr + token * stride_v + cols, mask=mask, other=0.0)
    dtype = kv_ptr.dtype.element_ty
    if FP8:
        k = tl.minimum(tl.maximum(tl.cast(k, tl.float32) * inv_k, -FP8_MAX), FP8_MAX)
        v = tl.minimum(tl.maximum(tl.cast(v, tl.float32) * inv_v, -FP8_MAX), FP8_MAX)
        k = tl.cast(k, dtype, fp_downcast_rounding="rtne")
        v = tl.cast(v, dtype, fp_downcast_rounding="rtne")
    else:
        k = tl.cast(k, dtype)
        v = tl.cast(v, dtype)
    row = kv_ptr + slot * stride_slot
    tl.store(row + cols, k, mask=mask)
    tl.store(row + stride_kv + cols, v, mask=mask)


def supports(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the kernel takes k, v [T, Hkv, D] into kv_layer [slots, 2, Hkv, D]: each token's Hkv * D
    values contiguous in all three."""
    width = kv_layer.shape[2] * kv_layer.shape[3]
    return all(t.dim() == 3 and t[0].is_contiguous() and t[0].numel() == width for t in (k, v)) and (
        kv_layer.stride(3) == 1 and kv_layer.stride(2) == kv_layer.shape[3]
    )


def store_kv_(
    kv_layer: torch.Tensor,
    out_slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    fp8: bool,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """`paged_attention.store_kv`'s contract for shapes `supports` takes; `fp8`: kv_layer is an e4m3 pool
    (written as e4m3 values, with the scales; ignored otherwise)."""
    tokens = k.shape[0]
    if tokens == 0:
        return
    width = k.shape[1] * k.shape[2]
    # torch's divisor for `x / scale` on CUDA: the reciprocal, computed in fp32.
    inv_k, inv_v = (float(np.float32(1.0) / np.float32(scale)) for scale in (k_scale, v_scale))
    _store_kv_kernel[(tokens, triton.cdiv(width, _BLOCK))](
        k, v, out_slots.contiguous(), kv_layer, width, k.stride(0), v.stride(0), kv_layer.stride(0),
        kv_layer.stride(1), inv_k, inv_v, FP8=fp8, FP8_MAX=FP8_MAX, BLOCK=_BLOCK,
        **launch_options(),
    )  # fmt: skip
