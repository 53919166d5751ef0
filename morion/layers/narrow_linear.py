"""nn.Linear for gates with a few outputs, computed alike for a row at every batch size on CUDA.

Same parameters and checkpoint names as nn.Linear (loaders and `--weight-dtype fp8`'s keep list see an
nn.Linear); on CUDA the product runs `ops/narrow_linear_triton.py`, whose row results do not depend on the
other rows of the batch, where cuBLAS's N = 1 kernels do (that module says why this matters).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from morion.ops.log_once import log_once

logger = logging.getLogger(__name__)


def narrow_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T for a gate's few outputs (weight [N, K]): on CUDA, where the kernel takes them, one
    Triton program per row, so a row's result does not depend on the batch; F.linear elsewhere."""
    if x.is_cuda and x.dtype == weight.dtype:
        from morion.ops import narrow_linear_triton

        if narrow_linear_triton.supports(x, weight):
            log_once(logger, "narrow linear (gates): one Triton program per row, batch-invariant")
            return narrow_linear_triton.narrow_linear(x, weight)
    return F.linear(x, weight)


class NarrowLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = narrow_product(x, self.weight)
        return out if self.bias is None else out + self.bias
