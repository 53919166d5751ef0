"""What a hyper-connection mix gives its block (layers/hyper_connection.py, ops/hyper_connection_triton)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from morion.ops.fp8 import QuantizedRows


class Mixed(NamedTuple):
    """The block's input [T, H]; the inject weights [T, n] (None for the final mixer, which writes nothing
    back); the input's rows quantized per row for FP8 layers, where the fused kernels were asked to
    (`quantize_fp8(mixed, per_row=True)`'s values), else None: the block quantizes them itself."""

    mixed: torch.Tensor
    inject_weights: torch.Tensor | None
    quantized: QuantizedRows | None = None
