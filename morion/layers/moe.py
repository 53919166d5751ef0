"""Sparse mixture-of-experts block with a gated shared expert (Qwen3-Next / Qwen3-MoE family).

    probs   = softmax(router(x)) over all experts, in fp32
    top-k   = the k largest probs, renormalised to sum 1 when `norm_topk_prob`
    out     = sum_top-k p_e * expert_e(x) + sigmoid(shared_expert_gate(x)) * shared_expert(x)

Routed expert weights are stacked ([E, 2I, H] gate|up and [E, H, I] down) so a grouped GEMM can take
them whole; the loader scatters per-expert checkpoint tensors into them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from morion.layers.mlp import SwiGLU
from morion.ops.moe import moe_experts_reference


class StackedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return moe_experts_reference(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids)


class SparseMoE(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        shared_expert_intermediate_size: int,
        norm_topk_prob: bool,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k {top_k} must be between 1 and the {num_experts} experts")
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)  # the router
        self.experts = StackedExperts(num_experts, hidden_size, intermediate_size)
        self.shared_expert = SwiGLU(hidden_size, shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_weights [T, k] in x's dtype, topk_ids [T, k])."""
        logits = self.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = self.shared_expert(x)
        topk_weights, topk_ids = self.route(x)
        routed = self.experts(x, topk_weights, topk_ids)
        return routed + F.sigmoid(self.shared_expert_gate(x)) * shared
