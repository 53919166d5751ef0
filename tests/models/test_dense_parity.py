"""Logits and greedy parity against transformers on tiny random dense models (fp32, CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from morion.engine.sampling_params import SamplingParams
from morion.loader import LoadedModel, load_model

# fp32 on tiny random models: only summation order differs from transformers.
LOGIT_TOLERANCE = 1e-4
TIE_GAP = 1e-3
PROMPT_LENGTHS = (1, 5, 17, 40)

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(
        **TINY,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "llama_tied": lambda: transformers.LlamaConfig(**TINY, tie_word_embeddings=True),
    "qwen2": lambda: transformers.Qwen2Config(**TINY, tie_word_embeddings=True),
    "qwen3": lambda: transformers.Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=False),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny_pair(request, tmp_path_factory) -> tuple[LoadedModel, torch.nn.Module]:
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(CONFIGS[request.param]()).eval()
    reference.generation_config.eos_token_id = None  # random models: generate all 32 tokens, as ours do
    # Random init leaves biases at zero; make them count.
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    directory: Path = tmp_path_factory.mktemp(request.param)
    reference.save_pretrained(directory)
    return load_model(str(directory), torch.float32, torch.device("cpu")), reference


def _prompt(length: int, vocab_size: int, seed: int) -> list[int]:
    return torch.randint(0, vocab_size, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("length", PROMPT_LENGTHS)
def test_prefill_logits_match_transformers(tiny_pair, prefill_logits, length):
    loaded, reference = tiny_pair
    ours = loaded.model
    prompt = _prompt(length, ours.config.vocab_size, seed=length)
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0]
    actual = prefill_logits(ours, prompt)
    assert (actual - expected).abs().max().item() < LOGIT_TOLERANCE


def test_greedy_continuation_matches_transformers(tiny_pair, greedy_checker, engine_factory, engine_runner):
    loaded, reference = tiny_pair
    engine = engine_factory(loaded)
    for seed in range(5):
        prompt = _prompt(3 + 4 * seed, loaded.model.config.vocab_size, seed=100 + seed)
        [output] = engine_runner(
            engine, [prompt], SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
        )
        ids = output.token_ids
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
