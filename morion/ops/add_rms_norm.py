"""The pre-norm residual step: residual = residual + x, then RMSNorm(residual), as one op.

`add_rms_norm_reference` is the eager torch sequence; on CUDA `add_rms_norm_triton.add_rms_norm_rows`
computes the same bits in one kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch


class AddNormResult(NamedTuple):
    normed: torch.Tensor  # RMSNorm(residual + x): the next block's input
    residual: torch.Tensor  # residual + x, rounded to the residual's dtype: the stream carried on


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, norm: Callable[[torch.Tensor], torch.Tensor]
) -> AddNormResult:
    """The add in the model dtype, then the norm (the norm module's torch code off CUDA)."""
    residual = residual + x
    return AddNormResult(norm(residual), residual)
