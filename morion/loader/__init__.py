"""Model loading: resolve what the user named, read its config/tokenizer, build and fill the model."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from morion.errors import ModelLoadError
from morion.loader.gguf_loader import read_gguf
from morion.loader.model_store import DEFAULT_MODEL, KNOWN_MODELS, pull
from morion.loader.safetensors_loader import read_hf_directory
from morion.models.registry import build_model
from morion.progress import Progress
from morion.text.tokenizer import Tokenizer


class LoadedModel(NamedTuple):
    model: nn.Module
    tokenizer: Tokenizer | None
    hf_config: dict[str, Any]
    path: Path


def resolve_model_path(model: str | None) -> Path:
    """A path on disk, a known model name (pulled once), or nothing (the default model)."""
    if model is None or model in KNOWN_MODELS:
        return pull(model or DEFAULT_MODEL, verify_existing=False)
    path = Path(model).expanduser()
    if not path.exists():
        known = ", ".join(sorted(KNOWN_MODELS))
        raise ModelLoadError(f"model path does not exist: {model} (known model names: {known})")
    return path


def load_model(model: str | None, dtype: torch.dtype, device: torch.device) -> LoadedModel:
    path = resolve_model_path(model)
    if path.is_dir():
        source = read_hf_directory(path)
    elif path.is_file():
        source = read_gguf(path)  # checks the GGUF magic: any other file is reported as not a GGUF
    else:
        raise ModelLoadError(f"{path} is neither a model directory nor a file")
    module = build_model(source.hf_config, dtype, device)
    progress = Progress(f"loading {path.name}", source.num_tensors, " tensors")

    def counted(weights):
        for item in weights:
            yield item
            progress.advance()

    module.load_weights(counted(source.weights()))
    progress.finish()
    return LoadedModel(module, source.tokenizer, source.hf_config, path)
