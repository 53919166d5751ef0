"""Architectures by Hugging Face `model_type`: the only place that maps a name to model code."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from morion.config import WEIGHT_DTYPES
from morion.errors import ModelLoadError
from morion.layers.fp8_convert import convert_to_fp8
from morion.models import qwen3_next_parallel, qwen4_exp_parallel
from morion.models.llama import DenseConfig, DenseForCausalLM
from morion.models.qwen3_next import Qwen3NextConfig, Qwen3NextForCausalLM
from morion.models.qwen4_exp import Qwen4ExpForCausalLM
from morion.models.qwen4_exp_config import Qwen4ExpConfig
from morion.parallel.group import TensorParallel

# model_type -> (config parser, model class)
_ARCHITECTURES: dict[str, tuple[Callable[[dict[str, Any]], Any], type[nn.Module]]] = {
    "llama": (DenseConfig.from_hf, DenseForCausalLM),
    "qwen2": (DenseConfig.from_hf, DenseForCausalLM),
    "qwen3": (DenseConfig.from_hf, DenseForCausalLM),
    "qwen3_next": (Qwen3NextConfig.from_hf, Qwen3NextForCausalLM),
    "qwen4_exp": (Qwen4ExpConfig.from_hf, Qwen4ExpForCausalLM),  # multimodal config: its text model
    "qwen4_exp_text": (Qwen4ExpConfig.from_hf, Qwen4ExpForCausalLM),
}
SUPPORTED_MODEL_TYPES = tuple(_ARCHITECTURES)
# model_type -> how it is split over tensor-parallel ranks (issue #28)
_TENSOR_PARALLEL = {
    "qwen3_next": qwen3_next_parallel,
    "qwen4_exp": qwen4_exp_parallel,
    "qwen4_exp_text": qwen4_exp_parallel,
}

logger = logging.getLogger(__name__)


def build_model(
    hf_config: dict[str, Any],
    dtype: torch.dtype,
    device: torch.device,
    weight_dtype: str = "auto",
    tensor_parallel: TensorParallel | None = None,
) -> nn.Module:
    """Constructs the architecture with uninitialised parameters; the loader fills them.

    `weight_dtype` "fp8" swaps linear layers and experts for FP8 ones before anything is allocated on
    `device`, except the modules the architecture lists in `fp8_keep`; "nvfp4" does the same with the
    routed experts in NVFP4; "auto" keeps everything in `dtype`. With `tensor_parallel` of more than one
    rank, the model is this rank's part (`tensor_split`).
    """
    if weight_dtype not in WEIGHT_DTYPES:
        raise ModelLoadError(f"unknown weight dtype {weight_dtype!r} (choose {', '.join(WEIGHT_DTYPES)})")
    model_type = hf_config.get("model_type")
    if model_type not in _ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported model_type {model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    parse_config, architecture = _ARCHITECTURES[model_type]
    config = parse_config(hf_config)
    split = tensor_split(model_type) if tensor_parallel is not None and tensor_parallel.size > 1 else None
    # Built on the meta device with the initialisers switched off: the loader fills every parameter, and
    # a meta initialiser's first call imports torch's reference decompositions (3 s on a 2-core CPU).
    with torch.device("meta"), _no_initialisers():
        model = architecture(split.local_config(config, tensor_parallel.size) if split else config)
        if split:
            split.split_lm_head(model, tensor_parallel.size)
        model = model.to(dtype)
    if weight_dtype in ("fp8", "nvfp4"):
        logger.info(convert_to_fp8(model, getattr(architecture, "fp8_keep", ()), weight_dtype).summary())
    if split:
        split.wire(model, tensor_parallel)
    # Not `to_empty`: its meta-to-device path imports sympy through torch's shape reasoning (1 s).
    model._apply(lambda meta: torch.empty(meta.shape, dtype=meta.dtype, device=device))
    return model.requires_grad_(False).eval()


def tensor_split(model_type: str) -> Any:
    """The module that splits `model_type` over tensor-parallel ranks (`local_config`, `shard_of`,
    `split_lm_head`, `wire`); a ModelLoadError where none does yet."""
    if model_type not in _TENSOR_PARALLEL:
        raise ModelLoadError(
            f"tensor parallelism is not supported for model_type {model_type!r} "
            f"(supported: {', '.join(_TENSOR_PARALLEL)})"
        )
    return _TENSOR_PARALLEL[model_type]


def architecture_config(hf_config: dict[str, Any]) -> Any:
    """The architecture's own config of `hf_config` (as build_model parses it)."""
    return _ARCHITECTURES[hf_config["model_type"]][0](hf_config)


# The in-place initialisers module constructors call (nn.Linear, nn.Embedding, ...).
_INITIALISERS = (
    "uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
    "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_",
)  # fmt: skip


@contextlib.contextmanager
def _no_initialisers() -> Iterator[None]:
    """`torch.nn.init`'s in-place initialisers return their tensor untouched while building a model."""
    saved = {name: getattr(nn.init, name) for name in _INITIALISERS}
    try:
        for name in _INITIALISERS:
            setattr(nn.init, name, _leave_as_is)
        yield
    finally:
        for name, function in saved.items():
            setattr(nn.init, name, function)


def _leave_as_is(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return tensor
