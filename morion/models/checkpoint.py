"""Rules every architecture's `load_weights` shares: which checkpoint tensors carry nothing, how one is
copied in (quantized on the way where the parameter is FP8 or NVFP4; an NVFP4 checkpoint's weight copied
as it is into NVFP4 experts, dequantized for any other parameter), and that nothing may be left
unfilled."""

from __future__ import annotations

from collections.abc import Collection
from typing import NamedTuple

import torch
from torch import nn

from morion.errors import ModelLoadError
from morion.ops.fp8 import FP8_DTYPE, quantize_fp8_
from morion.ops.nvfp4 import Nvfp4Weight, quantize_nvfp4_parts


class Nvfp4Scales(NamedTuple):
    """The scale buffers of an NVFP4 parameter `<name>` (uint8 codes [..., N, K/2]): `<name>_scale`,
    e4m3 [..., N, K/16], and `<name>_scale_2`, fp32 [..., P] for N rows in P parts quantized apart."""

    block: torch.Tensor
    parts: torch.Tensor


def carries_nothing(name: str, tie_word_embeddings: bool) -> bool:
    # Some tied checkpoints still store the shared matrix twice; old ones store RoPE frequencies.
    return (name == "lm_head.weight" and tie_word_embeddings) or name.endswith("rotary_emb.inv_freq")


def fp8_scales(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameter name -> scale buffer, for every FP8 parameter (its scale is the buffer `<name>_scale`)."""
    buffers = dict(model.named_buffers())
    return {
        name: buffers[name + "_scale"] for name, param in model.named_parameters() if param.dtype == FP8_DTYPE
    }


def nvfp4_scales(model: nn.Module) -> dict[str, Nvfp4Scales]:
    """Parameter name -> its scale buffers, for every NVFP4 parameter (uint8 codes with both buffers)."""
    buffers = dict(model.named_buffers())
    return {
        name: Nvfp4Scales(buffers[name + "_scale"], buffers[name + "_scale_2"])
        for name, param in model.named_parameters()
        if param.dtype == torch.uint8 and name + "_scale_2" in buffers
    }


def copy_checkpoint_tensor(
    name: str,
    tensor: torch.Tensor | Nvfp4Weight,
    target: torch.Tensor,
    scale: torch.Tensor | None = None,
    nvfp4: Nvfp4Scales | None = None,
) -> None:
    """Copies `tensor` into `target`; an FP8 target is quantized into, with its `scale` (the matching
    slice of its scale buffer: 0-d for one scale, one per row otherwise) filled alongside, an NVFP4 target
    (uint8 codes) with its `nvfp4` scales (the matching slices). A checkpoint's NVFP4 weight goes into an
    NVFP4 target as it is, and is dequantized for any other."""
    if nvfp4 is not None:
        _copy_nvfp4(name, tensor, target, nvfp4)
        return
    if isinstance(tensor, Nvfp4Weight):  # FP8 targets quantize from fp32, as from any weight
        tensor = tensor.dequantize(torch.float32 if target.dtype == FP8_DTYPE else target.dtype)
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


def _copy_nvfp4(
    name: str, tensor: torch.Tensor | Nvfp4Weight, codes: torch.Tensor, scales: Nvfp4Scales
) -> None:
    """Into codes [..., N, K/2] and their scales: a checkpoint's NVFP4 weight copied (one part: a gate or
    up projection, a down projection), or a float weight [..., N, K] quantized part by part."""
    logical = (*codes.shape[:-1], codes.shape[-1] * 2)
    if tuple(tensor.shape) != logical:
        shapes = f"{tuple(tensor.shape)}, expected {logical}"
        raise ModelLoadError(f"checkpoint tensor {name!r} has shape {shapes}")
    with torch.no_grad():
        if isinstance(tensor, Nvfp4Weight):
            if scales.parts.numel() != 1:
                raise ModelLoadError(f"NVFP4 checkpoint tensor {name!r} fills several quantized parts")
            codes.copy_(tensor.codes)
            scales.block.copy_(tensor.block_scales)
            scales.parts.copy_(tensor.global_scale.reshape(scales.parts.shape))
            return
        quantize_nvfp4_into(tensor, codes, scales)


def quantize_nvfp4_into(source: torch.Tensor, codes: torch.Tensor, scales: Nvfp4Scales) -> None:
    """A float weight [..., N, K] quantized on the codes' device into codes [..., N, K/2] and their
    scales, its N rows in as many parts as `scales.parts` has entries per matrix."""
    quantized = quantize_nvfp4_parts(source.to(codes.device), scales.parts.shape[-1])
    with torch.no_grad():
        codes.copy_(quantized.codes)
        scales.block.copy_(quantized.block_scales)
        scales.parts.copy_(quantized.global_scale)


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
