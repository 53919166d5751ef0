"""What a layer that keeps its own per-token data needs from the cache, beyond `attend`.

Qwen Sparse Attention (QSA) does not attend to every cached token: it caches index keys per token next to
K/V (side caches: token components of the `CacheSpec`, paged with K/V), scores blocks of the sequence to
choose which tokens each query sees, and attends to those tokens' K/V only. So it writes and reads the
page pool itself, through these methods, instead of calling `attend`.

Addressing: a token component's layers by `ordinal` (0 .. component's num_layers - 1); K/V by attention
`layer_index`, as `attend`. Sequence `seq_index` is the n-th entry of `query_ranges`; its tokens are
0 .. seq_len - 1, this step's new ones last (positions == token indices). Reads see this step's writes,
so a layer writes first, then reads.

Two ways in, as for state (`HybridBackend`): whole-sequence reads (`read_sequence_tokens`,
`read_sequence_kv`: the reference path, shapes that follow the data, host syncs), or the storage itself
with the step's paging metadata (`token_pool`, `kv_pool`, `page_table`, `out_slots`, `page_size`,
`kv_scales`): device tensors whose shapes depend only on the batch, for code that a CUDA graph captures.
Token slot of sequence b's token at position p: `page_table[b, p // page_size] * page_size + p %
page_size`; this step's new tokens are at `out_slots` (flat batch order).
"""

from __future__ import annotations

from collections.abc import Sequence
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

    # -- in place: the storage and the step's paging metadata (no host syncs) -------------------------

    @property
    def context_lens(self) -> Sequence[int]:
        """Each sequence's length with this step's tokens, on the host (no sync): for choices a layer makes
        per sequence before launching anything (QSA's prefill kernel by context). Forwards a CUDA graph
        replays have no host copy and raise."""
        ...

    @property
    def page_size(self) -> int:
        """Tokens per page."""
        ...

    @property
    def page_table(self) -> torch.Tensor:
        """[num_sequences, max_pages] int32 on the model's device: each sequence's pages in order (entries
        past its last page are arbitrary page ids: mask by length)."""
        ...

    @property
    def out_slots(self) -> torch.Tensor:
        """[T] int64 on the model's device: the flat token slot of each of this step's new tokens."""
        ...

    def token_pool(self, component: str, ordinal: int) -> torch.Tensor:
        """[num_slots, *token_shape]: the component's storage for one layer itself (writes go to the cache).
        Ready to read: restores of that (component, ordinal) are waited for."""
        ...

    def kv_pool(self, layer_index: int) -> torch.Tensor:
        """[num_slots, 2, Hkv, D]: attention layer `layer_index`'s K/V storage itself, in the pool dtype
        (FP8 pools hold value / scale, `kv_scales`). Ready to read, as `token_pool`."""
        ...

    @property
    def kv_scales(self) -> tuple[float, float]:
        """(k_scale, v_scale) of an FP8 K/V pool (real = stored * scale); 1.0 otherwise."""
        ...
