"""Qwen3-Next gated full attention.

Compared with Qwen3 attention: q_proj also yields a per-head output gate (for each head, D query dims
then D gate dims), q/k norms are zero-centred, RoPE rotates only the first `rotary_dim` dims of each
head, and the attention output is multiplied by sigmoid(gate) before o_proj.
"""

from __future__ import annotations

import torch
from torch import nn

from morion.layers.attention import AttentionBackend
from morion.layers.norm_variants import ZeroCentredRMSNorm
from morion.layers.rotary import apply_rotary


class GatedAttentionProjections(nn.Module):
    """The projections, norms and output gate of gated attention, for layers that differ in what they
    attend to: `project` gives the heads, `gate_output` finishes the attention's output."""

    def __init__(
        self,
        attention_ordinal: int,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rms_norm_eps: float,
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.attention_ordinal = attention_ordinal
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim * 2, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias)
        self.q_norm = ZeroCentredRMSNorm(head_dim, rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(head_dim, rms_norm_eps)

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [T, hidden]; cos, sin: [T, rotary_dim]. Returns q [T, H, D] and k [T, Hkv, D], normed and
        rotated, v [T, Hkv, D] and the output gate [T, H, D]."""
        tokens = x.shape[0]
        q, gate = self.q_proj(x).view(tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(x).view(tokens, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v, gate

    def gate_output(self, out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """The attention output [T, H, D] times sigmoid(gate), through o_proj: [T, hidden]."""
        tokens = out.shape[0]
        return self.o_proj(out.reshape(tokens, -1) * torch.sigmoid(gate.reshape(tokens, -1)))


class GatedAttention(GatedAttentionProjections):
    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: AttentionBackend
    ) -> torch.Tensor:
        """x: [T, hidden]; cos, sin: [T, rotary_dim]. Returns [T, hidden]."""
        q, k, v, gate = self.project(x, cos, sin)
        return self.gate_output(backend.attend(self.attention_ordinal, q, k, v, self.scale), gate)
