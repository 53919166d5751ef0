"""One engine step as the model sees it: a flat token batch, its paging metadata as device tensors, and
the backend that gives the layers the engine's memory (K/V pages and state slots)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from morion.cache.page_pool import PagePool
from morion.cache.state_slots import StateSlots
from morion.engine.host_to_device import to_device
from morion.ops.paged_attention import FP8_KV_DTYPE, paged_attention_reference, store_kv


class ForwardBatch(NamedTuple):
    """Host lists describe the batch for Python code; the tensors (on the model's device) are what kernels
    read. Sequence b owns the flat rows cu_seqlens_q[b]:cu_seqlens_q[b+1]; its keys are seq_lens[b]
    positions (this step's tokens included) whose pages are page_table[b, :ceil(seq_lens[b] / page)]."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_slots: torch.Tensor  # [T] int64: flat pool token slot of each new token's K/V
    page_table: torch.Tensor  # [B, max pages] int32
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    state_indices: torch.Tensor | None  # [B] int32 working state slot of each sequence (models with state)
    max_query_len: int
    query_ranges: list[tuple[int, int]]  # (start, length) of each sequence in the flat batch
    last_rows: list[int]  # per sequence: flat row of its last token (where logits come from)

    @property
    def decode_only(self) -> bool:
        return self.max_query_len == 1


def build_forward_batch(
    chunks: Sequence[tuple[Sequence[int], Sequence[int], int, int]],
    state_slots: Sequence[int | None],
    page_size: int,
    device: torch.device,
) -> ForwardBatch:
    """chunks: per sequence (token_ids, pages, start, num_tokens): run token_ids[start:start+num_tokens];
    state_slots: per sequence its working state slot, or None for models without state. The metadata is
    assembled in numpy and reaches the device in one copy (engine/host_to_device.py)."""
    input_ids: list[np.ndarray] = []
    positions: list[np.ndarray] = []
    out_slots: list[np.ndarray] = []
    query_ranges: list[tuple[int, int]] = []
    used_pages: list[Sequence[int]] = []
    rows = 0
    for token_ids, pages, start, num_tokens in chunks:
        end = start + num_tokens
        used = pages[: -(-end // page_size)]
        new_positions = np.arange(start, end, dtype=np.int64)
        page_of_token = np.asarray(used, dtype=np.int64)[new_positions // page_size]
        query_ranges.append((rows, num_tokens))
        rows += num_tokens
        input_ids.append(np.asarray(token_ids[start:end], dtype=np.int64))
        positions.append(new_positions)
        out_slots.append(page_of_token * page_size + new_positions % page_size)
        used_pages.append(used)
    lengths = [length for _, length in query_ranges]
    host = [
        np.concatenate(input_ids),
        np.concatenate(positions),
        np.concatenate(out_slots),
        page_table_array(used_pages),
        np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32),
        np.asarray([start + length for (_, _, start, length) in chunks], dtype=np.int32),
    ]
    if None not in state_slots:
        host.append(np.asarray(state_slots, dtype=np.int32))
    tensors = to_device(host, device)
    return ForwardBatch(
        input_ids=tensors[0],
        positions=tensors[1],
        out_slots=tensors[2],
        page_table=tensors[3],
        cu_seqlens_q=tensors[4],
        seq_lens=tensors[5],
        state_indices=tensors[6] if len(tensors) > 6 else None,
        max_query_len=max(lengths),
        query_ranges=query_ranges,
        last_rows=[start + length - 1 for start, length in query_ranges],
    )


def page_table_array(pages: Sequence[Sequence[int]]) -> np.ndarray:
    """[B, max pages] int32: row b lists sequence b's pages, zero-padded."""
    table = np.zeros((len(pages), max(len(p) for p in pages)), dtype=np.int32)
    for row, used in enumerate(pages):
        table[row, : len(used)] = used
    return table


class KVScales(NamedTuple):
    """Per-layer scales of an FP8 K/V pool (stored = real / scale); 1.0 for other dtypes."""

    k_scale: float = 1.0
    v_scale: float = 1.0


UNSCALED = KVScales()


class PagedAttentionBackend:
    """The layers' backend over the engine's memory: attention K/V in the page pool's "kv" component,
    per-request state (the HybridBackend protocol) in the state slots. Attention runs the Triton kernels
    on CUDA and the pure-torch reference elsewhere."""

    def __init__(
        self,
        pool: PagePool,
        batch: ForwardBatch,
        state_slots: StateSlots | None = None,
        kv_scales: KVScales = UNSCALED,
        verify_slots: torch.Tensor | None = None,
    ) -> None:
        self._kv = pool.storage("kv")
        self.verify_slots = verify_slots  # speculative verify forwards only (HybridBackend.verify_slots)
        self._page_size = pool.page_size
        self._batch = batch
        self._state_slots = state_slots
        self._kv_scales = kv_scales
        self._pool = pool  # every token component, for layers with side caches (TokenCacheBackend)

    @property
    def query_ranges(self) -> list[tuple[int, int]]:
        return self._batch.query_ranges

    @property
    def decode_only(self) -> bool:
        return self._batch.decode_only

    @property
    def cu_seqlens(self) -> torch.Tensor:
        return self._batch.cu_seqlens_q

    @property
    def state_indices(self) -> torch.Tensor:
        if self._batch.state_indices is None:
            raise RuntimeError("this model keeps per-request state but the engine gave it no state slots")
        return self._batch.state_indices

    def state_pool(self, component: str, linear_ordinal: int) -> torch.Tensor:
        if self._state_slots is None:
            raise RuntimeError("this model keeps per-request state but the engine gave it no state slots")
        return self._state_slots.storage(component)[linear_ordinal]

    def read_state(self, component: str, linear_ordinal: int) -> torch.Tensor:
        return self.state_pool(component, linear_ordinal)[self.state_indices.long()]

    def write_state(self, component: str, linear_ordinal: int, value: torch.Tensor) -> None:
        self.state_pool(component, linear_ordinal)[self.state_indices.long()] = value

    def attend(
        self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        batch, (k_scale, v_scale) = self._batch, self._kv_scales
        kv_layer = self._kv[layer_index]
        store_kv(kv_layer, batch.out_slots, k, v, k_scale, v_scale)
        if q.is_cuda:
            from morion.ops.paged_attention_triton import kv_split_count, paged_attention

            # From the pool's size, never this batch's: a row's result must not depend on its batch, or
            # on whether the step replays a graph (whose page table is the widest) or runs eagerly.
            splits = kv_split_count(kv_layer.shape[2], self._pool.num_pages * self._page_size, q.device)
            return paged_attention(
                q, kv_layer, batch.page_table, batch.cu_seqlens_q, batch.seq_lens, self._page_size, scale,
                max_query_len=batch.max_query_len, k_scale=k_scale, v_scale=v_scale, num_kv_splits=splits,
            )  # fmt: skip
        return paged_attention_reference(
            q, kv_layer, batch.page_table, batch.cu_seqlens_q, batch.seq_lens, self._page_size, scale,
            k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip

    # -- TokenCacheBackend (layers/token_cache_backend.py): side caches and direct K/V access ----------

    def write_tokens(self, component: str, ordinal: int, values: torch.Tensor) -> None:
        storage = self._pool.storage(component)[ordinal]
        storage[self._batch.out_slots] = values.to(storage.dtype)

    def read_sequence_tokens(self, component: str, ordinal: int, seq_index: int) -> torch.Tensor:
        length = int(self._batch.seq_lens[seq_index])  # a host sync on CUDA
        positions = torch.arange(length, device=self._batch.page_table.device)
        return self._pool.storage(component)[ordinal][self._token_slots(seq_index, positions)]

    def write_kv(self, layer_index: int, k: torch.Tensor, v: torch.Tensor) -> None:
        k_scale, v_scale = self._kv_scales
        store_kv(self._kv[layer_index], self._batch.out_slots, k, v, k_scale, v_scale)

    def read_sequence_kv(
        self, layer_index: int, seq_index: int, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        kv_layer = self._kv[layer_index]
        slots = self._token_slots(seq_index, positions)
        if kv_layer.dtype != FP8_KV_DTYPE:
            kv = kv_layer[slots].float()
            return kv[:, 0], kv[:, 1]
        # As store_kv: through a byte view (indexing is defined for uint8 everywhere, not for fp8).
        kv = kv_layer.view(torch.uint8)[slots].view(FP8_KV_DTYPE).float()
        return kv[:, 0] * self._kv_scales.k_scale, kv[:, 1] * self._kv_scales.v_scale

    def _token_slots(self, seq_index: int, positions: torch.Tensor) -> torch.Tensor:
        """Flat pool token slots of sequence `seq_index`'s tokens at `positions` (through its page table)."""
        positions = positions.to(self._batch.page_table.device).long()
        pages = self._batch.page_table[seq_index].long()[positions // self._page_size]
        return pages * self._page_size + positions % self._page_size

    # -- TokenCacheBackend, in place: storage and paging metadata as device tensors (no host syncs) -----

    @property
    def page_size(self) -> int:
        return self._page_size

    @property
    def page_table(self) -> torch.Tensor:
        return self._batch.page_table

    @property
    def out_slots(self) -> torch.Tensor:
        return self._batch.out_slots

    def token_pool(self, component: str, ordinal: int) -> torch.Tensor:
        return self._pool.storage(component)[ordinal]

    def kv_pool(self, layer_index: int) -> torch.Tensor:
        return self._kv[layer_index]

    @property
    def kv_scales(self) -> tuple[float, float]:
        return self._kv_scales.k_scale, self._kv_scales.v_scale
