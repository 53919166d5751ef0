"""morion: a serving runtime for large hybrid-attention mixture-of-experts language models."""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "__version__"]

# Imported on first use: `import morion.cli` (every command) and the server's front end before it starts
# the engine must not pay for torch (3 s on a 2-core CPU).
_LAZY = {"LLM": "morion.llm", "SamplingParams": "morion.engine.sampling_params"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'morion' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
