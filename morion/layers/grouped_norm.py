"""Zero-centred RMSNorm over equal groups of a vector (Qwen3.8-Flash-Next's per-stream norms).

A `[.., G * S]` input is normalised per `S`-wide group (one RMS per hyper-connection stream), then scaled
by `(1 + w)` over the whole `G * S` width. As transformers' `Qwen4ExpTextRMSNorm(dim, group_size)`: all
in fp32, rounded once to the input dtype at the end. Pure torch on every device.
"""

from __future__ import annotations

import torch
from torch import nn


class GroupedRMSNorm(nn.Module):
    def __init__(self, size: int, group_size: int, eps: float) -> None:
        super().__init__()
        if size % group_size:
            raise ValueError(f"size {size} is not a multiple of the group size {group_size}")
        self.group_size = group_size
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        groups = x.float().unflatten(-1, (-1, self.group_size))
        normed = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed.flatten(-2) * (1.0 + self.weight.float())).to(x.dtype)
