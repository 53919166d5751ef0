"""Speculative decoding in the engine: greedy output with speculation equals output without it, token for
token, whatever the drafter proposes (synthetic drafter at acceptance 0, 0.5 and 1; n-gram lookup), for a
dense model and a hybrid one (whose Gated DeltaNet state must roll back to the last accepted token);
prefix-cache hits after speculative runs equal cold runs; sampling keeps the target's distribution."""

from __future__ import annotations

import random

import pytest
import torch

from morion.config import EngineConfig
from morion.engine.engine import Engine
from morion.engine.sampling_params import SamplingParams
from morion.errors import MorionError
from morion.spec.drafter import Drafts
from morion.spec.forced import ForcedAcceptance
from morion.spec.mtp_graph import MtpDraftGraphs
from morion.spec.synthetic import SyntheticDrafter
from tests.conftest import PendingOnlyMtp, recorded_proposals, small_token_map

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _engine(loaded, drafter=None, **options) -> Engine:
    options = {"device": "cpu", "kv_cache_tokens": 4096, "page_size": 4, "chunk_size": 64, **options}
    return Engine(EngineConfig(**options), loaded, drafter=drafter)


def _prompts(vocab: int, count: int = 3, length: int = 21) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(vocab) for _ in range(length + 3 * i)] for i in range(count)]


@pytest.fixture(params=["small_llama", "tiny_qwen3_next"])
def loaded(request):
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def reference_hybrid(tiny_qwen3_next):
    """`reference` for the hybrid model alone."""
    from tests.conftest import run_engine

    prompts = _prompts(512)
    outputs = run_engine(_engine(tiny_qwen3_next, enable_prefix_cache=False), prompts, GREEDY)
    return prompts, [o.token_ids for o in outputs]


@pytest.fixture
def reference(loaded, engine_runner):
    """Greedy outputs without speculation (and without prefix caching): the oracle and the expectation."""
    prompts = _prompts(loaded.model.config.vocab_size)
    outputs = engine_runner(_engine(loaded, enable_prefix_cache=False), prompts, GREEDY)
    return prompts, [o.token_ids for o in outputs]


@pytest.mark.parametrize("acceptance", [0.0, 0.5, 1.0])
def test_synthetic_drafts_leave_greedy_output_unchanged(loaded, reference, engine_runner, acceptance):
    prompts, expected = reference
    oracle = [p + o for p, o in zip(prompts, expected, strict=True)]
    drafter = SyntheticDrafter(acceptance, oracle, loaded.model.config.vocab_size, seed=1)
    engine = _engine(loaded, drafter, spec_width=3)
    outputs = engine_runner(engine, prompts, GREEDY)
    assert [o.token_ids for o in outputs] == expected
    stats = engine.speculative.stats
    assert stats.verify_steps > 0 and stats.drafted_tokens > 0
    if acceptance == 0.0:
        assert stats.accepted_tokens == 0 and stats.mean_accepted_length == 1.0
    if acceptance == 1.0:
        # Every draft is the oracle's: each verify step yields width + 1 tokens, bar a request's last step.
        assert stats.accepted_tokens == stats.drafted_tokens and stats.mean_accepted_length > 3.0
    if acceptance == 0.5:
        assert 0 < stats.accepted_tokens < stats.drafted_tokens
    engine.check_integrity()


def test_ngram_drafts_on_a_repetitive_prompt(loaded, engine_runner):
    vocab = loaded.model.config.vocab_size
    rng = random.Random(3)
    motif = [rng.randrange(vocab) for _ in range(7)]
    prompts = [motif * 4, [rng.randrange(vocab) for _ in range(5)] + motif * 3]
    plain = _engine(loaded, enable_prefix_cache=False)
    expected = [o.token_ids for o in engine_runner(plain, prompts, GREEDY)]
    engine = _engine(loaded, speculative="ngram", spec_width=4)
    # Whether lookups find anything depends on what the random model generates; equality must hold anyway.
    assert [o.token_ids for o in engine_runner(engine, prompts, GREEDY)] == expected
    engine.check_integrity()


def test_stop_token_inside_accepted_drafts_ends_the_request_there(loaded, reference, engine_runner):
    prompts, expected = reference
    oracle = [p + o for p, o in zip(prompts, expected, strict=True)]
    stop = expected[0][9]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop_token_ids=[stop])
    want = engine_runner(_engine(loaded, enable_prefix_cache=False), prompts[:1], params)[0]
    drafter = SyntheticDrafter(1.0, oracle, loaded.model.config.vocab_size, seed=0)
    engine = _engine(loaded, drafter, spec_width=4)
    got = engine_runner(engine, prompts[:1], params)[0]
    assert got.token_ids == want.token_ids and got.token_ids[-1] == stop and got.finish_reason == "stop"
    engine.check_integrity()


def test_prefix_hits_after_speculative_runs_equal_cold(loaded, reference, engine_runner):
    """The follow-up reuses pages and (hybrid) the state kept at a page boundary that a verify step
    crossed, possibly right before a rejected draft."""
    prompts, expected = reference
    oracle = [p + o for p, o in zip(prompts, expected, strict=True)]
    drafter = SyntheticDrafter(0.5, oracle, loaded.model.config.vocab_size, seed=2)
    engine = _engine(loaded, drafter, spec_width=3)
    engine_runner(engine, prompts, GREEDY)
    follow_ups = [[*sequence, 7, 8, 9] for sequence in oracle]
    cold = _engine(loaded, enable_prefix_cache=False)
    want = [o.token_ids for o in engine_runner(cold, follow_ups, GREEDY)]
    got = engine_runner(engine, follow_ups, GREEDY)
    assert [o.token_ids for o in got] == want
    for output, prompt in zip(got, prompts, strict=True):
        assert output.usage.cached_tokens > len(prompt)  # generated tokens were reused too
    engine.check_integrity()


def test_sampling_with_speculation_keeps_the_target_distribution(small_llama, engine_runner):
    """Two-sample chi-square test on the second sampled token (the first one a verify step decides)."""
    prompt = _prompts(256, count=1)[0]
    params = [SamplingParams(max_tokens=2, temperature=0.7, seed=s, ignore_eos=True) for s in range(600)]
    plain = engine_runner(_engine(small_llama, max_running_requests=64), [prompt] * 600, params)
    greedy = engine_runner(_engine(small_llama, enable_prefix_cache=False), [prompt], GREEDY)[0].token_ids
    drafter = SyntheticDrafter(1.0, [prompt + greedy], 256, seed=0)
    # The oracle's greedy tokens as drafts: accepted with the target's probability, else resampled.
    speculative = _engine(small_llama, drafter, spec_width=1, max_running_requests=64)
    params = [
        SamplingParams(max_tokens=2, temperature=0.7, seed=1000 + s, ignore_eos=True) for s in range(600)
    ]
    spec = engine_runner(speculative, [prompt] * 600, params)
    assert speculative.speculative.stats.verify_steps > 0
    a = torch.bincount(torch.tensor([o.token_ids[1] for o in plain]), minlength=256).double()
    b = torch.bincount(torch.tensor([o.token_ids[1] for o in spec]), minlength=256).double()
    # Pool the rare tokens so every cell has a reasonable expected count.
    common = (a + b) >= 10
    a = torch.cat([a[common], a[~common].sum(dim=0, keepdim=True)])
    b = torch.cat([b[common], b[~common].sum(dim=0, keepdim=True)])
    total = a + b
    keep = total > 0
    a, b, total = a[keep], b[keep], total[keep]
    chi2 = (((a - total / 2) ** 2 + (b - total / 2) ** 2) / (total / 2)).sum().item()
    dof = len(total) - 1
    # chi-square upper tail ~ p = 1e-4 via the Wilson-Hilferty approximation.
    bound = dof * (1 - 2 / (9 * dof) + 3.72 * (2 / (9 * dof)) ** 0.5) ** 3
    assert chi2 < bound, (chi2, dof, bound)


def test_mtp_drafts_leave_greedy_output_unchanged(tiny_qwen3_next, engine_runner, tmp_path):
    """The model's own MTP head drafts (random weights: low acceptance, but the extend, the chained
    steps and their K/V in the pages all run), alone and with a FR-Spec reduced draft vocabulary."""
    prompts = _prompts(512)
    plain = _engine(tiny_qwen3_next, enable_prefix_cache=False)
    expected = [o.token_ids for o in engine_runner(plain, prompts, GREEDY)]
    engine = _engine(tiny_qwen3_next, speculative="mtp", spec_width=3)
    assert engine.pool.spec.token_components[0].num_layers == 3  # 2 attention layers + the MTP layer
    assert [o.token_ids for o in engine_runner(engine, prompts, GREEDY)] == expected
    stats = engine.speculative.stats
    assert stats.verify_steps > 0 and stats.drafted_tokens == 3 * (
        stats.emitted_tokens - stats.accepted_tokens
    )
    engine.check_integrity()
    token_map = small_token_map(tmp_path, eos_id=1)
    reduced = _engine(tiny_qwen3_next, speculative="mtp", spec_width=2, spec_token_map=str(token_map))
    outputs = engine_runner(reduced, prompts, GREEDY)
    assert [o.token_ids for o in outputs] == expected


def test_mtp_logprobs_and_a_sampled_request_in_the_batch(tiny_qwen3_next, reference_hybrid, engine_runner):
    """Logprobs of verified tokens come from the verify's logits, taken before the next drafts launch
    (the draft graph reuses the verify's memory); a sampled request in the batch moves acceptance to the
    host. Greedy requests still equal plain decoding, tokens and logprobs."""
    prompts, expected = reference_hybrid
    with_logprobs = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    sampled = SamplingParams(max_tokens=24, temperature=0.8, seed=5, ignore_eos=True)
    plain = engine_runner(_engine(tiny_qwen3_next, enable_prefix_cache=False), prompts[:2], with_logprobs)
    engine = _engine(tiny_qwen3_next, speculative="mtp", spec_width=3)
    outputs = engine_runner(engine, prompts, [with_logprobs, with_logprobs, sampled])
    assert [o.token_ids for o in outputs[:2]] == expected[:2] and len(outputs[2].token_ids) == 24
    for got, want in zip(outputs[:2], plain, strict=True):
        torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-4, rtol=0)
        assert [[i for i, _ in top] for top in got.top_logprobs] == [
            [i for i, _ in top] for top in want.top_logprobs
        ]
    assert engine.speculative.stats.verify_steps > 0
    engine.check_integrity()


def test_mtp_requests_without_room_for_the_next_drafts(tiny_qwen3_next, monkeypatch):
    """A request that gets no pages for the next step's drafts right after its verify (the pool short)
    keeps the verify's hidden states of its committed tokens for the head's next proposal instead: its
    drafts then equal those of a drafter that always extends on demand. Forced acceptance (the same
    draws for both) so that verify steps commit several tokens."""
    config = EngineConfig(
        device="cpu", kv_cache_tokens=4096, page_size=4, chunk_size=64, speculative="mtp", spec_width=3
    )
    engine, on_demand = (
        Engine(config, tiny_qwen3_next, forced_acceptance=ForcedAcceptance(0.7, seed=3)) for _ in range(2)
    )
    on_demand.speculative.drafter = PendingOnlyMtp(on_demand.speculative.drafter)
    records = [recorded_proposals(engine), recorded_proposals(on_demand)]
    reserve = engine.scheduler.reserve_for_verify
    refused = []

    def short_for_one_request(request, num_tokens, num_draft_slots):
        granted = reserve(request, num_tokens, num_draft_slots)
        if num_tokens == 2 * (1 + 3) and request.request_id == ids[1]:
            refused.append(request.request_id)
            return False
        return granted

    monkeypatch.setattr(engine.scheduler, "reserve_for_verify", short_for_one_request)
    outputs = []
    for runner in (engine, on_demand):
        ids = [runner.add_request(p, GREEDY) for p in _prompts(512)]
        finals = {}
        while runner.has_unfinished():
            for step in runner.step():
                if step.final is not None:
                    finals[step.request_id] = step.final
        outputs.append([finals[i].token_ids for i in ids])
    assert refused and engine.speculative.stats.accepted_tokens > 0
    assert records[0] == records[1] and outputs[0] == outputs[1]
    engine.check_integrity()


def test_mtp_drafts_then_prefix_hits_equal_cold(tiny_qwen3_next, reference_hybrid, engine_runner):
    """After MTP-drafted runs, follow-ups hit the prefix cache (whose pages also hold the head's K/V) and
    equal cold runs, still drafting with the head."""
    prompts, expected = reference_hybrid
    engine = _engine(tiny_qwen3_next, speculative="mtp", spec_width=3)
    assert [o.token_ids for o in engine_runner(engine, prompts, GREEDY)] == expected
    follow_ups = [[*p, *e, 7, 8, 9] for p, e in zip(prompts, expected, strict=True)]
    plain = _engine(tiny_qwen3_next, enable_prefix_cache=False)
    want = [o.token_ids for o in engine_runner(plain, follow_ups, GREEDY)]
    got = engine_runner(engine, follow_ups, GREEDY)
    assert [o.token_ids for o in got] == want and all(o.usage.cached_tokens > 0 for o in got)
    engine.check_integrity()


def test_a_drafter_object_and_a_named_method_exclude_each_other(tiny_qwen3_next):
    with pytest.raises(MorionError, match="pick one"):
        _engine(tiny_qwen3_next, SyntheticDrafter(0.5, [], 512, seed=0), speculative="mtp")


def test_mtp_needs_a_model_with_an_mtp_head(small_llama):
    with pytest.raises(MorionError, match="MTP head"):
        _engine(small_llama, speculative="mtp")


@pytest.mark.parametrize("acceptance", [0.0, 0.6, 1.0])
def test_forced_acceptance_commits_exactly_the_emitted_sequence(tiny_qwen3_next, engine_runner, acceptance):
    """Benchmarks force the acceptance (spec/forced.py): the emitted tokens are then accepted MTP drafts
    plus target tokens, and the cache must hold exactly that sequence: a follow-up served from the
    prefix cache (pages and the state at a boundary that a forced verify step crossed) equals a cold run
    of the same tokens."""
    prompts = _prompts(512)
    config = EngineConfig(
        device="cpu", kv_cache_tokens=4096, page_size=4, chunk_size=64, speculative="mtp", spec_width=3
    )
    engine = Engine(config, tiny_qwen3_next, forced_acceptance=ForcedAcceptance(acceptance, seed=0))
    outputs = engine_runner(engine, prompts, GREEDY)
    stats = engine.speculative.stats
    expected_mean = {0.0: 1.0, 1.0: 4.0}.get(acceptance)
    if expected_mean is not None:  # the last verify step of a request may be cut by max_tokens
        assert stats.mean_accepted_length == pytest.approx(expected_mean, abs=0.35)
    follow_ups = [[*p, *o.token_ids, 7, 8] for p, o in zip(prompts, outputs, strict=True)]
    cold = _engine(tiny_qwen3_next, enable_prefix_cache=False)
    want = [o.token_ids for o in engine_runner(cold, follow_ups, GREEDY)]
    got = engine_runner(engine, follow_ups, GREEDY)
    assert all(o.usage.cached_tokens > len(p) for o, p in zip(got, prompts, strict=True))
    # The follow-ups ran with forced acceptance too: compare their first token (decided by the target at
    # the end of the prefill, before any verify step) with the cold run's.
    assert [o.token_ids[0] for o in got] == [w[0] for w in want]
    engine.check_integrity()


class _BoundaryDrafter:
    """Oracle drafts accepted exactly up to the next page boundary, then one wrong draft: every verify
    step of a hybrid model commits a state at a page boundary and rejects the draft right after it."""

    name = "boundary"

    def __init__(self, oracle: list[list[int]], page_size: int, vocab_size: int) -> None:
        self.oracle, self.page_size, self.vocab_size = oracle, page_size, vocab_size

    def propose(self, requests, width: int) -> Drafts:
        tokens = []
        for request in requests:
            known = [s for s in self.oracle if s[: len(request.token_ids)] == list(request.token_ids)]
            if not known:  # a follow-up prompt: nothing to propose
                tokens.append([])
                continue
            sequence = known[0]
            right = (-(request.num_computed + 1)) % self.page_size  # drafts up to the boundary
            future = sequence[len(request.token_ids) : len(request.token_ids) + width]
            drafted = future[:right] + [(t + 1) % self.vocab_size for t in future[right : right + 1]]
            tokens.append(drafted[:width])
        return Drafts(tokens, [None] * len(tokens))

    def release(self, request_id: str) -> None:
        pass


def test_rejection_right_after_a_state_snapshot(tiny_qwen3_next, reference_hybrid, engine_runner):
    prompts, expected = reference_hybrid
    oracle = [p + o for p, o in zip(prompts, expected, strict=True)]
    engine = _engine(tiny_qwen3_next, _BoundaryDrafter(oracle, 4, 512), spec_width=4)
    assert [o.token_ids for o in engine_runner(engine, prompts, GREEDY)] == expected
    stats = engine.speculative.stats
    assert 0 < stats.accepted_tokens < stats.drafted_tokens
    # The follow-ups reuse pages up to the last boundary state a verify step kept.
    follow_ups = [[*sequence, 7, 8, 9] for sequence in oracle]
    want = [
        o.token_ids
        for o in engine_runner(_engine(tiny_qwen3_next, enable_prefix_cache=False), follow_ups, GREEDY)
    ]
    got = engine_runner(engine, follow_ups, GREEDY)
    assert [o.token_ids for o in got] == want
    assert all(
        o.usage.cached_tokens >= len(p) + len(e) - 4 for o, p, e in zip(got, prompts, expected, strict=True)
    )
    engine.check_integrity()


def test_host_and_disk_hits_with_speculation_equal_cold(
    tiny_qwen3_next, reference_hybrid, engine_runner, tmp_path
):
    prompts, expected = reference_hybrid
    oracle = [p + o for p, o in zip(prompts, expected, strict=True)]
    tiers = {"host_cache_gb": 0.01, "disk_cache_dir": str(tmp_path / "disk"), "disk_cache_gb": 0.1}
    engine = _engine(tiny_qwen3_next, SyntheticDrafter(0.6, oracle, 512, seed=3), spec_width=3, **tiers)
    assert [o.token_ids for o in engine_runner(engine, prompts, GREEDY)] == expected
    follow_ups = [[*sequence, 7, 8, 9] for sequence in oracle]
    want = [
        o.token_ids
        for o in engine_runner(_engine(tiny_qwen3_next, enable_prefix_cache=False), follow_ups, GREEDY)
    ]
    engine.evict_device_cache()
    host = engine_runner(engine, follow_ups, GREEDY)
    assert [o.token_ids for o in host] == want and engine.cache_stats.host_hit_tokens > 0
    engine.close()
    restarted = _engine(tiny_qwen3_next, SyntheticDrafter(0.6, oracle, 512, seed=4), spec_width=3, **tiers)
    disk = engine_runner(restarted, follow_ups, GREEDY)
    assert [o.token_ids for o in disk] == want and restarted.cache_stats.disk_hit_tokens > 0
    restarted.close()


def test_mtp_drafts_made_after_verify_equal_those_made_on_propose(
    tiny_qwen3_next, reference_hybrid, engine_runner
):
    """The fixed-shape draft right after a verify step (extend over all verify rows, the accepted row's
    output, chained steps) proposes exactly what extending the accepted positions on demand does."""
    prompts, expected = reference_hybrid
    fixed = _engine(tiny_qwen3_next, speculative="mtp", spec_width=3)
    on_demand = _engine(tiny_qwen3_next, speculative="mtp", spec_width=3)
    on_demand.speculative.drafter = PendingOnlyMtp(on_demand.speculative.drafter)
    records = [recorded_proposals(fixed), recorded_proposals(on_demand)]
    calls = []
    original = fixed.speculative.drafter.after_verify
    fixed.speculative.drafter.after_verify = lambda verified: (calls.append(1), original(verified))[1]
    for engine in (fixed, on_demand):
        assert [o.token_ids for o in engine_runner(engine, prompts, GREEDY)] == expected
    assert calls and records[0] == records[1]


def test_mtp_draft_graph_buffers_and_padding_give_the_same_drafts(
    tiny_qwen3_next, reference_hybrid, engine_runner
):
    """The draft-graph runner's static buffers, bucket padding and slicing (spec/mtp_graph.py), run
    eagerly on the CPU in place of a replay: the same proposals as the plain after-verify draft."""
    prompts, expected = reference_hybrid
    plain = _engine(tiny_qwen3_next, speculative="mtp", spec_width=3)
    staged = _engine(tiny_qwen3_next, speculative="mtp", spec_width=3, max_running_requests=8)
    drafter = staged.speculative.drafter
    [scratch] = staged.pool.alloc(1)  # padding rows write here, as into the engine's scratch page on CUDA
    graphs = MtpDraftGraphs(
        drafter.draft_after_verify, 3, 8, 128, 64, torch.float32, scratch, torch.device("cpu")
    )
    graphs.prepare_eager()
    drafter.graphs[3] = graphs
    records = [recorded_proposals(plain), recorded_proposals(staged)]
    for engine in (plain, staged):
        assert [o.token_ids for o in engine_runner(engine, prompts, GREEDY)] == expected
    assert graphs.replays > 0 and records[0] == records[1]
