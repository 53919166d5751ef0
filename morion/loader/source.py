"""What a model path holds: a Hugging Face directory or a GGUF file, read without importing torch (the
server's front end reads its tokenizer here; the weights are read lazily, in the engine)."""

from __future__ import annotations

from pathlib import Path

from morion.errors import ModelLoadError
from morion.loader.gguf_loader import GGUFModel, read_gguf
from morion.loader.safetensors_loader import HFDirectory, read_hf_directory


def read_source(path: Path, require_weights: bool = True) -> HFDirectory | GGUFModel:
    """Config, tokenizer and (lazy) weights of a model directory or a GGUF file."""
    if path.is_dir():
        return read_hf_directory(path, require_weights)
    if path.is_file():
        return read_gguf(path)  # checks the GGUF magic: any other file is reported as not a GGUF
    raise ModelLoadError(f"{path} is neither a model directory nor a file")
