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
        if _owns_whole_storage(tensor) and _can_take_storage(target, tensor):
            target.set_(tensor)  # a fresh tensor becomes the parameter: no second copy of its memory
        else:
            target.copy_(tensor)


def _owns_whole_storage(tensor: torch.Tensor) -> bool:
    """A tensor made for this load (a dequantized GGUF tensor), not a view of a file or of a larger
    buffer (safetensors' tensors are views of their shard): taking it over shares memory with nothing."""
    return (
        tensor._base is None
        and tensor.is_contiguous()
        and tensor.storage_offset() == 0
        and tensor.untyped_storage().nbytes() == tensor.nbytes
    )


def _can_take_storage(target: torch.Tensor, tensor: torch.Tensor) -> bool:
    """A whole parameter on the tensor's device and dtype, in pageable memory (a host table placed in
    page-locked memory must stay there)."""
    return (
        target._base is None
        and target.device == tensor.device
        and target.dtype == tensor.dtype
        and not (target.device.type == "cpu" and torch.cuda.is_available() and target.is_pinned())
    )


def require_complete(missing: Collection[str]) -> None:
    if missing:
        raise ModelLoadError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[0]!r}")
