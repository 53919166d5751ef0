"""`morion.LLM` on the real default model: batching, text, stop strings, usage and rejected prompts."""

from __future__ import annotations

import pytest

from morion import LLM, SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Name a primary colour.",
    "Write one sentence about the sea.",
    "What is 2 + 2?",
    "Give me a synonym for happy.",
    "Which planet is known as the red planet? Explain briefly why it has that colour.",
    "Hi",
    "Translate 'good morning' into Spanish.",
]
# SmolLM2 in fp32: batched and single runs differ only in summation order.
TIE_GAP = 1e-3


@pytest.fixture(scope="module")
def llm(smollm2_gguf):
    return LLM(model=str(smollm2_gguf), device="cpu", kv_cache_tokens=16384)


@pytest.mark.slow
def test_batched_equals_single_on_smollm2(llm, greedy_checker, prefill_logits):
    prompts = [llm.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    params = SamplingParams(max_tokens=16, temperature=0.0)
    batched = llm.generate(prompts, params)
    for prompt, together in zip(prompts, batched, strict=True):
        [alone] = llm.generate([prompt], params)
        greedy_checker(
            together.token_ids,
            alone.token_ids,
            lambda step, p=prompt, a=alone: prefill_logits(llm.engine.model, p + a.token_ids[:step])[-1],
            TIE_GAP,
        )
    assert "Paris" in batched[0].text
    # Every single run repeated a batched prompt, so all reused cached pages.
    llm.engine.check_integrity()


def test_text_stop_strings_and_usage(llm):
    prompt = llm.encode_chat([{"role": "user", "content": "Count from 1 to 10, separated by commas."}])
    [free] = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0))
    assert "5" in free.text
    [stopped] = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0, stop=["5"]))
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[: free.text.index("5")]
    assert stopped.usage.prompt_tokens == len(prompt)
    assert stopped.usage.cached_tokens == (len(prompt) - 1) // 16 * 16
    assert stopped.usage.completion_tokens == len(stopped.token_ids)


def test_a_rejected_prompt_does_not_disturb_the_others(llm):
    too_long = [1] * (llm.engine.max_model_len + 5)
    ok = llm.encode("The sky is")
    outputs = llm.generate([ok, too_long, ok], SamplingParams(max_tokens=4, temperature=0.0))
    assert [o.finish_reason for o in outputs] == ["length", "error", "length"]
    assert "at most" in outputs[1].error
    assert outputs[0].token_ids == outputs[2].token_ids and len(outputs[0].token_ids) == 4


def test_stream_yields_the_same_text(llm):
    prompt = llm.encode("Once upon a time")
    params = SamplingParams(max_tokens=12, temperature=0.0)
    [whole] = llm.generate([prompt], params)
    pieces = list(llm.stream(prompt, params))
    assert "".join(p.new_text for p in pieces) == whole.text
    assert pieces[-1].finished and pieces[-1].final.token_ids == whole.token_ids


def test_leaving_a_with_block_closes_the_engine(monkeypatch):
    """`morion generate` relies on it to stop follower ranks before the interpreter exits."""
    from morion.engine.engine import Engine

    closed = []
    monkeypatch.setattr(Engine, "close", lambda engine: closed.append(engine))
    with LLM("preset:qwen3-next-tiny", device="cpu", kv_cache_tokens=256) as llm:
        [out] = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0))
        assert len(out.token_ids) == 2 and not closed
    assert closed == [llm.engine]
