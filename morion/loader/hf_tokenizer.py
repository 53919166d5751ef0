"""Tokenizer from a Hugging Face model directory: tokenizer.json + tokenizer_config.json (+ templates)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as FastTokenizer

from morion.errors import ModelLoadError
from morion.text.tokenizer import Tokenizer


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ModelLoadError(f"{path} is not valid JSON: {error}") from None


def _token_text(value: Any) -> str | None:
    # tokenizer_config stores special tokens either as strings or as AddedToken dicts.
    return value.get("content") if isinstance(value, dict) else value


def _chat_template(directory: Path, tokenizer_config: dict[str, Any]) -> str | None:
    template_file = directory / "chat_template.jinja"
    if template_file.is_file():
        return template_file.read_text()
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {entry["name"]: entry["template"] for entry in template}
        template = named.get("default") or next(iter(named.values()), None)
    return template


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def load_hf_tokenizer(directory: Path, model_config: dict[str, Any]) -> Tokenizer | None:
    """Returns None when the directory has no tokenizer.json (weights-only checkpoints)."""
    tokenizer_file = directory / "tokenizer.json"
    if not tokenizer_file.is_file():
        return None
    try:
        backend = FastTokenizer.from_file(str(tokenizer_file))
    except Exception as error:
        raise ModelLoadError(f"cannot read {tokenizer_file}: {error}") from None
    tokenizer_config = _read_json(directory / "tokenizer_config.json")
    generation_config = _read_json(directory / "generation_config.json")
    bos_token = _token_text(tokenizer_config.get("bos_token"))
    eos_token = _token_text(tokenizer_config.get("eos_token"))
    eos_ids = _as_ids(generation_config.get("eos_token_id")) or _as_ids(model_config.get("eos_token_id"))
    if eos_token is not None and (eos_id := backend.token_to_id(eos_token)) is not None:
        eos_ids.append(eos_id)
    return Tokenizer(backend, eos_ids, bos_token, eos_token, _chat_template(directory, tokenizer_config))
