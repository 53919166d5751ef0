"""Attention over K/V kept in a paged pool, for a flat batch of sequences: the pure-torch reference."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from morion.ops.attention import causal_attention_reference


def store_kv(kv_layer: torch.Tensor, token_slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """kv_layer: [pool_tokens, 2, Hkv, D]; writes k, v [T, Hkv, D] at the flat `token_slots` [T]."""
    kv_layer[token_slots] = torch.stack((k, v), dim=1).to(kv_layer.dtype)


def paged_attention_reference(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    query_ranges: Sequence[tuple[int, int]],
    kv_slots: Sequence[torch.Tensor],
    scale: float,
) -> torch.Tensor:
    """q: [T, Hq, D], sequences concatenated; sequence i owns q rows query_ranges[i] = (start, length)
    and its keys are kv_layer[kv_slots[i]] (all positions up to its last query, in order)."""
    out = torch.empty_like(q)
    for (start, length), slots in zip(query_ranges, kv_slots, strict=True):
        kv = kv_layer[slots].to(q.dtype)
        num_keys = kv.shape[0]
        out[start : start + length] = causal_attention_reference(
            q[start : start + length], kv[:, 0], kv[:, 1], num_keys - length, scale
        )
    return out
