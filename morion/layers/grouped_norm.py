"""Zero-centred RMSNorm over equal groups of a vector (Qwen3.8-Flash-Next's per-stream norms).

A `[.., G * S]` input is normalised per `S`-wide group (one RMS per hyper-connection stream), then scaled
by `(1 + w)` over the whole `G * S` width. As transformers' `Qwen4ExpTextRMSNorm(dim, group_size)`: all
in fp32, rounded once to the input dtype at the end. On CUDA one Triton program per (token, group)
(ops/row_kernels_triton.py, the torch code here its reference): torch's reduction splits a group's sum
differently at one token than beside others, and a decode step's rows must not depend on their batch.
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
        if x.is_cuda and x.is_contiguous():
            from morion.ops import row_kernels_triton as rows

            grouped = x.view(-1, x.shape[-1] // self.group_size, self.group_size)
            if rows.supports(grouped):
                normed = rows.rms_norm_rows(
                    grouped, self.weight, self.eps, rows.ZERO_CENTRED, weight_per_group=True
                )
                return normed.view(x.shape)
        groups = x.float().unflatten(-1, (-1, self.group_size))
        normed = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed.flatten(-2) * (1.0 + self.weight.float())).to(x.dtype)
