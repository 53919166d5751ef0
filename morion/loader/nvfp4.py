"""ModelOpt NVFP4 checkpoints (e.g. RadixArk/Qwen3.8-Flash-Next-NVFP4: routed experts NVFP4, the rest BF16).

A quantized Linear `X` of logical shape [N, K] is stored as four tensors (model-architecture.md §6.1):
`X.weight` uint8 [N, K/2] (two E2M1 codes per byte, even column in the low nibble), `X.weight_scale`
float8_e4m3fn [N, K/16] (one scale per 16 consecutive input columns), `X.weight_scale_2` fp32 scalar (per
tensor, amax/(6·448): not a power of two) and `X.input_scale` fp32 scalar (activation calibration for
W4A4 kernels; dropped: morion's kernels are weight-only). The numbers are ops/nvfp4.py's.

Under `--weight-dtype nvfp4` each group goes to the model as it is (an `Nvfp4Weight` on the device: the
routed experts keep the codes and scales). Otherwise it is dequantized as it streams in and `X.weight`
continues down the ordinary path: kept in the model dtype, or requantized to FP8 by `--weight-dtype fp8`
exactly like a BF16 checkpoint's weight.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from morion.errors import ModelLoadError
from morion.ops.nvfp4 import GROUP_SIZE, Nvfp4Weight

_REQUIRED = ("weight", "weight_scale", "weight_scale_2")
_QUANT_METHODS = ("modelopt", "modelopt_fp4")


def _modelopt_quantization(hf_config: dict[str, Any], directory: Path) -> dict[str, Any] | None:
    """The ModelOpt quantization description: `hf_quant_config.json`'s "quantization" (the exporter's
    own file, and the only one that lists a mixed checkpoint's layers) or else config.json's
    `quantization_config`; None for a checkpoint ModelOpt did not quantize."""
    hf_quant = directory / "hf_quant_config.json"
    if directory.is_dir() and hf_quant.is_file():
        try:
            described = json.loads(hf_quant.read_text())
        except json.JSONDecodeError as error:
            raise ModelLoadError(f"{hf_quant} is not valid JSON: {error}") from None
        if (described.get("producer") or {}).get("name") == "modelopt":
            return described.get("quantization") or {}
    quantization = hf_config.get("quantization_config") or {}
    return quantization if quantization.get("quant_method") in _QUANT_METHODS else None


def is_nvfp4_checkpoint(hf_config: dict[str, Any], directory: Path) -> bool:
    """True for a ModelOpt NVFP4 checkpoint (`quant_algo` NVFP4, or MIXED_PRECISION whose listed
    `quantized_layers` are all NVFP4; without a list the tensors themselves say which are NVFP4). Any
    other ModelOpt algorithm is rejected here, by name, rather than failing later on a tensor the model
    has no place for."""
    quantization = _modelopt_quantization(hf_config, directory)
    if quantization is None:
        return False
    algo = quantization.get("quant_algo")
    if algo == "MIXED_PRECISION":
        layers = quantization.get("quantized_layers") or {}
        others = sorted({layer.get("quant_algo") for layer in layers.values()} - {"NVFP4"}, key=str)
        if others:
            raise ModelLoadError(f"ModelOpt MIXED_PRECISION checkpoint has {others[0]} layers; only NVFP4")
        return True
    if algo != "NVFP4":
        raise ModelLoadError(f"unsupported ModelOpt quant_algo {algo!r} (only NVFP4 checkpoints load)")
    return True


def checked_nvfp4(
    weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor
) -> Nvfp4Weight:
    """A checkpoint's uint8 [N, K/2] codes, e4m3 [N, K/16] block scales and fp32 per-tensor scale, checked.

    Per-tensor scales need no special case for fused projections (q/k/v, gate/up) whose parts share one
    `weight_scale_2` at export: each part still carries the scalar its own codes were made with.
    """
    if weight.dtype != torch.uint8 or weight_scale.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise ModelLoadError(
            f"NVFP4 expects 2-D uint8 codes and e4m3 scales, got {weight.dtype} {tuple(weight.shape)}, "
            f"{weight_scale.dtype}"
        )
    rows, columns = weight.shape[0], weight.shape[1] * 2
    if columns % GROUP_SIZE or tuple(weight_scale.shape) != (rows, columns // GROUP_SIZE):
        raise ModelLoadError(
            f"NVFP4 block scales of shape {tuple(weight_scale.shape)} for codes {tuple(weight.shape)}: "
            f"expected ({rows}, {columns // GROUP_SIZE}) with K = {columns} a multiple of {GROUP_SIZE}"
        )
    if weight_scale_2.numel() != 1:
        raise ModelLoadError(
            f"NVFP4 weight_scale_2 must be a scalar, got shape {tuple(weight_scale_2.shape)}"
        )
    return Nvfp4Weight(weight, weight_scale, weight_scale_2.float().reshape(1))


def _part(name: str, tensor: torch.Tensor) -> str | None:
    """Which NVFP4 part a checkpoint tensor is, or None for an ordinary tensor. Decided by suffix and
    dtype, not by the `ignore` globs: a `weight_scale` is only an NVFP4 block scale when it is 2-D
    e4m3, so the FP8 PLE table's BF16 `weight_scale` and every BF16 weight pass through untouched."""
    suffix = name.rpartition(".")[2]
    if suffix in ("weight_scale_2", "input_scale"):
        return suffix
    if suffix == "weight_scale" and tensor.dtype == torch.float8_e4m3fn and tensor.dim() == 2:
        return suffix
    if suffix == "weight" and tensor.dtype == torch.uint8:
        return suffix
    return None


def nvfp4_weights(
    weights: Iterable[tuple[str, torch.Tensor]], device: torch.device, dtype: torch.dtype | None
) -> Iterator[tuple[str, torch.Tensor | Nvfp4Weight]]:
    """Yields each NVFP4 Linear as `X.weight`: dequantized on `device` in `dtype`, or with `dtype` None
    as its `Nvfp4Weight` moved to `device` as it is (the model places the codes; `copy_checkpoint_tensor`
    dequantizes one whose parameter is not NVFP4). Other tensors pass through.

    The parts of `X` may arrive in any order and in different shards: they wait in host memory (packed,
    0.56 B per weight) until `weight`, `weight_scale` and `weight_scale_2` are all there. ModelOpt writes
    a module's parts into one shard, so little waits; a checkpoint that put all codes in one shard and
    all scales in another would hold its whole packed weights here. `input_scale` is optional and
    dropped, also when it comes after its group was emitted. A group still incomplete when the
    stream ends, or a part seen twice, is a `ModelLoadError` naming the tensor. Dequantizing on `device`
    moves the packed bytes there instead of a 4x larger float copy.
    """
    waiting: dict[str, dict[str, torch.Tensor]] = {}
    emitted: set[str] = set()
    for name, tensor in weights:
        part = _part(name, tensor)
        if part is None:
            yield name, tensor
            continue
        prefix = name.removesuffix("." + part)
        if prefix in emitted:
            if part != "input_scale":
                raise ModelLoadError(f"NVFP4 tensor {name!r} appears twice in the checkpoint")
            continue
        group = waiting.setdefault(prefix, {})
        if part in group:
            raise ModelLoadError(f"NVFP4 tensor {name!r} appears twice in the checkpoint")
        group[part] = tensor
        if all(required in group for required in _REQUIRED):
            del waiting[prefix]
            emitted.add(prefix)
            weight, scale, scale_2 = (group[required].to(device) for required in _REQUIRED)
            try:
                packed = checked_nvfp4(weight, scale, scale_2)
            except ModelLoadError as error:
                raise ModelLoadError(f"NVFP4 tensor {prefix + '.weight'!r}: {error}") from None
            yield prefix + ".weight", packed if dtype is None else packed.dequantize(dtype)
    if waiting:
        prefix = min(waiting)
        present = sorted(waiting[prefix])
        lacking = next(required for required in _REQUIRED if required not in present)
        raise ModelLoadError(f"NVFP4 checkpoint lacks {prefix}.{lacking} (found only {', '.join(present)})")
