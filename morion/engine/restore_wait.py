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
