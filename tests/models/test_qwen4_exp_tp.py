"""Qwen3.8-Flash-Next at tensor-parallel size 2 over gloo, two real processes on the CPU, against the same
seeded random weights at one rank: logits within fp32 tolerance through a chunked prefill past the QSA
budget (blocks selected by the replicated indexer), greedy decode steps and a verify step (QSA's static
path, PLE hashed on the device, Gated DeltaNet's state per verify position), with each rank's K/V, side
caches and state of its own; and the same greedy continuation."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.multiprocessing as mp

from morion.loader import load_model
from morion.parallel.group import TensorParallel
from tests.models.conftest import QWEN4_EXP_TINY, QWEN4_EXP_TINY_CONFIG, PagedRunner, qwen4_exp_prompts
from tests.ports import free_port

SIZE = 2
DECODE_STEPS = 6
PREFILL_CHUNK = 16
LOGIT_TOLERANCE = 1e-4  # fp32: the ranks' partial sums add in another order than one rank's sums
VERIFY_TAIL = [11, 12]  # the verify step's drafts after the last greedy token (any tokens do)


def _generate(model: torch.nn.Module, prompt: list[int]) -> tuple[list[torch.Tensor], list[int]]:
    """Every forward's logits and the greedy tokens: the prefill in chunks, decode steps, one verify."""
    runner = PagedRunner(model, drafts=len(VERIFY_TAIL))
    prefill = runner.prefill(prompt, PREFILL_CHUNK)
    logits, tokens = [prefill], [int(prefill[-1].argmax())]
    for _ in range(DECODE_STEPS):
        logits.append(runner.run({0: [tokens[-1]]})[0])
        tokens.append(int(logits[-1][-1].argmax()))
    logits.append(runner.run({0: [tokens[-1], *VERIFY_TAIL]}, verify=True)[0])
    return logits, tokens


def _rank(rank: int, port: int, model_dir: str, prompt: list[int], out: str) -> None:
    group = TensorParallel.join(rank, SIZE, torch.device("cpu"), f"tcp://127.0.0.1:{port}")
    try:
        cpu = torch.device("cpu")
        model = load_model(model_dir, torch.float32, cpu, "dummy", tensor_parallel=group).model
        heads = (model.config.num_heads, model.config.linear_num_value_heads)
        torch.save((heads, *_generate(model, prompt)), Path(out) / f"rank{rank}.pt")
    finally:
        group.leave()


def test_two_ranks_compute_what_one_does(tmp_path):
    model_dir = tmp_path / "config"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(QWEN4_EXP_TINY_CONFIG))
    [prompt] = qwen4_exp_prompts(1, seed=5, lengths=(45, 45))
    assert len(prompt) > QWEN4_EXP_TINY["indexer_budget"] + QWEN4_EXP_TINY["indexer_compress_ratio"]
    mp.spawn(_rank, args=(free_port(), str(model_dir), prompt, str(tmp_path)), nprocs=SIZE, join=True)
    whole = load_model(str(model_dir), torch.float32, torch.device("cpu"), "dummy").model
    logits, tokens = _generate(whole, prompt)
    whole_heads = (whole.config.num_heads, whole.config.linear_num_value_heads)
    for rank in range(SIZE):
        heads, rank_logits, rank_tokens = torch.load(tmp_path / f"rank{rank}.pt")
        assert tuple(SIZE * h for h in heads) == whole_heads  # each rank holds half of the heads
        for got, want in zip(rank_logits, logits, strict=True):
            assert got.shape == want.shape  # the whole vocabulary, gathered
            assert (got - want).abs().max() < LOGIT_TOLERANCE
        assert rank_tokens == tokens
