"""The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF): morion against transformers' GGUF loader."""

from __future__ import annotations

import pytest
import torch
import transformers

from morion.engine.sampling_params import SamplingParams
from morion.loader import load_model

# Both sides dequantize the same Q4_1 blocks to fp32; only summation order differs over 30 layers, and
# logits here span about +-30, so 2e-3 absolute is a few ulps of accumulated fp32 rounding.
LOGIT_TOLERANCE = 2e-3
TIE_GAP = 2 * LOGIT_TOLERANCE

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "List three colours of the rainbow:",
    "Water boils at a temperature of",
]


@pytest.fixture(scope="module")
def models(smollm2_gguf):
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
    ).eval()
    loaded = load_model(str(smollm2_gguf), torch.float32, torch.device("cpu"))
    return loaded, reference


@pytest.mark.slow
def test_prefill_logits_match_transformers(models, prefill_logits):
    loaded, reference = models
    for prompt in [*PROMPTS[:3], "Hi", PROMPTS[2] * 6]:
        ids = loaded.tokenizer.encode(prompt)
        with torch.no_grad():
            expected = reference(torch.tensor([ids])).logits[0]
        difference = (prefill_logits(loaded.model, ids) - expected).abs().max().item()
        assert difference < LOGIT_TOLERANCE, f"{prompt[:30]!r}: max |dlogit| {difference}"


@pytest.mark.slow
def test_greedy_continuations_match_transformers(models, greedy_checker, engine_factory, engine_runner):
    loaded, reference = models
    engine = engine_factory(loaded)
    for prompt in PROMPTS:
        ids = loaded.tokenizer.encode(prompt)
        [output] = engine_runner(
            engine, [ids], SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
        )
        ours = output.token_ids
        with torch.no_grad():
            out = reference.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=32,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                eos_token_id=None,
                pad_token_id=-1,
            )
        expected = out.sequences[0, len(ids) :].tolist()
        greedy_checker(ours, expected, lambda step, out=out: out.logits[step][0], TIE_GAP)
