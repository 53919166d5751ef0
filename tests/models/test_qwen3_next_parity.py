"""Qwen3-Next against transformers' Qwen3NextForCausalLM on tiny random configs (fp32, CPU), and the
hybrid state handling (chunked prefill, mixed batches) against unchunked single-sequence runs."""

from __future__ import annotations

import pytest
import torch

# fp32 on tiny random models: only summation order (and chunked vs recurrent delta rule) differs.
# Measured: at most ~2e-6 on logits of magnitude ~2.
LOGIT_TOLERANCE = 1e-4
TIE_GAP = 1e-3


@pytest.fixture(scope="module", params=["tiny", "odd"])
def qwen3_next_pair(request, qwen3_next_checkpoint, build_qwen3_next):
    directory, reference = qwen3_next_checkpoint(request.param)
    return build_qwen3_next(directory), reference


def _prompt(length: int, vocab_size: int, seed: int) -> list[int]:
    return torch.randint(0, vocab_size, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


@pytest.mark.parametrize("length", (1, 5, 40, 130))
def test_prefill_logits_match_transformers(qwen3_next_pair, hybrid_backend, length):
    ours, reference = qwen3_next_pair
    prompt = _prompt(length, ours.config.vocab_size, seed=length)
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0]
    actual = hybrid_backend(ours).prefill(ours, prompt)
    assert _max_diff(actual, expected) < LOGIT_TOLERANCE


def test_decode_logits_match_transformers_cache(qwen3_next_pair, hybrid_backend):
    ours, reference = qwen3_next_pair
    prompt = _prompt(11, ours.config.vocab_size, seed=1)
    continuation = _prompt(24, ours.config.vocab_size, seed=2)
    backend = hybrid_backend(ours)
    with torch.no_grad():
        out = reference(torch.tensor([prompt]), use_cache=True)
        assert _max_diff(backend.prefill(ours, prompt), out.logits[0]) < LOGIT_TOLERANCE
        cache = out.cache
        for token in continuation:
            out = reference(torch.tensor([[token]]), cache=cache, use_cache=True)
            cache = out.cache
            assert _max_diff(backend.run(ours, {0: [token]})[0], out.logits[0]) < LOGIT_TOLERANCE


@pytest.mark.parametrize("chunk", (7, 16, 64))
def test_chunked_prefill_equals_unchunked(qwen3_next_pair, hybrid_backend, chunk):
    ours, _ = qwen3_next_pair
    prompt = _prompt(150, ours.config.vocab_size, seed=3)
    whole = hybrid_backend(ours).prefill(ours, prompt)
    chunked = hybrid_backend(ours).prefill(ours, prompt, chunk=chunk)
    assert _max_diff(chunked, whole) < LOGIT_TOLERANCE


def test_mixed_batch_equals_each_sequence_alone(qwen3_next_pair, hybrid_backend):
    """Prefills of mixed lengths in one flat batch, then decode-only steps, then prefill chunks and
    decodes together, then the sequences in another order, one of them with no new tokens."""
    ours, _ = qwen3_next_pair
    vocab = ours.config.vocab_size
    prompts = {0: _prompt(5, vocab, 10), 1: _prompt(23, vocab, 11), 2: _prompt(70, vocab, 12)}
    steps = [dict(prompts)]
    steps += [{seq: _prompt(1, vocab, 20 + 3 * step + seq) for seq in prompts} for step in range(3)]
    steps.append({0: _prompt(1, vocab, 40), 1: _prompt(9, vocab, 41), 2: _prompt(1, vocab, 42)})
    steps.append({2: _prompt(3, vocab, 50), 1: [], 0: _prompt(1, vocab, 51)})

    batched = hybrid_backend(ours, num_sequences=3)
    logits: dict[int, list[torch.Tensor]] = {seq: [] for seq in prompts}
    for step in steps:
        for seq, rows in batched.run(ours, step).items():
            logits[seq].append(rows)
    for seq in prompts:
        tokens = [t for step in steps for t in step.get(seq, [])]
        alone = hybrid_backend(ours).prefill(ours, tokens)
        assert _max_diff(torch.cat(logits[seq]), alone) < LOGIT_TOLERANCE, f"sequence {seq}"


def test_greedy_continuation_matches_transformers(qwen3_next_pair, hybrid_backend, greedy_checker):
    ours, reference = qwen3_next_pair
    for seed in range(4):
        prompt = _prompt(3 + 6 * seed, ours.config.vocab_size, seed=100 + seed)
        backend = hybrid_backend(ours)
        last = backend.prefill(ours, prompt)[-1]
        ids = []
        for _ in range(32):
            ids.append(int(last.argmax()))
            last = backend.run(ours, {0: ids[-1:]})[0][-1]
        with torch.no_grad():
            out = reference.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=32,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
        expected = out.sequences[0, len(prompt) :].tolist()
        greedy_checker(ids, expected, lambda step, out=out: out.logits[step][0], TIE_GAP)
