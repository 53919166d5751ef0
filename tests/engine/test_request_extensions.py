"""Engine features the protocol extensions stand on: `logit_bias`, `prompt_logprobs` (across chunked
prefill and despite a cached prefix) and `stop_reason`."""

from __future__ import annotations

import pytest
import torch

from morion.engine.sampler import RequestSampler, sample
from morion.engine.sampling_params import SamplingParams
from morion.errors import InvalidRequestError

PROMPT = [(7 * i + 3) % 128 for i in range(30)]


def test_logit_bias_moves_greedy_and_sampled_choices() -> None:
    logits = torch.tensor([[4.0, 3.0, 0.0, -1.0]])
    greedy = RequestSampler(SamplingParams(temperature=0), [1])
    banned = RequestSampler(SamplingParams(temperature=0, logit_bias=((0, -100.0),)), [1])
    forced = RequestSampler(SamplingParams(temperature=1.0, seed=3, logit_bias=((3, 100.0),)), [1])
    assert sample(logits, [greedy]).token_ids == [0]
    assert sample(logits, [banned]).token_ids == [1]
    assert sample(logits, [forced]).token_ids == [3]
    assert torch.equal(logits, torch.tensor([[4.0, 3.0, 0.0, -1.0]]))  # the input is left alone


@pytest.mark.parametrize(
    ("bias", "message"),
    [(((1, 101.0),), "logit_bias value must be in"), (((-1, 1.0),), "logit_bias token id must be >= 0")],
)
def test_bad_logit_bias_is_rejected(bias, message) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(logit_bias=bias)


def test_logit_bias_outside_the_vocabulary_is_rejected(tiny_llama, engine_factory) -> None:
    engine = engine_factory(tiny_llama)
    with pytest.raises(InvalidRequestError, match="logit_bias token id 500 is not in the vocabulary"):
        engine.add_request(PROMPT, SamplingParams(logit_bias=((500, 1.0),)))


def test_prompt_logprobs_equal_a_full_prefill(tiny_llama, engine_factory, engine_runner, prefill_logits):
    engine = engine_factory(tiny_llama, chunk_size=8, page_size=8)  # the prompt spans four chunks
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3)
    first, again = (engine_runner(engine, [PROMPT], params)[0] for _ in range(2))
    expected = prefill_logits(tiny_llama.model, PROMPT).log_softmax(dim=-1)
    for output in (first, again):  # the second would hit the prefix cache: it computes every token anyway
        entries = output.prompt_logprobs
        assert len(entries) == len(PROMPT) and entries[0] is None
        for position in range(1, len(PROMPT)):
            row, token = expected[position - 1], PROMPT[position]
            entry = entries[position]
            assert entry.logprob == pytest.approx(row[token].item(), abs=1e-4)
            assert entry.rank == int((row > row[token]).sum()) + 1
            values, ids = row.topk(3)
            assert [t for t, _ in entry.top] == ids.tolist()
            assert [lp for _, lp in entry.top] == pytest.approx(values.tolist(), abs=1e-4)
    assert again.usage.cached_tokens == 0
    plain = engine_runner(engine, [PROMPT], SamplingParams(max_tokens=2, temperature=0))[0]
    assert plain.prompt_logprobs is None and plain.usage.cached_tokens > 0
    assert plain.token_ids == first.token_ids


def test_stop_reason_names_the_stop(small_llama, engine_factory, engine_runner) -> None:
    engine = engine_factory(small_llama)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    [free] = engine_runner(engine, [PROMPT], greedy)
    assert free.finish_reason == "length" and free.stop_reason is None
    stop_id = free.token_ids[2]
    stopping = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, stop_token_ids=(stop_id,))
    [by_token] = engine_runner(engine, [PROMPT], stopping)
    assert by_token.finish_reason == "stop" and by_token.stop_reason == stop_id


@pytest.mark.parametrize("salt", ["", 7, "x" * 257])
def test_a_bad_cache_salt_is_rejected(salt) -> None:
    with pytest.raises(InvalidRequestError, match="cache_salt must be a non-empty string of at most 256"):
        SamplingParams(cache_salt=salt)
