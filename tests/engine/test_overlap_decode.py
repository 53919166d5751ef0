"""Overlapped decode (`--overlap-decode`, engine/overlap.py): each decode step is launched before the
previous step's tokens are read back. The answers must be the synchronous engine's, token for token and in
text and finish reason, through stop tokens, stop strings, max tokens and EOS, and the prefix cache it
leaves must serve follow-ups as the synchronous engine's does; requests that need their last token on the
host fall back to the synchronous step; an abort while a step is pending leaves the engine whole.
On the tiny hybrid Qwen3-Next (Gated DeltaNet state) with a byte tokenizer, on the CPU."""

from __future__ import annotations

import random

import pytest
import torch

from morion.config import EngineConfig
from morion.engine.engine import Engine
from morion.engine.sampling_params import SamplingParams
from morion.errors import MorionError
from morion.loader import load_model


@pytest.fixture(scope="module")
def chat_model(tiny_qwen3_next_chat_dir):
    return load_model(str(tiny_qwen3_next_chat_dir), torch.float32, torch.device("cpu"), "dummy")


def _engine(loaded, overlap: bool) -> Engine:
    return Engine(
        EngineConfig(device="cpu", kv_cache_tokens=4096, page_size=4, chunk_size=32, overlap_decode=overlap),
        loaded,
    )


def _prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(9, 30))] for _ in range(count)]


def _answers(outputs) -> list[tuple]:
    return [(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in outputs]


@pytest.fixture
def overlapped_steps(monkeypatch) -> list[int]:
    """Counts the overlapped steps the engine runs."""
    calls = []
    original = Engine._overlapped_decode

    def counted(self, chunks):
        calls.append(len(chunks))
        return original(self, chunks)

    monkeypatch.setattr(Engine, "_overlapped_decode", counted)
    return calls


def test_overlapped_decode_gives_the_synchronous_answers(chat_model, engine_runner, overlapped_steps):
    prompts = _prompts(4, seed=1)
    plain = SamplingParams(max_tokens=12, temperature=0.0)
    reference = engine_runner(_engine(chat_model, overlap=False), prompts, plain)
    # Stops that end requests mid-decode: a token the first answer makes at its 4th step, a stop string of
    # the second's 6th token's text; max tokens of every length; EOS left on.
    stop_token = reference[0].token_ids[3]
    stop_text = chat_model.tokenizer.decode([reference[1].token_ids[5]])
    params = [
        SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop_token]),
        SamplingParams(max_tokens=12, temperature=0.0, stop=[stop_text]),
        SamplingParams(max_tokens=3, temperature=0.0),
        SamplingParams(max_tokens=17, temperature=0.0),
    ]
    engines = {overlap: _engine(chat_model, overlap) for overlap in (False, True)}
    first = {overlap: engine_runner(engine, prompts, params) for overlap, engine in engines.items()}
    assert _answers(first[True]) == _answers(first[False])
    assert first[True][0].finish_reason == "stop" and first[True][2].finish_reason == "length"
    assert overlapped_steps, "no step overlapped: nothing was checked"
    # Follow-ups hit the prefix cache each engine left, state snapshots included.
    follow_ups = [[*p, *o.token_ids, 7, 8, 9] for p, o in zip(prompts, first[False], strict=True)]
    second = {
        overlap: engine_runner(engine, follow_ups, SamplingParams(max_tokens=8, temperature=0.0))
        for overlap, engine in engines.items()
    }
    assert _answers(second[True]) == _answers(second[False])
    assert all(o.usage.cached_tokens > 0 for o in second[True])
    for engine in engines.values():
        engine.check_integrity()


def test_seeded_sampling_overlaps_and_draws_the_same_tokens(chat_model, engine_runner, overlapped_steps):
    """Sampled requests (temperature, top-k, top-p, min-p; seeded) overlap too: each draws once a step
    from its own generator, as the synchronous step, so the tokens are the same."""
    prompts = _prompts(3, seed=2)
    params = [
        SamplingParams(max_tokens=9, temperature=0.8, seed=5),
        SamplingParams(max_tokens=7, temperature=1.1, top_k=20, top_p=0.9, seed=6),
        SamplingParams(max_tokens=11, temperature=0.6, min_p=0.05, seed=7),
    ]
    reference = engine_runner(_engine(chat_model, overlap=False), prompts, params)
    outputs = engine_runner(_engine(chat_model, overlap=True), prompts, params)
    assert _answers(outputs) == _answers(reference)
    assert overlapped_steps


def test_requests_that_need_the_host_take_the_synchronous_step(chat_model, engine_runner, overlapped_steps):
    """A request with a penalty (it counts its earlier tokens on the host) and one with logprobs: no step
    overlaps while either runs, and the answers are the synchronous engine's."""
    prompts = _prompts(2, seed=2)
    params = [
        SamplingParams(max_tokens=6, temperature=0.0, repetition_penalty=1.3),
        SamplingParams(max_tokens=6, temperature=0.0, logprobs=2),
    ]
    for both in (params, params[:1], params[1:]):
        reference = engine_runner(_engine(chat_model, overlap=False), prompts[: len(both)], both)
        outputs = engine_runner(_engine(chat_model, overlap=True), prompts[: len(both)], both)
        assert _answers(outputs) == _answers(reference)
        assert [o.logprobs for o in outputs] == [o.logprobs for o in reference]
    assert not overlapped_steps


def test_an_abort_while_a_step_is_pending(chat_model, engine_runner, overlapped_steps):
    """Aborted between overlapped steps, a request ends with the tokens booked so far (a prefix of its
    synchronous answer); the other finishes as it would have, and every page and slot is accounted for."""
    prompts = _prompts(2, seed=3)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    reference = engine_runner(_engine(chat_model, overlap=False), prompts, params)
    engine = _engine(chat_model, overlap=True)
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    finals = {}
    steps = 0
    while engine.has_unfinished():
        for step in engine.step():
            if step.final is not None:
                finals[step.request_id] = step.final
        steps += 1
        if steps == 4:
            assert engine._pending is not None, "no step pending: nothing to check"
            finals[ids[0]] = engine.abort(ids[0])
    aborted, finished = finals[ids[0]], finals[ids[1]]
    assert aborted.finish_reason == "abort" and 0 < len(aborted.token_ids) < 10
    assert aborted.token_ids == reference[0].token_ids[: len(aborted.token_ids)]
    assert finished.token_ids == reference[1].token_ids
    assert overlapped_steps
    engine.check_integrity()


@pytest.mark.parametrize(("option", "value"), [("speculative", "ngram"), ("tensor_parallel_size", 2)])
def test_overlap_refuses_what_it_does_not_cover(option, value):
    with pytest.raises(MorionError, match="overlap_decode runs on one rank without speculative decoding"):
        EngineConfig(device="cpu", overlap_decode=True, **{option: value})


@pytest.mark.gpu
def test_on_cuda_with_decode_graphs_the_answers_are_the_synchronous_ones(
    tiny_qwen3_next_chat_dir, engine_runner
):
    """The same on CUDA, where it matters: decode steps replay CUDA graphs, the pending tokens' copy to
    the host and the input patch are queued on the device, and a step's tokens are read while the next
    step runs."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    loaded = load_model(str(tiny_qwen3_next_chat_dir), torch.bfloat16, torch.device("cuda"), "dummy")
    prompts = _prompts(6, seed=4)
    params = [SamplingParams(max_tokens=n, temperature=0.0) for n in (3, 8, 16, 24, 31, 40)]
    answers = {}
    for overlap in (False, True):
        engine = Engine(
            EngineConfig(device="cuda", kv_cache_tokens=8192, page_size=16, overlap_decode=overlap), loaded
        )
        answers[overlap] = _answers(engine_runner(engine, prompts, params))
        engine.check_integrity()
    assert answers[True] == answers[False]
