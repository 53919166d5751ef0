"""Qwen's official block-FP8 checkpoints: each quantized `X.weight` (float8_e4m3fn) comes with
`X.weight_scale_inv` holding one scale per 128x128 block; the real weight is their product."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from morion.errors import ModelLoadError

_SCALE_SUFFIX = "_scale_inv"


def block_fp8_size(hf_config: dict[str, Any]) -> tuple[int, int] | None:
    """The (rows, cols) block of a block-FP8 checkpoint, or None for any other format."""
    quantization = hf_config.get("quantization_config") or {}
    if quantization.get("quant_method") != "fp8":
        return None
    block = quantization.get("weight_block_size") or (128, 128)
    return int(block[0]), int(block[1])


def dequantize_block_fp8(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    rows, cols = weight.shape
    expected = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale_inv.shape) != expected:
        raise ModelLoadError(
            f"block scales of shape {tuple(scale_inv.shape)} for a {rows}x{cols} weight, expected {expected}"
        )
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return weight.float() * scale


def dequantized_weights(
    weights: Iterable[tuple[str, torch.Tensor]], block: tuple[int, int]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Pairs every FP8 weight with its scale (in either order, possibly in different shards) and yields
    the dequantized fp32 weight under the weight's name; other tensors pass through."""
    waiting: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if name.endswith(_SCALE_SUFFIX):
            weight_name = name.removesuffix(_SCALE_SUFFIX)
            if weight_name in waiting:
                yield weight_name, dequantize_block_fp8(waiting.pop(weight_name), tensor, block)
            else:
                waiting[name] = tensor
        elif tensor.dtype == torch.float8_e4m3fn:
            scale = waiting.pop(name + _SCALE_SUFFIX, None)
            if scale is None:
                waiting[name] = tensor
            else:
                yield name, dequantize_block_fp8(tensor, scale, block)
        else:
            yield name, tensor
    if waiting:
        raise ModelLoadError(f"block-FP8 tensor without its pair: {sorted(waiting)[0]!r}")
