"""Architectures by Hugging Face `model_type`: the only place that maps a name to model code."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from morion.errors import ModelLoadError
from morion.models.llama import DenseConfig, DenseForCausalLM

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


def build_model(hf_config: dict[str, Any], dtype: torch.dtype, device: torch.device) -> nn.Module:
    """Constructs the architecture with uninitialised parameters; the loader fills them."""
    model_type = hf_config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"unsupported model_type {model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    config = DenseConfig.from_hf(hf_config)
    # Building on the meta device skips random initialisation, which costs more than loading.
    with torch.device("meta"):
        model = DenseForCausalLM(config).to(dtype)
    return model.to_empty(device=device).requires_grad_(False).eval()
