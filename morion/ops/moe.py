"""Routed mixture-of-experts feed-forward over stacked expert weights: the pure-torch reference.

Expert e is SwiGLU: down_e(silu(gate_e(x)) * up_e(x)), with gate_e and up_e stacked as one matrix
`gate_up_proj[e]` ([2I, H]: the gate rows first) and `down_proj[e]` ([H, I]). This is the layout grouped-GEMM
kernels consume, and the one transformers keeps in memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def moe_experts_reference(
    hidden: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """hidden [T, H]; gate_up_proj [E, 2I, H]; down_proj [E, H, I]; topk_weights, topk_ids [T, k].

    Returns sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden[t]) as [T, H] in hidden's dtype.
    """
    out = torch.zeros_like(hidden)
    for expert in torch.unique(topk_ids).tolist():
        tokens, slot = torch.where(topk_ids == expert)
        gate, up = F.linear(hidden[tokens], gate_up_proj[expert]).chunk(2, dim=-1)
        expert_out = F.linear(F.silu(gate) * up, down_proj[expert])
        out.index_add_(0, tokens, expert_out * topk_weights[tokens, slot, None])
    return out
