"""What a hybrid (attention + Gated DeltaNet) model needs from whoever holds its cache.

Full-attention layers use `attend` exactly as dense models do (`AttentionBackend`), addressed by their
*attention ordinal* (0 .. number of full-attention layers - 1), not their layer index. Linear-attention
layers keep per-sequence state instead of per-token K/V: they read it at the start of the step and
write it back at the end, addressed by component name ("conv", "recurrent") and *linear ordinal*.

The batch of one forward is several sequences' new tokens concatenated in order: `query_ranges[n]` is
(start, length) of sequence n in the flat token axis, the ranges tile 0..T without gaps, and the state
tensors are stacked in the same sequence order.

Two ways to reach the state: `read_state`/`write_state` (gather and scatter whole states: the reference
path on CPU), or `state_pool` + `state_indices` for kernels that read and update each sequence's slot in
place (the CUDA path). `cu_seqlens`, `state_indices` and `decode_only` are fixed for the whole forward
and live on the model's device, so a captured CUDA graph replays them without host work.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from morion.layers.attention import AttentionBackend

# Chunks of at most this many new tokens per sequence are "short": the engine runs them (a prompt's tail
# after its last page boundary) in forwards of their own, where every layer computes each sequence the
# same way in any batch (Gated DeltaNet token by token, attention through the split-KV kernels, whose
# query limit this equals: ops/paged_attention_triton.MAX_SPLIT_QUERY_LEN). Longer chunks are prefill.
SHORT_CHUNK_TOKENS = 16


class HybridBackend(AttentionBackend, Protocol):
    @property
    def query_ranges(self) -> Sequence[tuple[int, int]]:
        """(start, length) of each sequence's new tokens in the flat batch, in batch order."""
        ...

    def read_state(self, component: str, linear_ordinal: int) -> torch.Tensor:
        """[num_sequences, *component shape]: each sequence's state before this step's tokens.

        A new sequence's state is all zeros. The result is the layer's to consume; changing it in
        place does not update the cache: `write_state` does.
        """
        ...

    def write_state(self, component: str, linear_ordinal: int, value: torch.Tensor) -> None:
        """Stores [num_sequences, *component shape]: each sequence's state after this step's tokens."""
        ...

    @property
    def decode_only(self) -> bool:
        """Every sequence has exactly one new token this step."""
        ...

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """[num_sequences + 1] int32 on the model's device: 0, end of sequence 0, end of sequence 1, ..."""
        ...

    @property
    def state_indices(self) -> torch.Tensor:
        """[num_sequences] int32 on the model's device: each sequence's row in `state_pool`."""
        ...

    def state_pool(self, component: str, linear_ordinal: int) -> torch.Tensor:
        """[num_slots, *component shape]: the storage itself. Kernels read row `state_indices[n]` before
        sequence n's tokens and leave it holding the state after them (in place)."""
        ...

    def outside_graph(self, op: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
        """`op(self, *inputs)`: the part of a layer that reads the batch's sequence layout or updates
        cache memory through it (Gated DeltaNet's conv and delta rule; QSA's cache writes and attention;
        PLE's n-gram fetch, host work included, and conv). Every input and the result have the batch's
        tokens as their first dimension. A piecewise prefill graph (runner/piecewise_graph.py) runs it
        eagerly between its captured pieces, with the live batch's metadata and its tokens' rows of the
        inputs; its result is valid until the next call, and `op` may read from the backend only what it
        is given as `self` (never a backend it closed over)."""
        ...

    @property
    def verify_slots(self) -> torch.Tensor | None:
        """None, except in a speculative verify forward: then [num_sequences, n] int32 on the model's
        device, every sequence having exactly n new tokens, and a linear layer leaves the state after its
        token t in slot `verify_slots[b, t]` (column 0 is the working slot, `state_indices`)."""
        ...
