"""Qwen3-Next at tensor-parallel size 2 over gloo, two real processes on the CPU, against the same weights
at one rank (a checkpoint, and random weights of the same seed): logits within fp32 tolerance through a
prefill and greedy decode steps (the Gated DeltaNet and attention state carried per rank), and the same
greedy continuation."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.multiprocessing as mp

from morion.loader import load_model
from morion.parallel.group import TensorParallel
from tests.models.conftest import ReferenceHybridBackend
from tests.ports import free_port

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


def _rank(rank: int, port: int, sources: dict[str, tuple[str, str]], prompt: list[int], out: str) -> None:
    group = TensorParallel.join(rank, SIZE, torch.device("cpu"), f"tcp://127.0.0.1:{port}")
    try:
        for source, (directory, load_format) in sources.items():
            loaded = load_model(
                directory, torch.float32, torch.device("cpu"), load_format, tensor_parallel=group
            )
            experts = loaded.model.model.layers[0].mlp.experts.down_proj.shape
            torch.save((experts, *_generate(loaded.model, prompt)), Path(out) / f"{source}-rank{rank}.pt")
    finally:
        group.leave()


def test_two_ranks_compute_what_one_does(qwen3_next_checkpoint, tiny_qwen3_next_config_dir, tmp_path):
    directory, _ = qwen3_next_checkpoint("tiny")
    sources = {"checkpoint": (str(directory), "auto"), "random": (str(tiny_qwen3_next_config_dir), "dummy")}
    prompt = torch.randint(0, 512, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(7)).tolist()
    mp.spawn(_rank, args=(free_port(), sources, prompt, str(tmp_path)), nprocs=SIZE, join=True)
    for source, (model_dir, load_format) in sources.items():
        whole = load_model(model_dir, torch.float32, torch.device("cpu"), load_format).model
        _compare(whole, prompt, [tmp_path / f"{source}-rank{rank}.pt" for rank in range(SIZE)])


def _compare(whole: torch.nn.Module, prompt: list[int], rank_files: list[Path]) -> None:
    prefill, steps, tokens = _generate(whole, prompt)
    whole_experts = whole.model.layers[0].mlp.experts.down_proj.shape
    for rank_file in rank_files:
        experts, rank_prefill, rank_steps, rank_tokens = torch.load(rank_file)
        assert experts[-1] * SIZE == whole_experts[-1]  # each rank holds half of every expert
        assert rank_prefill.shape == prefill.shape  # the whole vocabulary, gathered
        assert (rank_prefill - prefill).abs().max() < LOGIT_TOLERANCE
        for rank_step, step in zip(rank_steps, steps, strict=True):
            assert (rank_step - step).abs().max() < LOGIT_TOLERANCE
        assert rank_tokens == tokens
