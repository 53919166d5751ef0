"""Rules every architecture's `load_weights` shares: which checkpoint tensors carry nothing, how one is
copied in, and that nothing may be left unfilled."""

from __future__ import annotations

from collections.abc import Collection

import torch

from morion.errors import ModelLoadError


def carries_nothing(name: str, tie_word_embeddings: bool) -> bool:
    # Some tied checkpoints still store the shared matrix twice; old ones store RoPE frequencies.
    return (name == "lm_head.weight" and tie_word_embeddings) or name.endswith("rotary_emb.inv_freq")


def copy_checkpoint_tensor(name: str, tensor: torch.Tensor, target: torch.Tensor) -> None:
    if tuple(tensor.shape) != tuple(target.shape):
        shapes = f"{tuple(tensor.shape)}, expected {tuple(target.shape)}"
        raise ModelLoadError(f"checkpoint tensor {name!r} has shape {shapes}")
    with torch.no_grad():
        target.copy_(tensor)


def require_complete(missing: Collection[str]) -> None:
    if missing:
        raise ModelLoadError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[0]!r}")
