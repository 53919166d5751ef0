"""The layers' backend over the engine's memory: attention K/V and side caches in the page pool, per-request
state in the state slots, and, while host/disk restores of this step are still copying in, every read or
write of that memory ordered after the copies it depends on (`runner/restore_wait.py`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from morion.cache.page_pool import PagePool
from morion.cache.state_slots import StateSlots
from morion.ops.paged_attention import FP8_KV_DTYPE, paged_attention_reference, store_kv
from morion.runner.forward_batch import ForwardBatch
from morion.runner.restore_wait import RestoreWaits


class KVScales(NamedTuple):
    """Per-layer scales of an FP8 K/V pool (stored = real / scale); 1.0 for other dtypes."""

    k_scale: float = 1.0
    v_scale: float = 1.0


UNSCALED = KVScales()


class PagedAttentionBackend:
    """The layers' backend over the engine's memory: attention K/V in the page pool's "kv" component,
    per-request state (the HybridBackend protocol) in the state slots. Attention runs the Triton kernels
    on CUDA and the pure-torch reference elsewhere. With `restore_waits` (a step that restored pages or
    state from the host tier), every access to cache memory first waits for its copies (copy rule 4);
    the batch's metadata needs no wait."""

    def __init__(
        self,
        pool: PagePool,
        batch: ForwardBatch,
        state_slots: StateSlots | None = None,
        kv_scales: KVScales = UNSCALED,
        verify_slots: torch.Tensor | None = None,
        restore_waits: RestoreWaits | None = None,
    ) -> None:
        self._kv = pool.storage("kv")
        self.verify_slots = verify_slots  # speculative verify forwards only (HybridBackend.verify_slots)
        self._page_size = pool.page_size
        self._batch = batch
        self._state_slots = state_slots
        self._kv_scales = kv_scales
        self._pool = pool  # every token component, for layers with side caches (TokenCacheBackend)
        self._waits = restore_waits

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

    def outside_graph(self, op: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
        return op(self, *inputs)

    def state_pool(self, component: str, linear_ordinal: int) -> torch.Tensor:
        if self._state_slots is None:
            raise RuntimeError("this model keeps per-request state but the engine gave it no state slots")
        if self._waits is not None:
            self._waits.component(component, linear_ordinal)
        return self._state_slots.storage(component)[linear_ordinal]

    def read_state(self, component: str, linear_ordinal: int) -> torch.Tensor:
        return self.state_pool(component, linear_ordinal)[self.state_indices.long()]

    def write_state(self, component: str, linear_ordinal: int, value: torch.Tensor) -> None:
        self.state_pool(component, linear_ordinal)[self.state_indices.long()] = value

    def attend(
        self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        if self._waits is not None:
            self._waits.tokens(layer_index)
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
    # Through `token_pool` / `kv_pool`: a side cache waits for its own (component, layer) copies, K/V reads
    # and writes for every token component at that layer, as `attend` does.

    def write_tokens(self, component: str, ordinal: int, values: torch.Tensor) -> None:
        storage = self.token_pool(component, ordinal)
        storage[self._batch.out_slots] = values.to(storage.dtype)

    def read_sequence_tokens(self, component: str, ordinal: int, seq_index: int) -> torch.Tensor:
        storage = self.token_pool(component, ordinal)
        length = int(self._batch.seq_lens[seq_index])  # a host sync on CUDA
        positions = torch.arange(length, device=self._batch.page_table.device)
        return storage[self._token_slots(seq_index, positions)]

    def write_kv(self, layer_index: int, k: torch.Tensor, v: torch.Tensor) -> None:
        k_scale, v_scale = self._kv_scales
        store_kv(self.kv_pool(layer_index), self._batch.out_slots, k, v, k_scale, v_scale)

    def read_sequence_kv(
        self, layer_index: int, seq_index: int, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        kv_layer = self.kv_pool(layer_index)
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

    # -- TokenCacheBackend, in place: storage and paging metadata as device tensors (no host syncs); the
    # storage is handed out after its copies (rule 4), the metadata as is -----------------------------

    @property
    def context_lens(self) -> list[int]:
        if not self._batch.host:  # a graph's static batch: its lengths live on the device only
            raise RuntimeError("a replayed forward's batch has no host copy of its sequence lengths")
        return [int(length) for length in self._batch.host[5]]

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
        if self._waits is not None:
            self._waits.component(component, ordinal)
        return self._pool.storage(component)[ordinal]

    def kv_pool(self, layer_index: int) -> torch.Tensor:
        if self._waits is not None:
            self._waits.tokens(layer_index)
        return self._kv[layer_index]

    @property
    def kv_scales(self) -> tuple[float, float]:
        return self._kv_scales.k_scale, self._kv_scales.v_scale
