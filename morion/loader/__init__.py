"""Model loading (`load.py`) and what a model name means (`resolve.py`).

The names below are imported on first use: resolving a name needs no torch, and the server's front end
resolves the model and starts the engine process before it imports anything heavy.
"""

from __future__ import annotations

from morion.lazy import lazy_attributes

__all__ = ["LOAD_FORMATS", "LoadedModel", "load_model", "read_source", "resolve_model_path"]

__getattr__ = lazy_attributes(
    __name__,
    {
        "LOAD_FORMATS": "morion.loader.load",
        "LoadedModel": "morion.loader.load",
        "load_model": "morion.loader.load",
        "read_source": "morion.loader.source",
        "resolve_model_path": "morion.loader.resolve",
    },
)
