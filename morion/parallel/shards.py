"""How one rank's part of a weight is cut from the whole tensor, for tensor parallelism (issue #28).

Every rank builds the model from its local configuration (heads, value heads and intermediate sizes
divided by the number of ranks, models/hybrid_parallel.py), so each parameter's local shape is fixed; a
`Shard` says which elements of the checkpoint's tensor fill it:

- `Split(dim)`: the rank's contiguous 1/N of `dim` (a projection's heads, a row-parallel input);
- `Split(dim, segments)`: `dim` holds consecutive blocks (conv1d's q | k | v, the experts' gate | up), and
  the rank takes its 1/N of each block, in order: the local tensor has the same blocks, each smaller;
- `ReplicatedHeads(dim, heads)`: K/V heads when there are fewer than ranks: rank r takes head
  r * heads // N, so consecutive ranks share a head (their query heads are the ones that attend to it);
- `FirstRank()`: rank 0 holds the whole tensor and the others zeros of its shape: the bias of a
  row-parallel projection, whose partial outputs are added across ranks (it must be added once);
- `REPLICATED` (None): every rank holds the whole tensor (norms, the router, embeddings).

A cut is a view of the whole tensor (`narrow`), contiguous where the caller needs it to be.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from morion.errors import MorionError


@dataclass(frozen=True)
class Split:
    dim: int
    segments: tuple[int, ...] | None = None  # sizes of consecutive blocks along `dim`; None: one block


@dataclass(frozen=True)
class ReplicatedHeads:
    dim: int
    heads: int  # heads along `dim` in the whole tensor, fewer than the ranks or not


@dataclass(frozen=True)
class FirstRank:
    pass


Shard = Split | ReplicatedHeads | FirstRank | None
REPLICATED: Shard = None


def cut(tensor: torch.Tensor, shard: Shard, rank: int, size: int) -> torch.Tensor:
    """Rank `rank` of `size`'s part of `tensor` (the whole tensor where replicated)."""
    if shard is None or size == 1:
        return tensor
    if isinstance(shard, ReplicatedHeads):
        return _replicated_heads(tensor, shard, rank, size)
    if isinstance(shard, FirstRank):
        return tensor if rank == 0 else torch.zeros_like(tensor)
    length = tensor.shape[shard.dim]
    segments = shard.segments or (length,)
    if sum(segments) != length:
        raise ValueError(
            f"segments {segments} do not add up to dimension {shard.dim} of {tuple(tensor.shape)}"
        )
    parts, start = [], 0
    for segment in segments:
        part = split_evenly(segment, size, f"dimension {shard.dim} of {tuple(tensor.shape)}")
        parts.append(tensor.narrow(shard.dim, start + rank * part, part))
        start += segment
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=shard.dim)


def _replicated_heads(tensor: torch.Tensor, shard: ReplicatedHeads, rank: int, size: int) -> torch.Tensor:
    if shard.heads >= size:
        return cut(tensor, Split(shard.dim), rank, size)
    if size % shard.heads:
        raise MorionError(f"{size} ranks cannot share {shard.heads} K/V heads evenly")
    head_dim = tensor.shape[shard.dim] // shard.heads
    head = rank * shard.heads // size
    return tensor.narrow(shard.dim, head * head_dim, head_dim)


def split_evenly(count: int, size: int, what: str) -> int:
    """count / size, or a MorionError naming `what` when the ranks cannot share it evenly."""
    if count % size:
        raise MorionError(f"--tensor-parallel-size {size} does not divide the {count} {what}")
    return count // size


@dataclass(frozen=True)
class RankParts:
    """One rank's view of a whole model's tensors, for loaders that draw or read whole tensors: their
    shapes, and the rank's part of each (`shard_of(name)` is the architecture's rule)."""

    whole_shapes: dict[str, torch.Size]
    shard_of: Callable[[str], Shard]
    rank: int
    size: int

    def cut(self, name: str, tensor: torch.Tensor, leading: int = 0) -> torch.Tensor:
        """The rank's part of `tensor`, whole parameter `name` without its first `leading` dimensions
        (one expert of stacked experts: leading 1)."""
        shard = self.shard_of(name)
        if leading and shard is not None and not isinstance(shard, FirstRank):
            shard = dataclasses.replace(shard, dim=shard.dim - leading)
        return cut(tensor, shard, self.rank, self.size)
