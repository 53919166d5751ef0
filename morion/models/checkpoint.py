"""Rules every architecture's `load_weights` shares: which checkpoint tensors carry nothing, how one is
copied in (quantized on the way where the parameter is FP8), and that nothing may be left unfilled."""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch import nn

from morion.errors import ModelLoadError
from morion.ops.fp8 import FP8_DTYPE, quantize_fp8_


def carries_nothing(name: str, tie_word_embeddings: bool) -> bool:
    # Some tied checkpoints still store the shared matrix twice; old ones store RoPE frequencies.
    return (name == "lm_head.weight" and tie_word_embeddings) or name.endswith("rotary_emb.inv_freq")


def fp8_scales(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameter name -> scale buffer, for every FP8 parameter (its scale is the buffer `<name>_scale`)."""
    buffers = dict(model.named_buffers())
    return {
        name: buffers[name + "_scale"] for name, param in model.named_parameters() if param.dtype == FP8_DTYPE
    }


def copy_checkpoint_tensor(
    name: str, tensor: torch.Tensor, target: torch.Tensor, scale: torch.Tensor | None = None
) -> None:
    """Copies `tensor` into `target`; an FP8 target is quantized into, with its `scale` (the matching
    slice of its scale buffer: 0-d for one scale, one per row otherwise) filled alongside."""
    if tuple(tensor.shape) != tuple(target.shape):
        shapes = f"{tuple(tensor.shape)}, expected {tuple(target.shape)}"
        raise ModelLoadError(f"checkpoint tensor {name!r} has shape {shapes}")
    if target.dtype == FP8_DTYPE:
        if scale is None:
            raise ModelLoadError(f"FP8 parameter for checkpoint tensor {name!r} has no scale")
        quantize_fp8_(tensor, target, scale)
        return
    with torch.no_grad():
        target.copy_(tensor)


def require_complete(missing: Collection[str]) -> None:
    if missing:
        raise ModelLoadError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[0]!r}")
