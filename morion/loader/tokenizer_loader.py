"""The tokenizer alone, for processes that need text but not weights (the server's front end).

Reads the same sources as `load_model` (GGUF metadata or a Hugging Face directory's tokenizer files)
without dequantizing or reading any tensor data.
"""

from __future__ import annotations

from pathlib import Path

from morion.errors import ModelLoadError
from morion.loader.gguf_loader import read_gguf
from morion.loader.safetensors_loader import read_hf_directory
from morion.text.tokenizer import Tokenizer


def load_tokenizer(path: Path) -> Tokenizer | None:
    """`path` as `resolve_model_path` returns it; None for a weights-only directory."""
    if path.is_dir():
        return read_hf_directory(path).tokenizer
    if path.is_file():
        return read_gguf(path).tokenizer  # memory-maps the file; tensors are read only by weights()
    raise ModelLoadError(f"{path} is neither a model directory nor a .gguf file")
