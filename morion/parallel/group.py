"""The tensor-parallel group of one rank (issue #28): who it is, and the two collectives a split model
needs: the sum of partial outputs (after o_proj, out_proj and the MLPs' down projections) and the gather
of the vocabulary-split logits; also rank 0's broadcast of what it alone decided and the others compute
from (a verify's accepted drafts: spec/draft_mirror.py). NCCL on CUDA, gloo on the CPU; at one rank
each is the identity, with no process group at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

BACKENDS = {"cuda": "nccl", "cpu": "gloo"}
# A collective waits this long for the other ranks: the first after loading waits for the slowest rank's
# load and warm-up (an 80B checkpoint from a slow disk takes minutes; torch's default is 10 to 30).
COLLECTIVE_TIMEOUT = timedelta(hours=2)


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    cpu_group: Any = None  # a gloo group of the same ranks, for host-side agreements (also under NCCL)

    @classmethod
    def join(
        cls,
        rank: int,
        size: int,
        device: torch.device,
        init_method: str | None = None,
        store: dist.Store | None = None,
    ) -> TensorParallel:
        """Joins the group of `size` processes at `init_method` (e.g. tcp://127.0.0.1:PORT), or through
        `store` (rank 0's TCPStore), as `rank`."""
        if size > 1 and not dist.is_initialized():
            if device.type == "cuda":
                torch.cuda.set_device(device)  # NCCL's communicator binds to the current device
            dist.init_process_group(
                BACKENDS[device.type],
                init_method=init_method,
                store=store,
                rank=rank,
                world_size=size,
                timeout=COLLECTIVE_TIMEOUT,
            )
            return cls(rank, size, dist.new_group(backend="gloo"))
        return cls(rank, size)

    def all_reduce_(self, partial: torch.Tensor) -> torch.Tensor:
        """Adds every rank's `partial` into it, in place; returns it."""
        if self.size > 1:
            dist.all_reduce(partial)
        return partial

    def broadcast_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's `tensor` into every rank's (same shape and dtype), in place; returns it."""
        if self.size > 1:
            dist.broadcast(tensor, src=0)
        return tensor

    def min_over_ranks(self, value: int, device: torch.device) -> int:
        """The smallest of every rank's `value` (what all ranks must agree on: the pool's pages)."""
        if self.size == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
        return int(tensor.item())

    def all_agree(self, flags: list[bool]) -> list[bool]:
        """Each flag anded over the ranks (on the CPU, over the gloo group)."""
        if self.size == 1:
            return flags
        tensor = torch.tensor(flags, dtype=torch.uint8)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return [bool(flag) for flag in tensor.tolist()]

    def gather_last_dim(self, part: torch.Tensor) -> torch.Tensor:
        """Every rank's `part` side by side along the last dimension, in rank order (the logits of a
        vocabulary split in contiguous blocks)."""
        if self.size == 1:
            return part
        parts = [torch.empty_like(part) for _ in range(self.size)]
        dist.all_gather(parts, part.contiguous())
        return torch.cat(parts, dim=-1)

    def leave(self) -> None:
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()


ONE_RANK = TensorParallel()
