"""Hugging Face model directories: config.json + *.safetensors shards (+ tokenizer files)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from safetensors import safe_open

if TYPE_CHECKING:  # torch only in annotations: safe_open imports it when weights are read
    import torch

from morion.errors import ModelLoadError
from morion.loader.hf_tokenizer import load_hf_tokenizer
from morion.text.tokenizer import Tokenizer


class HFDirectory(NamedTuple):
    hf_config: dict[str, Any]
    tokenizer: Tokenizer | None
    shards: list[Path]
    num_tensors: int

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for shard in self.shards:
            with safe_open(str(shard), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                    yield name, f.get_tensor(name)


def read_hf_directory(directory: Path, require_weights: bool = True) -> HFDirectory:
    """Without `require_weights` (random-weight loading) a directory with only config.json will do."""
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{directory} has no config.json")
    try:
        hf_config = json.loads(config_path.read_text())
    except json.JSONDecodeError as error:
        raise ModelLoadError(f"{config_path} is not valid JSON: {error}") from None
    shards = sorted(directory.glob("*.safetensors"))
    if not shards and require_weights:
        raise ModelLoadError(f"{directory} has no *.safetensors weights")
    try:
        num_tensors = 0
        for shard in shards:
            with safe_open(str(shard), framework="pt") as f:
                num_tensors += len(f.keys())
    except Exception as error:
        raise ModelLoadError(f"cannot read safetensors shard in {directory}: {error}") from None
    return HFDirectory(hf_config, load_hf_tokenizer(directory, hf_config), shards, num_tensors)
