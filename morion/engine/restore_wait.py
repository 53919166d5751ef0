"""The forward's backend while host/disk restores of this step are still copying in: every read of cache
memory waits (on the GPU) for the copies it depends on."""

from __future__ import annotations

import torch

from morion.cache.copy_engine import Transfer
from morion.engine.forward_batch import PagedAttentionBackend


class BackendAfterRestores:
    """The step's backend with every read of cache memory ordered after the step's load-backs.

    Copy rule 4: a layer waits on the GPU (never the CPU) for that layer's restore copies of every
    component it touches: attention for each token component at its index (K/V, and any side cache
    paged with it), a linear layer for the state component it reads or writes, whichever way it reaches
    it (whole states or the pool in place).
    """

    def __init__(self, backend: PagedAttentionBackend, restores: list[Transfer], token_components: list[str]):
        self._backend = backend
        self._restores = restores
        self._token_components = token_components

    @property
    def query_ranges(self) -> list[tuple[int, int]]:
        return self._backend.query_ranges

    @property
    def decode_only(self) -> bool:
        return self._backend.decode_only

    @property
    def cu_seqlens(self) -> torch.Tensor:
        return self._backend.cu_seqlens

    @property
    def state_indices(self) -> torch.Tensor:
        return self._backend.state_indices

    @property
    def verify_slots(self) -> torch.Tensor | None:
        return self._backend.verify_slots

    def attend(self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
        for restore in self._restores:
            for name in self._token_components:
                restore.wait(name, layer_index)
        return self._backend.attend(layer_index, q, k, v, scale)

    def _wait_state(self, component: str, linear_ordinal: int) -> None:
        for restore in self._restores:
            restore.wait(component, linear_ordinal)

    def state_pool(self, component: str, linear_ordinal: int) -> torch.Tensor:
        self._wait_state(component, linear_ordinal)
        return self._backend.state_pool(component, linear_ordinal)

    def read_state(self, component: str, linear_ordinal: int) -> torch.Tensor:
        self._wait_state(component, linear_ordinal)
        return self._backend.read_state(component, linear_ordinal)

    def write_state(self, component: str, linear_ordinal: int, value: torch.Tensor) -> None:
        self._wait_state(component, linear_ordinal)
        self._backend.write_state(component, linear_ordinal, value)

    # TokenCacheBackend: a side cache waits for its own (component, layer) copies; K/V reads and writes
    # wait for every token component at that layer, as `attend` does.

    def _wait_component(self, component: str, ordinal: int) -> None:
        for restore in self._restores:
            restore.wait(component, ordinal)

    def write_tokens(self, component: str, ordinal: int, values: torch.Tensor) -> None:
        self._wait_component(component, ordinal)
        self._backend.write_tokens(component, ordinal, values)

    def read_sequence_tokens(self, component: str, ordinal: int, seq_index: int) -> torch.Tensor:
        self._wait_component(component, ordinal)
        return self._backend.read_sequence_tokens(component, ordinal, seq_index)

    def _wait_tokens(self, layer_index: int) -> None:
        for restore in self._restores:
            for name in self._token_components:
                restore.wait(name, layer_index)

    def write_kv(self, layer_index: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self._wait_tokens(layer_index)
        self._backend.write_kv(layer_index, k, v)

    def read_sequence_kv(
        self, layer_index: int, seq_index: int, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._wait_tokens(layer_index)
        return self._backend.read_sequence_kv(layer_index, seq_index, positions)

    # TokenCacheBackend in place: the storage is handed out after its copies (rule 4), the metadata as is.

    @property
    def page_size(self) -> int:
        return self._backend.page_size

    @property
    def page_table(self) -> torch.Tensor:
        return self._backend.page_table

    @property
    def out_slots(self) -> torch.Tensor:
        return self._backend.out_slots

    def token_pool(self, component: str, ordinal: int) -> torch.Tensor:
        self._wait_component(component, ordinal)
        return self._backend.token_pool(component, ordinal)

    def kv_pool(self, layer_index: int) -> torch.Tensor:
        self._wait_tokens(layer_index)
        return self._backend.kv_pool(layer_index)

    @property
    def kv_scales(self) -> tuple[float, float]:
        return self._backend.kv_scales
