"""Hugging Face model ids (`Qwen/Qwen3-0.6B`): found in the local Hugging Face cache, else downloaded.

The cache is huggingface_hub's: `models--ORG--NAME/snapshots/<commit>/...`, with `refs/main` naming the
commit, under `HF_HUB_CACHE`, else `HF_HOME/hub`, else `XDG_CACHE_HOME/huggingface/hub`, else
`~/.cache/huggingface/hub`. A cached snapshot is used as it is, with no network. An id that is not cached
is downloaded with huggingface_hub (only the files morion reads: config, tokenizer, template, safetensors
shards) unless `HF_HUB_OFFLINE` is set; when neither works, the one error line says both.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from morion.errors import ModelLoadError

# What morion reads from a model repository (loader/safetensors_loader.py, loader/hf_tokenizer.py).
DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "*.jinja"]
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


def looks_like_hub_id(model: str) -> bool:
    return _HUB_ID.fullmatch(model) is not None and ".." not in model


def hub_cache_dir() -> Path:
    """Read from the environment at each call (huggingface_hub reads it once, when first imported)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser()
    return cache / "huggingface" / "hub"


def hub_snapshot(repo_id: str) -> Path:
    """The local snapshot directory of `repo_id` at its `main` revision, downloading it if needed."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    cache = hub_cache_dir()
    try:
        return Path(snapshot_download(repo_id, cache_dir=cache, local_files_only=True))
    except LocalEntryNotFoundError:
        pass  # not cached: try the hub
    not_cached = f"and it is not in the local Hugging Face cache ({cache})"
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        raise ModelLoadError(f"HF_HUB_OFFLINE is set, so {repo_id} cannot be downloaded, {not_cached}")
    try:
        return Path(snapshot_download(repo_id, cache_dir=cache, allow_patterns=DOWNLOAD_PATTERNS))
    except LocalEntryNotFoundError as error:  # huggingface_hub's answer when the hub cannot be reached
        raise ModelLoadError(
            f"could not reach the Hugging Face hub to download {repo_id} ({_reason(error)}), {not_cached}"
        ) from None
    except HfHubHTTPError as error:  # not found, gated, private...
        reason = _reason(error)
        raise ModelLoadError(f"the Hugging Face hub refused {repo_id} ({reason}), {not_cached}") from None


def _reason(error: Exception) -> str:
    text = str(error).strip()
    cause = re.search(r"Got: ([^\n]+)", text)
    return (cause.group(1) if cause else text.splitlines()[0] if text else type(error).__name__)[:200]
