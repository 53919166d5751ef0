"""RMSNorm as Llama/Qwen define it: normalise in fp32, scale by the weight in the input dtype.

On CUDA one fused Triton kernel (ops/row_kernels_triton.py) computes the same values; the torch code is its
reference."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from morion.ops import row_kernels_triton as rows

            if rows.supports(x):
                return rows.rms_norm_rows(x, self.weight, self.eps, rows.LLAMA)
        input_dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(input_dtype)
