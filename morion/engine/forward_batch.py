"""One engine step as the model sees it: a flat token batch and the paged attention backend over it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from morion.cache.page_pool import PagePool
from morion.cache.state_slots import StateSlots
from morion.ops.paged_attention import paged_attention_reference, store_kv


class ForwardBatch(NamedTuple):
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    out_slots: torch.Tensor  # [T] flat pool slot of each new token's K/V
    query_ranges: list[tuple[int, int]]  # (start, length) of each sequence in the flat batch
    kv_slots: list[torch.Tensor]  # per sequence: pool slots of all its positions up to its last query
    last_rows: list[int]  # per sequence: flat row of its last token (where logits come from)
    state_slots: torch.Tensor | None  # [num_sequences] working state slot of each (models with state)


def build_forward_batch(
    chunks: Sequence[tuple[Sequence[int], Sequence[int], int, int]],
    state_slots: Sequence[int | None],
    page_size: int,
    device: torch.device,
) -> ForwardBatch:
    """chunks: per sequence (token_ids, pages, start, num_tokens): run token_ids[start:start+num_tokens];
    state_slots: per sequence its working state slot, or None for models without state."""
    input_ids: list[int] = []
    query_ranges: list[tuple[int, int]] = []
    kv_slots: list[torch.Tensor] = []
    positions: list[torch.Tensor] = []
    out_slots: list[torch.Tensor] = []
    for token_ids, pages, start, num_tokens in chunks:
        end = start + num_tokens
        page_tensor = torch.tensor(pages, dtype=torch.long)
        all_positions = torch.arange(end)
        slots = page_tensor[all_positions // page_size] * page_size + all_positions % page_size
        query_ranges.append((len(input_ids), num_tokens))
        input_ids.extend(token_ids[start:end])
        positions.append(all_positions[start:])
        out_slots.append(slots[start:])
        kv_slots.append(slots.to(device))
    return ForwardBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
        positions=torch.cat(positions).to(device),
        out_slots=torch.cat(out_slots).to(device),
        query_ranges=query_ranges,
        kv_slots=kv_slots,
        last_rows=[start + length - 1 for start, length in query_ranges],
        state_slots=None
        if None in state_slots
        else torch.tensor(state_slots, dtype=torch.long, device=device),
    )


class PagedAttentionBackend:
    """The layers' backend over the engine's memory: attention K/V in the page pool's "kv" component,
    per-request state (the HybridBackend protocol) in the state slots."""

    def __init__(self, pool: PagePool, batch: ForwardBatch, state_slots: StateSlots | None = None) -> None:
        self._kv = pool.storage("kv")
        self._batch = batch
        self._state_slots = state_slots

    @property
    def query_ranges(self) -> list[tuple[int, int]]:
        return self._batch.query_ranges

    def read_state(self, component: str, linear_ordinal: int) -> torch.Tensor:
        return self._state(component, linear_ordinal)[self._batch.state_slots]

    def write_state(self, component: str, linear_ordinal: int, value: torch.Tensor) -> None:
        self._state(component, linear_ordinal)[self._batch.state_slots] = value

    def _state(self, component: str, linear_ordinal: int) -> torch.Tensor:
        if self._state_slots is None or self._batch.state_slots is None:
            raise RuntimeError("this model keeps per-request state but the engine gave it no state slots")
        return self._state_slots.storage(component)[linear_ordinal]

    def attend(
        self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        kv_layer = self._kv[layer_index]
        store_kv(kv_layer, self._batch.out_slots, k, v)
        return paged_attention_reference(q, kv_layer, self._batch.query_ranges, self._batch.kv_slots, scale)
