"""A contiguous K/V cache for exactly one sequence: the backend of single-request generation."""

from __future__ import annotations

import torch

from morion.ops.attention import causal_attention_reference


class SequenceKVCache:
    """K/V for every attention layer of one sequence, preallocated for `max_tokens` positions.

    Protocol per forward: `begin(n)` reserves n new positions, every layer calls `attend` once (writing
    its n keys/values at the same offset), then `commit()` makes them part of the cached prefix.
    """

    def __init__(
        self,
        num_layers: int,
        max_tokens: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_layers, max_tokens, num_kv_heads, head_dim)
        self.keys = torch.empty(shape, dtype=dtype, device=device)
        self.values = torch.empty(shape, dtype=dtype, device=device)
        self.max_tokens = max_tokens
        self.num_cached = 0
        self._num_pending = 0

    def begin(self, num_new_tokens: int) -> None:
        if self.num_cached + num_new_tokens > self.max_tokens:
            raise ValueError(
                f"sequence of {self.num_cached + num_new_tokens} tokens exceeds the cache's {self.max_tokens}"
            )
        self._num_pending = num_new_tokens

    def attend(
        self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        start, end = self.num_cached, self.num_cached + self._num_pending
        self.keys[layer_index, start:end] = k
        self.values[layer_index, start:end] = v
        return causal_attention_reference(
            q, self.keys[layer_index, :end], self.values[layer_index, :end], start, scale
        )

    def commit(self) -> None:
        self.num_cached += self._num_pending
        self._num_pending = 0
