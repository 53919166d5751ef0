"""Grouped-query self-attention with optional q/k RMSNorm (Qwen3) and QKV bias (Qwen2).

The layer projects and rotates; where keys and values live and how attention is computed over them is
the attention backend's business (a single-sequence cache here, the paged pool in the engine).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from morion.layers.norm import RMSNorm
from morion.layers.rotary import apply_rotary


class AttentionBackend(Protocol):
    def attend(
        self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Stores this step's k, v [T, Hkv, D] for `layer_index` and returns attention output [T, Hq, D]."""
        ...


class SelfAttention(nn.Module):
    def __init__(
        self,
        layer_index: int,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        bias: bool,
        qk_norm_eps: float | None,
    ) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        self.q_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: AttentionBackend
    ) -> torch.Tensor:
        tokens = x.shape[0]
        q = self.q_proj(x).view(tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = backend.attend(self.layer_index, q, k, v, self.scale)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))
