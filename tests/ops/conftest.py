"""Shared helpers of the op tests."""

from __future__ import annotations

import pytest
import torch


class PoolBackend:
    """One Gated DeltaNet layer's state pools behind both halves of `HybridBackend`: read/write_state
    gather and scatter the very rows the in-place kernels update, so one backend drives both paths."""

    def __init__(self, pools: dict[str, torch.Tensor], slots: list[int], lengths: list[int]) -> None:
        device = pools["recurrent"].device
        self.pools = pools
        self._rows = torch.tensor(slots, device=device)
        starts = torch.tensor([0, *lengths]).cumsum(0).tolist()
        self.query_ranges = list(zip(starts[:-1], lengths, strict=True))
        self.decode_only = all(length == 1 for length in lengths)
        self.cu_seqlens = torch.tensor(starts, dtype=torch.int32, device=device)
        self.state_indices = torch.tensor(slots, dtype=torch.int32, device=device)

    def read_state(self, component: str, linear_ordinal: int) -> torch.Tensor:
        return self.pools[component][self._rows].clone()

    def write_state(self, component: str, linear_ordinal: int, value: torch.Tensor) -> None:
        self.pools[component][self._rows] = value.to(self.pools[component].dtype)

    verify_slots = None  # never a speculative verify forward

    def state_pool(self, component: str, linear_ordinal: int) -> torch.Tensor:
        return self.pools[component]


@pytest.fixture(autouse=True)
def fp32_references_without_tf32():
    """Op tests compare against fp32 references; on a GPU, cuDNN and cuBLAS may run those in TF32
    (10-bit mantissa) unless told not to."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.fixture(scope="session")
def pool_backend() -> type[PoolBackend]:
    """The `PoolBackend` class (test modules here do not import each other)."""
    return PoolBackend
