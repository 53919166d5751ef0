"""A request whose own sampling or output handling raises fails alone; the others in its batches finish
exactly as they do alone (issue 21, item 2). And the two sampling inputs that used to break a batch:
top_k past 2**63 and a temperature that underflows fp32."""

from __future__ import annotations

import pytest

import morion.engine.sampler as sampler
from morion.engine.sampling_params import SamplingParams

PROMPTS = [[1, 5, 9, 13], [2, 4, 8, 16, 32], [7, 7, 3], [11, 12, 13, 14, 15, 16]]
FAILING_SEED = 999
NEIGHBOURS = [
    SamplingParams(max_tokens=6, temperature=0.9, seed=1, ignore_eos=True),
    SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=6, temperature=1.2, top_k=20, top_p=0.9, seed=2, ignore_eos=True),
]


@pytest.fixture
def engine(tiny_llama, engine_factory):
    return engine_factory(tiny_llama)


def _alone(engine, engine_runner) -> list[list[int]]:
    return [
        engine_runner(engine, [prompt], params)[0].token_ids
        for prompt, params in zip(PROMPTS, NEIGHBOURS, strict=False)
    ]


def _run_together(engine, failing: SamplingParams, after_steps: int):
    """Starts the neighbours, steps `after_steps` times, adds the failing request, runs all to the end;
    returns the finals by request id."""
    ids = [engine.add_request(p, params) for p, params in zip(PROMPTS, NEIGHBOURS, strict=False)]
    finals = {}
    for _ in range(after_steps):
        for step in engine.step():
            assert step.final is None
    failing_id = engine.add_request(PROMPTS[3], failing)
    while engine.has_unfinished():
        for step in engine.step():
            if step.final is not None:
                finals[step.request_id] = step.final
    return [finals[i] for i in ids], finals[failing_id]


def test_a_request_whose_sampling_raises_fails_alone(engine, engine_runner, monkeypatch):
    alone = _alone(engine, engine_runner)
    real = sampler.sampling_probs

    def failing(scores, params):
        if any(p.seed == FAILING_SEED for p in params):
            raise RuntimeError("planted: this request's sampling fails")
        return real(scores, params)

    monkeypatch.setattr(sampler, "sampling_probs", failing)
    failing_params = SamplingParams(max_tokens=6, temperature=0.7, seed=FAILING_SEED)
    neighbours, failed = _run_together(engine, failing_params, after_steps=3)
    assert [final.token_ids for final in neighbours] == alone
    assert all(final.finish_reason == "length" for final in neighbours)
    assert failed.finish_reason == "error" and failed.token_ids == []
    assert "planted" not in failed.error and "server log" in failed.error
    engine.check_integrity()  # the failed request's pages went back


def test_a_request_whose_token_handling_raises_fails_alone(engine, engine_runner, monkeypatch):
    """An error after sampling, while its token is taken (a grammar's accept, the detokenizer, stop
    strings)."""
    alone = _alone(engine, engine_runner)
    real = sampler.RequestSampler.append

    def append(self, token_id):
        if self.params.seed == FAILING_SEED:
            raise RuntimeError("planted: this request's token handling fails")
        real(self, token_id)

    monkeypatch.setattr(sampler.RequestSampler, "append", append)
    failing_params = SamplingParams(max_tokens=6, temperature=0.0, seed=FAILING_SEED)
    neighbours, failed = _run_together(engine, failing_params, after_steps=2)
    assert [final.token_ids for final in neighbours] == alone
    assert failed.finish_reason == "error" and "planted" not in failed.error
    engine.check_integrity()


def test_top_k_beyond_the_vocabulary_keeps_all_of_it(engine, engine_runner):
    # torch.tensor([2**63]) overflows: this used to fail the whole batch inside the engine step.
    params = [
        SamplingParams(max_tokens=8, temperature=1.0, seed=5, top_k=top_k, ignore_eos=True)
        for top_k in (0, 2**63, 10**30)
    ]
    outputs = engine_runner(engine, [PROMPTS[0]] * 3, params)
    assert outputs[1].token_ids == outputs[0].token_ids == outputs[2].token_ids


def test_a_temperature_too_small_for_fp32_is_greedy(engine, engine_runner):
    # 1e-300 is 0 in fp32, and dividing by it made every probability NaN: the tokens were garbage.
    greedy, tiny, small = engine_runner(
        engine,
        [PROMPTS[1]] * 3,
        [SamplingParams(max_tokens=10, temperature=t, seed=3, ignore_eos=True) for t in (0.0, 1e-300, 1e-6)],
    )
    assert tiny.token_ids == greedy.token_ids == small.token_ids
