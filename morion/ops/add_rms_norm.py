"""The pre-norm residual step: residual = residual + x, then RMSNorm(residual), as one op; optionally
the normed rows' per-row FP8 quantization too, for FP8 layers that read them.

`add_rms_norm_reference` is the eager torch sequence; on CUDA `add_rms_norm_triton.add_rms_norm_rows`
computes the same bits in one kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from morion.ops.fp8 import QuantizedRows, quantize_fp8


class AddNormResult(NamedTuple):
    normed: torch.Tensor  # RMSNorm(residual + x): the next block's input
    residual: torch.Tensor  # residual + x, rounded to the residual's dtype: the stream carried on
    # With `quantize`: normed [M, K] quantized per row (`quantize_fp8(normed, per_row=True)`'s values).
    quantized: QuantizedRows | None = None


def add_rms_norm_reference(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm: Callable[[torch.Tensor], torch.Tensor],
    quantize: bool = False,
) -> AddNormResult:
    """The add in the model dtype, then the norm (the norm module's torch code off CUDA), then with
    `quantize` the per-row FP8 quantization of the normed rows [M, K]."""
    residual = residual + x
    normed = norm(residual)
    return AddNormResult(
        normed, residual, QuantizedRows(*quantize_fp8(normed, per_row=True)) if quantize else None
    )
