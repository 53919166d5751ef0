"""Engine core on CPU: batching, chunked prefill, prefix cache, pool pressure, cancellation, limits."""

from __future__ import annotations

import random
from array import array

import pytest
import torch

from morion.engine.request import Request
from morion.engine.sampler import RequestSampler
from morion.engine.sampling_params import SamplingParams
from morion.errors import InvalidRequestError

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
# Batched and single forwards run the same fp32 math in different matrix shapes; 1e-4 covers the
# reordered sums on the tiny model (logits of order 1).
TIE_GAP = 1e-4


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    return tiny_llama


def _prompts(count: int, seed: int, lengths: tuple[int, int] = (1, 70)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(128) for _ in range(rng.randint(*lengths))] for _ in range(count)]


def _single(engine, engine_runner, prompts, params=GREEDY):
    return [engine_runner(engine, [prompt], params)[0] for prompt in prompts]


def test_batched_greedy_equals_one_at_a_time(tiny, engine_factory, engine_runner, outputs_agree):
    prompts = _prompts(8, seed=0)
    alone = _single(engine_factory(tiny, enable_prefix_cache=False), engine_runner, prompts)
    batched = engine_runner(engine_factory(tiny), prompts, GREEDY)
    outputs_agree(tiny.model, prompts, batched, alone, TIE_GAP)


def test_chunked_prefill_equals_unchunked(tiny, engine_factory, engine_runner, outputs_agree):
    prompts = _prompts(6, seed=1, lengths=(20, 90))
    whole = engine_runner(engine_factory(tiny), prompts, GREEDY)
    chunked_engine = engine_factory(tiny, chunk_size=16)
    chunked = engine_runner(chunked_engine, prompts, GREEDY)
    outputs_agree(tiny.model, prompts, chunked, whole, TIE_GAP)
    chunked_engine.check_integrity()


def test_prefix_hit_equals_cold_and_reports_cached_tokens(tiny, engine_factory, engine_runner):
    engine = engine_factory(tiny, page_size=8)
    prompt = _prompts(1, seed=2, lengths=(45, 45))[0]
    cold = engine_runner(engine, [prompt], GREEDY)[0]
    warm = engine_runner(engine, [prompt], GREEDY)[0]
    assert cold.usage.cached_tokens == 0
    # 45 prompt tokens + 23 computed outputs were cached at finish; the hit is page aligned and leaves
    # at least one prompt token to run: 40 of 45.
    assert warm.usage.cached_tokens == 40
    assert warm.token_ids == cold.token_ids


def test_shared_prefix_batch_reuses_pages(tiny, engine_factory, engine_runner):
    engine = engine_factory(tiny, page_size=8)
    shared = _prompts(1, seed=3, lengths=(64, 64))[0]
    tails = [
        tail[:length]
        for tail, length in zip(_prompts(4, seed=4, lengths=(12, 12)), (3, 9, 12, 5), strict=True)
    ]
    prompts = [shared + tail for tail in tails]
    free_before = engine.pool.num_free
    outputs = engine_runner(engine, prompts, SamplingParams(max_tokens=1, temperature=0.0))
    # The first request computes the 64 shared tokens; the other three reuse all 8 shared pages.
    assert [o.usage.cached_tokens for o in outputs] == [0, 64, 64, 64]
    used = free_before - engine.pool.num_free
    assert used == engine.prefix_cache.cached_pages
    # The shared pages once, plus each prompt's own full page past them, if it has one.
    assert engine.prefix_cache.cached_pages == 8 + sum(len(tail) // 8 for tail in tails)
    engine.check_integrity()


def test_a_batch_shares_prefixes_within_a_cache_salt_only(tiny, engine_factory):
    """Requests of another salt neither reuse a prefix nor wait for its prefill: the first of each salt
    computes its prompt in the first step, the second of each reuses its pages."""
    engine = engine_factory(tiny, page_size=8)
    shared = _prompts(1, seed=3, lengths=(64, 64))[0]
    prompts = [shared + tail for tail in _prompts(4, seed=4, lengths=(5, 5))]
    salts = [None, "tenant-a", "tenant-a", None]
    ids = [
        engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0, cache_salt=salt))
        for prompt, salt in zip(prompts, salts, strict=True)
    ]
    finals = {step.request_id: step.final for step in engine.step() if step.final is not None}
    assert [request.request_id for request in engine.scheduler.running] == ids[:2]
    while engine.has_unfinished():
        finals |= {step.request_id: step.final for step in engine.step() if step.final is not None}
    assert [finals[i].usage.cached_tokens for i in ids] == [0, 0, 64, 64]
    assert engine.prefix_cache.cached_pages == 2 * 8
    engine.check_integrity()


def test_pool_pressure_finishes_everything_and_leaks_nothing(
    tiny, engine_factory, engine_runner, outputs_agree
):
    rng = random.Random(5)
    prompts = _prompts(50, seed=6, lengths=(1, 60))
    params = [
        SamplingParams(max_tokens=rng.randint(1, 20), temperature=0.0, ignore_eos=True) for _ in prompts
    ]
    relaxed = engine_runner(engine_factory(tiny), prompts, params)
    tight = engine_factory(tiny, page_size=8, kv_cache_tokens=96, max_running_requests=16)
    pressured = engine_runner(tight, prompts, params)
    assert tight.scheduler.num_retractions > 0, "the pool was meant to be too small for all at once"
    outputs_agree(tiny.model, prompts, pressured, relaxed, TIE_GAP)
    tight.check_integrity()
    tight.prefix_cache.evict(tight.pool.num_pages)
    assert tight.pool.num_free == tight.pool.num_pages


def test_seeded_sampling_is_reproducible_in_any_batch(tiny, engine_factory, engine_runner):
    prompt = _prompts(1, seed=7)[0]
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    engine = engine_factory(tiny)
    alone = engine_runner(engine, [prompt], seeded)[0].token_ids
    others = [SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)] * 3
    in_batch = engine_runner(engine, [*_prompts(3, seed=8), prompt], [*others, seeded])[-1].token_ids
    assert alone == in_batch


def test_requests_that_can_never_fit_are_rejected(tiny, engine_factory, engine_runner):
    engine = engine_factory(tiny, kv_cache_tokens=64, page_size=8)
    with pytest.raises(InvalidRequestError, match="at most 63 fit"):
        engine.add_request(list(range(64)), GREEDY)
    with pytest.raises(InvalidRequestError, match="token ids must be in"):
        engine.add_request([1, 2, 999], GREEDY)
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request([], GREEDY)
    with pytest.raises(InvalidRequestError, match="must be integers"):
        engine.add_request([1, 2.5], GREEDY)  # refused, never rounded
    with pytest.raises(InvalidRequestError, match="token ids must be in"):
        engine.add_request([1, -2], GREEDY)
    # Checked in slices of 16,384 ids (engine `_id_bounds`): a bad id past the first is found too.
    for bad in (999, -2):
        with pytest.raises(InvalidRequestError, match="token ids must be in"):
            engine.add_request([1] * 40_000 + [bad], GREEDY)
    # The engine is undisturbed, and a generation that reaches the pool's end stops with "length".
    [output] = engine_runner(
        engine, [list(range(50))], SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    )
    assert output.finish_reason == "length" and len(output.token_ids) == 14
    # The server's compact prompts (`array("q")`) and tensors answer as a list does.
    for prompt in (array("q", range(50)), torch.arange(50)):
        [again] = engine_runner(
            engine, [prompt], SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
        )
        assert again.token_ids == output.token_ids
    engine.check_integrity()


def test_abort_releases_pages(tiny, engine_factory):
    engine = engine_factory(tiny, page_size=8, enable_prefix_cache=False)
    keep = engine.add_request(list(range(30)), GREEDY)
    drop = engine.add_request(list(range(40)), GREEDY)
    for _ in range(3):  # the prompts up to their last page boundary, their tails (a token), a decode step
        engine.step()
    aborted = engine.abort(drop)
    assert aborted is not None and aborted.finish_reason == "abort" and len(aborted.token_ids) == 2
    engine.check_integrity()
    finals = []
    while engine.has_unfinished():
        finals += [s.final for s in engine.step() if s.final is not None]
    assert [f.request_id for f in finals] == [keep]
    assert engine.pool.num_free == engine.pool.num_pages


def test_stop_token_ids_and_max_tokens(tiny, engine_factory, engine_runner):
    engine = engine_factory(tiny)
    prompt = _prompts(1, seed=9)[0]
    free_run = engine_runner(engine, [prompt], GREEDY)[0].token_ids
    stop_at = free_run[5]
    stopped = engine_runner(
        engine, [prompt], SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[stop_at])
    )[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free_run[: free_run.index(stop_at) + 1]
    short = engine_runner(engine, [prompt], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[0]
    assert short.finish_reason == "length" and short.token_ids == free_run[:3]


def test_logprobs_are_reported_per_token(tiny, engine_factory, engine_runner, prefill_logits):
    engine = engine_factory(tiny)
    prompt = _prompts(1, seed=10)[0]
    output = engine_runner(
        engine, [prompt], SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, ignore_eos=True)
    )[0]
    assert len(output.logprobs) == len(output.top_logprobs) == 4
    expected = torch.log_softmax(prefill_logits(tiny.model, prompt)[-1], dim=-1)
    assert output.logprobs[0] == pytest.approx(expected.max().item(), abs=1e-4)
    assert [t for t, _ in output.top_logprobs[0]] == expected.topk(3).indices.tolist()


def test_decodes_progress_every_step_while_a_long_prompt_prefills(tiny, engine_factory):
    """Fair progress: a long chunked prefill never stalls requests that are already generating."""
    engine = engine_factory(tiny, chunk_size=16)
    decoding = engine.add_request(list(range(5)), GREEDY)
    engine.step()  # its prefill
    engine.add_request(list(range(128)) * 2, GREEDY)  # 256 tokens: 16 chunks of prefill
    for _ in range(10):
        assert decoding in {s.request_id for s in engine.step()}


def test_requests_submitted_together_are_prefilled_together(tiny, engine_factory):
    """Waiting prompts share a step's token budget: eight 200-token prompts under a budget of 2,048 run
    their first 192 tokens in one forward and their tails (a chunk of their own) in the next, so all eight
    have their first token after two steps, as one would alone. Under a smaller budget the step count
    follows the tokens, not the requests."""
    prompts = _prompts(8, seed=12, lengths=(200, 200))
    for chunk_size, steps_to_first_tokens in ((2048, 2), (512, 5)):
        engine = engine_factory(tiny, chunk_size=chunk_size, page_size=16)
        for prompt in prompts:
            engine.add_request(prompt, GREEDY)
        started: set[str] = set()
        steps = 0
        while len(started) < len(prompts):
            started |= {s.request_id for s in engine.step() if s.new_token_ids}
            steps += 1
        assert steps == steps_to_first_tokens


def test_a_request_packs_its_tokens_once_as_they_grow() -> None:
    """What the radix cache matches on: the first n token ids (prompt, then output) as uint64, packed
    incrementally (a 62K-token prompt is not packed again at each of its prefill chunks)."""
    params = SamplingParams(temperature=0)
    request = Request("r", [5, 2**32 - 1, 7], params, RequestSampler(params, [5]), 8, 0)
    assert request.packed_token_ids(2) == array("Q", [5, 2**32 - 1])
    request.output_token_ids += [9, 11]
    assert request.packed_token_ids(4) == array("Q", [5, 2**32 - 1, 7, 9])
    assert request.packed_token_ids(5) == array("Q", request.token_ids)
    assert request.packed_token_ids(1) == array("Q", [5])


def test_load_counts_requests_and_where_the_pages_are(tiny, engine_factory):
    engine = engine_factory(tiny, page_size=8, max_running_requests=2, kv_cache_tokens=256)
    num_pages = engine.pool.num_pages
    assert engine.load() == (0, 0, num_pages, 0, 0, 0)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for prompt in _prompts(3, seed=11, lengths=(20, 20)):
        engine.add_request(prompt, params)
    engine.step()
    load = engine.load()
    # Two run (the limit), one waits. Each prompt's two full pages went to the prefix cache with its
    # prefill; each request still owns its third, partial page.
    assert load == (2, 1, num_pages - 6, 4, 2, 0)
    assert load.pages_free + load.pages_cached + load.pages_held == num_pages
    while engine.has_unfinished():
        engine.step()
    done = engine.load()
    assert (done.running, done.waiting, done.pages_held) == (0, 0, 0)
    assert done.pages_free + done.pages_cached == num_pages and done.pages_cached > 0


def test_the_first_output_with_a_token_says_where_its_time_went(tiny, engine_factory):
    """`StepOutput.first_token_times` (the server's queue and prefill histograms): once per request, on
    its first output with a token; a request that waited for another's run counts the wait as queued."""
    engine = engine_factory(tiny, max_running_requests=1)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    first, second = (engine.add_request(prompt, params) for prompt in _prompts(2, seed=7, lengths=(30, 40)))
    reported: dict[str, list] = {first: [], second: []}  # (step, times) of each output with times
    first_token_step = {}
    step = 0
    while engine.has_unfinished():
        step += 1
        for out in engine.step():
            if out.first_token_times is not None:
                reported[out.request_id].append((step, out.first_token_times))
            if out.new_token_ids:
                first_token_step.setdefault(out.request_id, step)
    times = {}
    for request_id, outputs in reported.items():
        [(step, times[request_id])] = outputs  # once
        assert step == first_token_step[request_id]  # on its first token's output
        assert times[request_id].queued_s >= 0 and times[request_id].prefill_s > 0
        # The stepping thread's split of the prefill (Linux keeps the statistics): on a CPU (its CPU clock)
        # for some of it and never for more; runnable in a run queue for some time (a wait is counted when
        # it ends, so one that began before the admission may count whole).
        on_cpu, runqueue = times[request_id].prefill_on_cpu_s, times[request_id].prefill_runqueue_s
        assert 0 < on_cpu <= times[request_id].prefill_s + 1e-3 and runqueue >= 0
    # One running request at a time: the second queued through the whole of the first one's run.
    assert times[second].queued_s > times[first].prefill_s > 0
