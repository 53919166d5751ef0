"""The tokenizer alone, for processes that need text but not weights (the server's front end).

Reads the same sources as `load_model` (GGUF metadata or a Hugging Face directory's tokenizer files)
without dequantizing or reading any tensor data.
"""

from __future__ import annotations

from pathlib import Path

from morion.loader.source import read_source
from morion.text.tokenizer import Tokenizer


def load_tokenizer(path: Path) -> Tokenizer | None:
    """`path` as `resolve_model_path` returns it; None for a weights-only directory."""
    return read_source(path, require_weights=False).tokenizer  # GGUF tensors are read only by weights()
