from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

from morion.cache.sequence_kv_cache import SequenceKVCache
from morion.loader.model_store import DEFAULT_MODEL, pull


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The real default model, pulled once into MORION_HOME (it is never downloaded twice)."""
    return pull(DEFAULT_MODEL, verify_existing=False)


def full_prefill_logits(model: torch.nn.Module, token_ids: Sequence[int]) -> torch.Tensor:
    """Logits for every position of one sequence through morion's own single-sequence path."""
    config = model.config
    cache = SequenceKVCache(
        config.num_layers,
        len(token_ids),
        config.num_kv_heads,
        config.head_dim,
        torch.float32,
        torch.device("cpu"),
    )
    cache.begin(len(token_ids))
    with torch.inference_mode():
        hidden = model(torch.tensor(token_ids), torch.arange(len(token_ids)), cache)
    cache.commit()
    return model.compute_logits(hidden)


def assert_same_greedy(
    ours: Sequence[int],
    reference: Sequence[int],
    reference_logits: Callable[[int], torch.Tensor],
    tie_gap: float,
) -> None:
    """Greedy continuations must match token for token. A divergence is accepted only where the
    reference's own logits show a near-tie (top-1 minus top-2 below `tie_gap`) at that step."""
    for step, (mine, theirs) in enumerate(zip(ours, reference, strict=False)):
        if mine == theirs:
            continue
        top2 = reference_logits(step).topk(2).values
        gap = (top2[0] - top2[1]).item()
        assert gap < tie_gap, (
            f"greedy diverged at step {step} ({mine} vs {theirs}) with a clear gap {gap:.4f}"
        )
        return
    assert len(ours) == len(reference), f"lengths differ: {len(ours)} vs {len(reference)}"


@pytest.fixture
def greedy_checker() -> Callable[..., None]:
    return assert_same_greedy


@pytest.fixture
def prefill_logits() -> Callable[..., torch.Tensor]:
    return full_prefill_logits
