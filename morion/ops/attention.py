"""Causal self-attention over a sequence's cached keys and values: the pure-torch reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, scale: float
) -> torch.Tensor:
    """One sequence. q: [Tq, Hq, D] at positions q_start..q_start+Tq-1; k, v: [Tk, Hkv, D] at 0..Tk-1.

    Query i attends to keys 0..q_start+i. Grouped-query attention when Hq is a multiple of Hkv.
    """
    num_queries, num_keys = q.shape[0], k.shape[0]
    if q_start + num_queries != num_keys:
        raise ValueError(f"queries end at {q_start + num_queries} but {num_keys} keys are cached")
    mask = None
    if num_queries > 1:
        query_positions = torch.arange(q_start, num_keys, device=q.device)[:, None]
        mask = torch.arange(num_keys, device=q.device)[None, :] <= query_positions
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        attn_mask=mask,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out.transpose(0, 1)
