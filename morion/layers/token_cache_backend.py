"""What a layer that keeps its own per-token data needs from the cache, beyond `attend`.

Qwen Sparse Attention (QSA) does not attend to every cached token: it caches raw index keys per token
next to K/V (a side cache: a token component of the `CacheSpec`, paged with K/V), reads the whole
sequence's keys to choose which tokens each query sees, and attends to those tokens' K/V only. So it
writes and reads the page pool itself, through these methods, instead of calling `attend`.

Addressing: a token component's layers by `ordinal` (0 .. component's num_layers - 1); K/V by attention
`layer_index`, as `attend`. Sequence `seq_index` is the n-th entry of `query_ranges`; its tokens are
0 .. seq_len - 1, this step's new ones last (positions == token indices). Reads see this step's writes,
so a layer writes first, then reads.
"""

from __future__ import annotations

from typing import Protocol

import torch

from morion.layers.hybrid_backend import HybridBackend


class TokenCacheBackend(HybridBackend, Protocol):
    def write_tokens(self, component: str, ordinal: int, values: torch.Tensor) -> None:
        """Stores values [T, *token_shape] for this step's T new tokens (flat batch order), cast to the
        component's dtype (no scaling: side caches are stored as they are computed)."""
        ...

    def read_sequence_tokens(self, component: str, ordinal: int, seq_index: int) -> torch.Tensor:
        """[seq_len, *token_shape]: every token of sequence `seq_index`, this step's included, in the
        component's dtype. The result is a copy: changing it does not change the cache."""
        ...

    def write_kv(self, layer_index: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Stores this step's k, v [T, Hkv, D] for attention layer `layer_index` (quantized as `attend`
        stores them: an FP8 pool keeps value / scale)."""
        ...

    def read_sequence_kv(
        self, layer_index: int, seq_index: int, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [N, Hkv, D] in fp32 (dequantized when the pool is FP8) of sequence `seq_index` at token
        positions [N] (int64, each < seq_len, this step's tokens included)."""
        ...
