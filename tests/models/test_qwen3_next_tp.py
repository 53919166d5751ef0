"""Qwen3-Next at tensor-parallel size 2 over gloo, two real processes on the CPU, against the same
checkpoint at one rank: logits within fp32 tolerance through a prefill and greedy decode steps (the
Gated DeltaNet and attention state carried per rank), and the same greedy continuation."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.multiprocessing as mp

from morion.loader import load_model
from morion.parallel.group import TensorParallel
from tests.models.conftest import ReferenceHybridBackend
from tests.server.conftest import free_port

SIZE = 2
PROMPT_TOKENS = 40
DECODE_STEPS = 8
LOGIT_TOLERANCE = 1e-4  # fp32: the ranks' partial sums add in another order than one rank's sums


def _generate(
    model: torch.nn.Module, prompt: list[int]
) -> tuple[torch.Tensor, list[torch.Tensor], list[int]]:
    """Prefill logits, each decode step's logits and the greedy tokens, through the reference backend."""
    backend = ReferenceHybridBackend(model.cache_spec(16, torch.float32), 1, torch.device("cpu"))
    with torch.no_grad():
        prefill = backend.prefill(model, prompt)
        tokens, steps = [int(prefill[-1].argmax())], []
        for _ in range(DECODE_STEPS):
            steps.append(backend.run(model, {0: [tokens[-1]]})[0][-1])
            tokens.append(int(steps[-1].argmax()))
    return prefill, steps, tokens


def _rank(rank: int, port: int, directory: str, prompt: list[int], out: str) -> None:
    group = TensorParallel.join(rank, SIZE, torch.device("cpu"), f"tcp://127.0.0.1:{port}")
    try:
        model = load_model(directory, torch.float32, torch.device("cpu"), tensor_parallel=group).model
        experts = model.model.layers[0].mlp.experts.down_proj.shape
        torch.save((experts, *_generate(model, prompt)), Path(out) / f"rank{rank}.pt")
    finally:
        group.leave()


def test_two_ranks_compute_what_one_does(qwen3_next_checkpoint, build_qwen3_next, tmp_path):
    directory, _ = qwen3_next_checkpoint("tiny")
    whole = build_qwen3_next(directory)
    prompt = torch.randint(
        0, whole.config.vocab_size, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(7)
    )
    prompt = prompt.tolist()
    mp.spawn(_rank, args=(free_port(), str(directory), prompt, str(tmp_path)), nprocs=SIZE, join=True)
    prefill, steps, tokens = _generate(whole, prompt)
    whole_experts = whole.model.layers[0].mlp.experts.down_proj.shape
    for rank in range(SIZE):
        experts, rank_prefill, rank_steps, rank_tokens = torch.load(tmp_path / f"rank{rank}.pt")
        assert experts[-1] * SIZE == whole_experts[-1]  # each rank holds half of every expert
        assert rank_prefill.shape == prefill.shape  # the whole vocabulary, gathered
        assert (rank_prefill - prefill).abs().max() < LOGIT_TOLERANCE
        for rank_step, step in zip(rank_steps, steps, strict=True):
            assert (rank_step - step).abs().max() < LOGIT_TOLERANCE
        assert rank_tokens == tokens
