"""What `--model` names: a path on disk, a known model (pulled once), a Hugging Face id, or nothing."""

from __future__ import annotations

from pathlib import Path

from morion.errors import ModelLoadError
from morion.loader.hf_hub import hub_snapshot, looks_like_hub_id
from morion.loader.model_store import DEFAULT_MODEL, KNOWN_MODELS, pull


def resolve_model_path(model: str | None) -> Path:
    """A path that exists wins over a Hugging Face id of the same spelling (`org/name` as a directory)."""
    if model is None or model in KNOWN_MODELS:
        return pull(model or DEFAULT_MODEL, verify_existing=False)
    path = Path(model).expanduser()
    if path.exists():
        return path
    if looks_like_hub_id(model):
        return hub_snapshot(model)
    known = ", ".join(sorted(KNOWN_MODELS))
    raise ModelLoadError(
        f"model path does not exist: {model} (known model names: {known}; a Hugging Face id is ORG/NAME)"
    )


def is_model_name(model: str | None) -> bool:
    """A name rather than a path: the default model, a known model or a Hugging Face id."""
    return (
        model is None
        or model in KNOWN_MODELS
        or (not Path(model).expanduser().exists() and looks_like_hub_id(model))
    )
