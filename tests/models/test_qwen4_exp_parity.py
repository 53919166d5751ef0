"""Qwen3.8-Flash-Next (qwen4_exp) against transformers' Qwen4ExpForCausalLM on the tiny config of
model-architecture.md §5 (fp32, CPU): QSA's budget (16 tokens) is below the prompts, so block selection
really happens, and PLE sits at layer index 1. The model runs through the engine's own backend
(`PagedAttentionBackend` over a page pool and state slots), so the side cache of index keys, the K/V reads
and the PLE state are the ones the engine uses."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
import transformers

from morion import LLM, SamplingParams
from morion.loader import load_model
from tests.models.conftest import QWEN4_EXP_EOS as EOS
from tests.models.conftest import (
    QWEN4_EXP_TINY,
    PagedRunner,
    check_decode_against_transformers_cache,
    check_llm_greedy_against_transformers,
)

# fp32 on tiny random models: only summation order differs (chunked vs recurrent delta rule, the gathered
# vs masked attention). Measured: at most ~1e-6 on logits of magnitude ~2; using every block instead of
# the selection moves them by ~3e-2.
LOGIT_TOLERANCE = 1e-4
TINY = dict(
    QWEN4_EXP_TINY,
    # morion's defaults, set for transformers as well, and interleaved mRoPE sections (moot for text)
    linear_conv_kernel_dim=4,
    full_attention_interval=4,
    rope_parameters={
        **QWEN4_EXP_TINY["rope_parameters"],
        "mrope_section": [2, 3, 3],
        "mrope_interleaved": True,
    },
    ple_embed_dim=256,
    ple_conv_kernel_size=4,
    ngram_size=3,
    bos_token_id=EOS,
    tie_word_embeddings=False,
)


def _perturb(reference: torch.nn.Module) -> None:
    """transformers initialises norms at identity, the PLE conv at zero and decays at one scale: make every
    term count, so a swapped or dropped one changes the logits (scaled to magnitude ~2 by the head)."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in reference.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if "norm" in name:
                param.add_(noise * 0.2)
            elif name.endswith("A_log"):
                param.copy_(torch.empty(param.shape).uniform_(-5.8, 0.0, generator=generator))
            elif name.endswith("dt_bias"):
                param.copy_(noise * 0.5)
            elif name.endswith("conv1d.weight"):
                param.copy_(noise * 0.4)
            elif name == "lm_head.weight":
                param.mul_(4.0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(directory, transformers reference, our model) for the tiny config, saved with save_pretrained."""
    torch.manual_seed(0)
    reference = transformers.Qwen4ExpForCausalLM(transformers.Qwen4ExpTextConfig(**TINY)).eval()
    reference.generation_config.eos_token_id = None  # random models: generate every token asked for
    _perturb(reference)
    directory = tmp_path_factory.mktemp("qwen4_exp_tiny")
    reference.save_pretrained(directory)
    return directory, reference, load_model(str(directory), torch.float32, torch.device("cpu")).model


def _prompt(length: int, seed: int, eos_at: Sequence[int] = ()) -> list[int]:
    """Random ids; EOS at `eos_at`, so PLE's n-gram contexts are cut there."""
    ids = torch.randint(6, TINY["vocab_size"], (length,), generator=torch.Generator().manual_seed(seed))
    for position in eos_at:
        ids[position] = EOS
    return ids.tolist()


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


@pytest.mark.parametrize("length", (1, 7, 40, 70))
def test_prefill_logits_match_transformers(checkpoint, length):
    _, reference, ours = checkpoint
    prompt = _prompt(length, seed=length, eos_at=(5, 6, 30) if length > 30 else ())
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0]
    assert _max_diff(PagedRunner(ours).prefill(prompt), expected) < LOGIT_TOLERANCE


def test_block_selection_changes_the_answer(checkpoint, monkeypatch):
    """The tests above would pass with dense attention unless the selection matters: it does."""
    _, reference, ours = checkpoint
    prompt = _prompt(70, seed=70)
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0]
    for layer in ours.model.layers:
        if layer.layer_type == "sparse_attention":
            monkeypatch.setattr(layer.self_attn, "block_topk", 64)  # every block
    assert _max_diff(PagedRunner(ours).prefill(prompt), expected) > 100 * LOGIT_TOLERANCE, "selection is moot"


def test_decode_logits_match_transformers_cache(checkpoint):
    _, reference, ours = checkpoint
    prompt = _prompt(11, seed=1)
    continuation = _prompt(30, seed=2, eos_at=(3, 4, 12))
    runner = PagedRunner(ours)
    check_decode_against_transformers_cache(runner, reference, prompt, continuation, LOGIT_TOLERANCE)


@pytest.mark.parametrize("chunk", (7, 16))
def test_chunked_prefill_equals_unchunked(checkpoint, chunk):
    _, _, ours = checkpoint
    prompt = _prompt(60, seed=3, eos_at=(15,))
    whole = PagedRunner(ours).prefill(prompt)
    assert _max_diff(PagedRunner(ours).prefill(prompt, chunk=chunk), whole) < LOGIT_TOLERANCE


def test_sequences_batched_equal_each_alone(checkpoint):
    """Prefills of different lengths in one flat batch, decode steps together, a prefill chunk next to
    decodes, then another order with one sequence absent."""
    _, _, ours = checkpoint
    prompts = {0: _prompt(9, 10), 1: _prompt(45, 11, eos_at=(20,)), 2: _prompt(26, 12)}
    steps = [dict(prompts)]
    steps += [{seq: _prompt(1, 20 + 3 * step + seq) for seq in prompts} for step in range(3)]
    steps.append({0: _prompt(1, 40), 1: _prompt(1, 41), 2: _prompt(13, 42)})
    steps.append({2: _prompt(1, 50), 0: _prompt(5, 51)})

    batched = PagedRunner(ours, num_sequences=3)
    logits: dict[int, list[torch.Tensor]] = {seq: [] for seq in prompts}
    for step in steps:
        for seq, rows in batched.run(step).items():
            logits[seq].append(rows)
    for seq in prompts:
        alone = PagedRunner(ours).prefill([t for step in steps for t in step.get(seq, [])])
        assert _max_diff(torch.cat(logits[seq]), alone) < LOGIT_TOLERANCE, f"sequence {seq}"


def test_greedy_through_llm_matches_transformers(checkpoint, greedy_checker):
    """The checkpoint as users load it (HF names, the n-gram table in `shard_{i}` tensors), through
    `morion.LLM`: continuous batching, paged K/V, chunked prefill."""
    directory, reference, _ = checkpoint
    llm = LLM(model=str(directory), device="cpu", kv_cache_tokens=2048, page_size=8, chunk_size=32)
    prompts = [_prompt(50, seed=100, eos_at=(10,)), _prompt(13, seed=101)]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    check_llm_greedy_against_transformers(outputs, reference, prompts, greedy_checker)
