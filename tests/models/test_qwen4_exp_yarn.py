"""Static YaRN RoPE scaling end to end against transformers (fp32, CPU): Qwen3.8-Flash-Next (qwen4_exp) on
the tiny config of test_qwen4_exp_parity.py with `rope_parameters` of rope_type yarn (interleaved mRoPE
sections, text positions), and Qwen3-Next with the model card's `rope_scaling`. The pretraining context
is 64 tokens and the factor 4, so the prompts run well past it; the same models with plain RoPE, or
without YaRN's attention factor, give materially different logits, so the tests cannot pass vacuously."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from morion import LLM, SamplingParams
from morion.layers.rotary import RotaryEmbedding
from morion.loader import load_model
from tests.models.conftest import (
    CONFIGS,
    PagedRunner,
    check_decode_against_transformers_cache,
    check_llm_greedy_against_transformers,
    perturb,
)
from tests.models.test_qwen4_exp_parity import LOGIT_TOLERANCE, TINY, _max_diff, _perturb

ORIGINAL = 64
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}
QWEN4_EXP_YARN = dict(TINY, rope_parameters={**TINY["rope_parameters"], **YARN})


def _prompt(length: int, vocab_size: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(6, vocab_size, (length,), generator=generator).tolist()


@pytest.fixture(scope="module")
def qwen4_exp_yarn(tmp_path_factory):
    """(directory, transformers reference, our model), saved with save_pretrained."""
    torch.manual_seed(0)
    config = transformers.Qwen4ExpTextConfig(**QWEN4_EXP_YARN)
    reference = transformers.Qwen4ExpForCausalLM(config).eval()
    assert reference.model.rotary_emb.rope_type == "yarn" and reference.model.rotary_emb.attention_scaling > 1
    reference.generation_config.eos_token_id = None  # random models: generate every token asked for
    _perturb(reference)
    directory = tmp_path_factory.mktemp("qwen4_exp_yarn")
    reference.save_pretrained(directory)
    assert json.loads((directory / "config.json").read_text())["rope_parameters"]["rope_type"] == "yarn"
    ours = load_model(str(directory), torch.float32, torch.device("cpu")).model
    return directory, reference, ours


@pytest.mark.parametrize("length", (40, 150))
def test_qwen4_exp_prefill_logits_match_transformers(qwen4_exp_yarn, length):
    _, reference, ours = qwen4_exp_yarn
    prompt = _prompt(length, TINY["vocab_size"], seed=length)
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0]
    assert _max_diff(PagedRunner(ours).prefill(prompt), expected) < LOGIT_TOLERANCE


def test_qwen4_exp_decode_across_the_original_context(qwen4_exp_yarn):
    """Prefill to just below the original context, then decode token by token past it."""
    _, reference, ours = qwen4_exp_yarn
    prompt = _prompt(ORIGINAL - 4, TINY["vocab_size"], seed=1)
    continuation = _prompt(24, TINY["vocab_size"], seed=2)
    runner = PagedRunner(ours)
    check_decode_against_transformers_cache(runner, reference, prompt, continuation, LOGIT_TOLERANCE)


@pytest.mark.parametrize("without", ("yarn", "attention factor"))
def test_qwen4_exp_logits_need_yarn(qwen4_exp_yarn, monkeypatch, without):
    """Plain RoPE (the YaRN config ignored), or YaRN's frequencies without its cos/sin factor, moves
    the logits far beyond the tolerance the tests above hold."""
    _, reference, ours = qwen4_exp_yarn
    prompt = _prompt(150, TINY["vocab_size"], seed=150)
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0]
    rotary = ours.model.rotary
    # Swapped by hand: a submodule lives in `_modules`, where pytest >= 9.2's monkeypatch does not find
    # the old value to put back.
    try:
        if without == "yarn":
            plain = {"rope_type": "default", "rope_theta": TINY["rope_parameters"]["rope_theta"]}
            ours.model.rotary = RotaryEmbedding(rotary.rotary_dim, plain)
        else:
            monkeypatch.setattr(rotary, "attention_factor", 1.0)
        assert _max_diff(PagedRunner(ours).prefill(prompt), expected) > 100 * LOGIT_TOLERANCE
    finally:
        ours.model.rotary = rotary


def test_qwen4_exp_greedy_through_llm_matches_transformers(qwen4_exp_yarn, greedy_checker):
    """Through `morion.LLM` (paged K/V, prefill chunks of 32 that cross the original context)."""
    directory, reference, _ = qwen4_exp_yarn
    llm = LLM(model=str(directory), device="cpu", kv_cache_tokens=2048, page_size=8, chunk_size=32)
    prompts = [_prompt(120, TINY["vocab_size"], seed=100), _prompt(50, TINY["vocab_size"], seed=101)]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    check_llm_greedy_against_transformers(outputs, reference, prompts, greedy_checker)


# -- Qwen3-Next ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_next_yarn(tmp_path_factory):
    """(transformers reference, our model) for Qwen3-Next's tiny config with YaRN, its config.json
    rewritten in the released form: `rope_theta` and `partial_rotary_factor` at the top level and YaRN
    as `rope_scaling`, as the model card says to add it."""
    rope = {**CONFIGS["tiny"]["rope_parameters"], **YARN}
    torch.manual_seed(0)
    reference = transformers.Qwen3NextForCausalLM(
        transformers.Qwen3NextConfig(**{**CONFIGS["tiny"], "rope_parameters": rope})
    ).eval()
    perturb(reference)
    directory = tmp_path_factory.mktemp("qwen3_next_yarn")
    reference.save_pretrained(directory)
    config = json.loads((directory / "config.json").read_text())
    del config["rope_parameters"]
    config |= {"rope_theta": rope["rope_theta"], "partial_rotary_factor": rope["partial_rotary_factor"]}
    config["rope_scaling"] = dict(YARN)
    (directory / "config.json").write_text(json.dumps(config))
    # transformers reads the rewritten file as the config it was built from
    assert (
        transformers.AutoConfig.from_pretrained(directory).rope_parameters == reference.config.rope_parameters
    )
    return reference, load_model(str(directory), torch.float32, torch.device("cpu")).model


def test_qwen3_next_prefill_logits_match_transformers(qwen3_next_yarn, hybrid_backend, monkeypatch):
    reference, ours = qwen3_next_yarn
    prompt = _prompt(150, CONFIGS["tiny"]["vocab_size"], seed=7)
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0]
    assert _max_diff(hybrid_backend(ours).prefill(ours, prompt), expected) < LOGIT_TOLERANCE
    plain = {"rope_type": "default", "rope_theta": CONFIGS["tiny"]["rope_parameters"]["rope_theta"]}
    monkeypatch.setattr(ours.model, "rotary", RotaryEmbedding(ours.model.rotary.rotary_dim, plain))
    assert _max_diff(hybrid_backend(ours).prefill(ours, prompt), expected) > 100 * LOGIT_TOLERANCE
