"""Qwen Sparse Attention (QSA): Qwen3.8-Flash-Next's full-attention layers.

The attention itself is Qwen3-Next's gated attention (q_proj yields per-head query | gate halves,
zero-centred q/k norms, partial RoPE, sigmoid(gate) on the output); what differs is which tokens a query
sees. An indexer (`index_qk_proj`: H index query heads and one raw key of dim Di per token) scores blocks
of `compress_ratio` cached tokens and each query attends only to its `budget` best-scoring tokens' blocks
plus the unfinished block's tail (ops/qsa.py has the rule). Below budget + ratio - 1 tokens every block
is selected and QSA is ordinary causal attention.

Cache: K/V as for any attention layer, and the raw index keys (un-normed, un-rotated) per token in the
side cache `INDEX_KEYS`, paged with K/V. Each step the layer writes both for its new tokens, then per
sequence reads all raw keys back, pools the complete blocks (k_norm of the mean, rotated at the block's
first position), selects, and gathers only the selected tokens' K/V (`TokenCacheBackend`).

Cost of this reference: per step and sequence, O(L * Di) to pool every block again and O(rows * blocks)
scores, plus a host sync per sequence; K/V reads are bounded by the selection. Caching pooled keys per
block (as vLLM and sglang do) and a sparse attention kernel are the fast path still to build.
"""

from __future__ import annotations

import torch
from torch import nn

from morion.layers.norm_variants import ZeroCentredRMSNorm
from morion.layers.rotary import RotaryEmbedding, apply_rotary
from morion.layers.token_cache_backend import TokenCacheBackend
from morion.ops.qsa import block_scores, pool_blocks, select_tokens, sparse_attention

INDEX_KEYS = "qsa_index_keys"  # the token component holding each token's raw index key [Di]


class QSAIndexer(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, rms_norm_eps: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        # Rows: num_heads query heads, then the single key head (QSA's indexer is MQA).
        self.index_qk_proj = nn.Linear(hidden_size, (num_heads + 1) * head_dim, bias=False)
        self.q_layernorm = ZeroCentredRMSNorm(head_dim, rms_norm_eps)
        self.k_layernorm = ZeroCentredRMSNorm(head_dim, rms_norm_eps)

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(index queries [T, H, Di], normed and rotated; raw keys [T, Di], as cached)."""
        tokens = x.shape[0]
        q, raw_keys = (
            self.index_qk_proj(x)
            .view(tokens, self.num_heads + 1, self.head_dim)
            .split([self.num_heads, 1], dim=1)
        )
        return apply_rotary(self.q_layernorm(q), cos, sin), raw_keys[:, 0]

    def block_keys(self, raw_keys: torch.Tensor, ratio: int, rotary: RotaryEmbedding) -> torch.Tensor:
        """Keys [L // ratio, Di] of a sequence's complete blocks, from its raw keys [L, Di]."""
        pooled = self.k_layernorm(pool_blocks(raw_keys, ratio))
        starts = torch.arange(pooled.shape[0], device=raw_keys.device) * ratio
        cos, sin = rotary(starts)
        return apply_rotary(pooled[:, None], cos, sin)[:, 0]


class QSAAttention(nn.Module):
    def __init__(
        self,
        attention_ordinal: int,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rms_norm_eps: float,
        bias: bool,
        index_heads: int,
        index_head_dim: int,
        budget: int,
        compress_ratio: int,
    ) -> None:
        super().__init__()
        if budget % compress_ratio:
            raise ValueError(f"QSA budget {budget} is not a multiple of the compress ratio {compress_ratio}")
        self.attention_ordinal = attention_ordinal
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.compress_ratio = compress_ratio
        self.block_topk = budget // compress_ratio
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim * 2, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias)
        self.q_norm = ZeroCentredRMSNorm(head_dim, rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(head_dim, rms_norm_eps)
        self.indexer = QSAIndexer(hidden_size, index_heads, index_head_dim, rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        rotary: RotaryEmbedding,
        backend: TokenCacheBackend,
    ) -> torch.Tensor:
        """x: [T, hidden]; cos, sin: [T, rotary_dim] at the tokens' positions; `rotary` rotates the block
        keys at theirs. Returns [T, hidden]."""
        tokens = x.shape[0]
        ordinal = self.attention_ordinal
        q, gate = self.q_proj(x).view(tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = apply_rotary(self.q_norm(q), cos, sin)
        k = apply_rotary(self.k_norm(self.k_proj(x).view(tokens, self.num_kv_heads, self.head_dim)), cos, sin)
        v = self.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        index_q, raw_keys = self.indexer.project(x, cos, sin)
        backend.write_kv(ordinal, k, v)
        backend.write_tokens(INDEX_KEYS, ordinal, raw_keys)

        out = torch.zeros_like(q)
        for n, (start, length) in enumerate(backend.query_ranges):
            if length == 0:
                continue
            rows = slice(start, start + length)
            keys = backend.read_sequence_tokens(INDEX_KEYS, ordinal, n)
            block_keys = self.indexer.block_keys(keys, self.compress_ratio, rotary)
            scores = block_scores(index_q[rows], block_keys)
            selected = select_tokens(scores, keys.shape[0] - length, self.compress_ratio, self.block_topk)
            out[rows] = sparse_attention(
                q[rows],
                selected,
                lambda positions, n=n: backend.read_sequence_kv(ordinal, n, positions),
                self.scale,
            )
        out = out.reshape(tokens, -1) * torch.sigmoid(gate.reshape(tokens, -1))
        return self.o_proj(out)
