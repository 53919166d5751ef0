"""Model loading (`load.py`) and what a model name means (`resolve.py`).

The names below are imported on first use: resolving a name needs no torch, and the server's front end
resolves the model and starts the engine process before it imports anything heavy.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["LOAD_FORMATS", "LoadedModel", "load_model", "read_source", "resolve_model_path"]

_HOMES = {
    "LOAD_FORMATS": "morion.loader.load",
    "LoadedModel": "morion.loader.load",
    "load_model": "morion.loader.load",
    "read_source": "morion.loader.load",
    "resolve_model_path": "morion.loader.resolve",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'morion.loader' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value
