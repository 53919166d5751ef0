"""Attention over K/V kept in a paged pool, for a flat batch of sequences: storing K/V and the pure-torch
reference. The Triton kernels with the same contract live in `paged_attention_triton.py`.

Memory layout (fixed by the engine): one attention layer's K/V is `kv_layer [num_token_slots, 2, Hkv, D]`,
a flat token-major pool in which token slot `page * page_size + offset` holds K at index 0 of dim 1 and V
at index 1. The dtype is bf16 / fp16 / fp32, or `torch.float8_e4m3fn` with per-layer scalar scales
(stored value = real value / scale). The scales belong to FP8 pools only: every function here ignores
them for other dtypes, so storing and attending always agree.

Batch description shared by the reference and the kernels:
- `q [T, Hq, D]`: the query rows of all sequences, concatenated;
- `cu_seqlens_q [B+1] int32`: sequence b owns rows cu[b]:cu[b+1] (possibly none);
- `seq_lens [B] int32`: keys of sequence b, INCLUDING this step's new tokens (already stored);
- `page_table [B, max_pages] int32`: page ids of each sequence in order (entries past its last page are
  arbitrary and never read).
Query row i of sequence b sits at position seq_lens[b] - qlen_b + i and attends causally to keys
0..that position. Grouped-query attention when Hq is a multiple of Hkv.
"""

from __future__ import annotations

import torch

from morion.ops.attention import causal_attention_reference
from morion.ops.fp8 import FP8_MAX

FP8_KV_DTYPE = torch.float8_e4m3fn


def store_kv(
    kv_layer: torch.Tensor,
    out_slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Writes k, v [T, Hkv, D] into kv_layer [num_token_slots, 2, Hkv, D] at the flat token slots
    out_slots [T] (int64). FP8 pools store value / scale, clamped to the e4m3 range; other pools ignore
    the scales. No host sync, so it can be captured in a CUDA graph: on CUDA one Triton kernel
    (ops/store_kv_triton.py, the same bits), elsewhere `store_kv_reference`."""
    if kv_layer.is_cuda:
        from morion.ops import store_kv_triton

        if store_kv_triton.supports(kv_layer, k, v):
            fp8 = kv_layer.dtype == FP8_KV_DTYPE
            store_kv_triton.store_kv_(kv_layer, out_slots, k, v, fp8, k_scale, v_scale)
            return
    store_kv_reference(kv_layer, out_slots, k, v, k_scale, v_scale)


def store_kv_reference(
    kv_layer: torch.Tensor,
    out_slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """`store_kv` in torch ops."""
    if kv_layer.dtype == FP8_KV_DTYPE:
        # Clamped: casting anything past the largest finite e4m3fn value gives NaN.
        k = (k.float() / k_scale).clamp(-FP8_MAX, FP8_MAX)
        v = (v.float() / v_scale).clamp(-FP8_MAX, FP8_MAX)
        kv = torch.stack((k, v), dim=1).to(FP8_KV_DTYPE)
        # Through byte views: index_put is defined for uint8 everywhere, not for fp8 on every backend.
        kv_layer.view(torch.uint8)[out_slots] = kv.view(torch.uint8)
    else:
        kv_layer[out_slots] = torch.stack((k, v), dim=1).to(kv_layer.dtype)


def gather_kv(
    kv_layer: torch.Tensor,
    page_row: torch.Tensor,
    num_keys: int,
    page_size: int,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `num_keys` keys and values [num_keys, Hkv, D] of one sequence whose pages are
    page_row [max_pages], dequantized to fp32 (the scales apply to FP8 pools only)."""
    positions = torch.arange(num_keys, device=kv_layer.device)
    slots = page_row.to(kv_layer.device).long()[positions // page_size] * page_size + positions % page_size
    if kv_layer.dtype != FP8_KV_DTYPE:
        kv = kv_layer[slots].float()
        return kv[:, 0], kv[:, 1]
    kv = kv_layer.view(torch.uint8)[slots].view(FP8_KV_DTYPE).float()
    return kv[:, 0] * k_scale, kv[:, 1] * v_scale


def paged_attention_reference(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Paged causal attention, one sequence at a time (see the module docstring for the batch layout).

    q [T, Hq, D]; kv_layer [num_token_slots, 2, Hkv, D]; page_table [B, max_pages]; cu_seqlens_q [B+1];
    seq_lens [B]. Computes in fp32 and returns [T, Hq, D] in q's dtype; rows outside
    cu_seqlens_q[0]:cu_seqlens_q[B] are zero. Syncs with the device (reads the lengths on the host).
    """
    out = torch.zeros_like(q)
    bounds = cu_seqlens_q.tolist()
    lengths = seq_lens.tolist()
    for b, num_keys in enumerate(lengths):
        start, end = bounds[b], bounds[b + 1]
        if end == start:
            continue
        if end - start > num_keys:
            raise ValueError(f"sequence {b} has {end - start} query rows but only {num_keys} keys")
        k, v = gather_kv(kv_layer, page_table[b], num_keys, page_size, k_scale, v_scale)
        attended = causal_attention_reference(q[start:end].float(), k, v, num_keys - (end - start), scale)
        out[start:end] = attended.to(q.dtype)
    return out
