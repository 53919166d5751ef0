from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from morion.engine.sampler import RequestSampler, apply_penalties, sample, sampling_probs
from morion.engine.sampling_params import SamplingParams
from morion.errors import InvalidRequestError

PROBS = [0.4, 0.3, 0.15, 0.1, 0.05]
DRAWS = 20_000


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("max_tokens", 0, "max_tokens must be >= 1, got 0"),
        ("max_tokens", 1.5, "max_tokens must be an integer, got 1.5"),
        ("max_tokens", True, "max_tokens must be an integer, got True"),
        ("temperature", -1.0, "temperature must be >= 0, got -1.0"),
        ("temperature", float("nan"), "temperature must be >= 0, got nan"),
        ("temperature", "hot", "temperature must be a number, got 'hot'"),
        ("top_p", 0.0, "top_p must be in (0, 1], got 0.0"),
        ("top_p", 1.5, "top_p must be in (0, 1], got 1.5"),
        ("top_k", -1, "top_k must be >= 0, got -1"),
        ("min_p", 1.1, "min_p must be in [0, 1], got 1.1"),
        ("repetition_penalty", 0.0, "repetition_penalty must be > 0, got 0.0"),
        ("presence_penalty", 2.5, "presence_penalty must be in [-2, 2], got 2.5"),
        ("frequency_penalty", -3, "frequency_penalty must be in [-2, 2], got -3"),
        ("seed", -1, "seed must be >= 0, got -1"),
        ("seed", 2**64, f"seed must be <= {2**64 - 1}, got {2**64}"),
        ("stop", ["ok", ""], "stop must hold non-empty strings, got ''"),
        ("stop", 5, "stop must be a list or tuple, got 5"),
        ("stop_token_ids", [1, -2], "stop_token_ids entry must be >= 0, got -2"),
        ("ignore_eos", 1, "ignore_eos must be a bool, got 1"),
        ("logprobs", -1, "logprobs must be >= 0, got -1"),
    ],
)
def test_invalid_field_is_rejected_with_its_value(field: str, value: object, message: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{field: value})
    assert str(info.value) == message


def test_sequences_become_tuples_and_greedy_property() -> None:
    params = SamplingParams(stop=["a", "b"], stop_token_ids=[1, 2])
    assert params.stop == ("a", "b") and params.stop_token_ids == (1, 2)
    assert SamplingParams(stop="END").stop == ("END",)
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(top_k=1, temperature=0.7).greedy
    assert not SamplingParams().greedy


def _samplers(params: SamplingParams, count: int, prompt: list[int] | None = None) -> list[RequestSampler]:
    return [RequestSampler(params, prompt or []) for _ in range(count)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax_and_leaves_logits_alone(dtype: torch.dtype) -> None:
    logits = torch.randn(6, 1000, generator=torch.Generator().manual_seed(0)).to(dtype)
    before = logits.clone()
    params = [SamplingParams(temperature=0), SamplingParams(top_k=1, temperature=1.3)] * 3
    result = sample(logits, [RequestSampler(p, []) for p in params])
    assert result.token_ids == logits.float().argmax(dim=-1).tolist()
    assert result.logprobs is None and result.top_logprobs is None
    assert torch.equal(logits, before)


def test_greedy_ties_pick_lowest_index() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0, 5.0], [7.0, 7.0, 7.0, 7.0]])
    assert sample(logits, _samplers(SamplingParams(temperature=0), 2)).token_ids == [1, 0]


def _run_steps(samplers: list[RequestSampler], steps: list[torch.Tensor]) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in samplers]
    for logits in steps:
        for row, (s, token) in enumerate(zip(samplers, sample(logits, samplers).token_ids, strict=True)):
            s.append(token)
            out[row].append(token)
    return out


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch() -> None:
    gen = torch.Generator().manual_seed(1)
    vocab, batch = 64, 4
    steps = [torch.randn(batch, vocab, generator=gen) for _ in range(20)]
    target = SamplingParams(seed=1234, temperature=0.9, top_p=0.95, repetition_penalty=1.1)

    alone = _run_steps([RequestSampler(target, [3, 4])], [s[2:3] for s in steps])[0]
    again = _run_steps([RequestSampler(target, [3, 4])], [s[2:3] for s in steps])[0]
    others = [
        SamplingParams(temperature=1.5),
        SamplingParams(seed=7, top_k=5),
        target,
        SamplingParams(temperature=0),
    ]
    in_batch = _run_steps([RequestSampler(p, [3, 4]) for p in others], steps)
    assert alone == again == in_batch[2]
    assert len(set(alone)) > 1  # really sampled, not collapsed to one token
    assert _run_steps([RequestSampler(replace(target, seed=99), [3, 4])], [s[2:3] for s in steps])[0] != alone


def test_unseeded_requests_follow_torch_manual_seed() -> None:
    logits = torch.zeros(8, 1000)
    torch.manual_seed(5)
    first = sample(logits, _samplers(SamplingParams(), 8)).token_ids
    torch.manual_seed(5)
    assert sample(logits, _samplers(SamplingParams(), 8)).token_ids == first
    assert len(set(first)) > 1  # unseeded requests get different seeds


def _frequencies(params: SamplingParams, probs: list[float] = PROBS) -> list[float]:
    """Draw DRAWS tokens from `probs`, one per request, each request with its own seed."""
    logits = torch.tensor(probs).log().expand(DRAWS, len(probs))
    samplers = [RequestSampler(replace(params, seed=i), []) for i in range(DRAWS)]
    counts = torch.bincount(torch.tensor(sample(logits, samplers).token_ids), minlength=len(probs))
    return (counts / DRAWS).tolist()


def _assert_matches(freqs: list[float], weights: list[float]) -> None:
    """Frequencies match `weights` (normalised) within 5 binomial standard deviations; zeros exactly."""
    total = sum(weights)
    for token, (freq, weight) in enumerate(zip(freqs, weights, strict=True)):
        p = weight / total
        tolerance = 5 * math.sqrt(p * (1 - p) / DRAWS)
        assert abs(freq - p) <= tolerance, f"token {token}: frequency {freq:.4f}, expected {p:.4f}"


def test_plain_sampling_follows_the_distribution() -> None:
    _assert_matches(_frequencies(SamplingParams()), PROBS)


def test_top_k_keeps_the_k_best() -> None:
    _assert_matches(_frequencies(SamplingParams(top_k=2)), [0.4, 0.3, 0, 0, 0])


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [(0.7, 2), (0.75, 3), (0.4, 1), (0.01, 1), (0.96, 5)],
)
def test_top_p_keeps_smallest_set_reaching_p(top_p: float, kept: int) -> None:
    _assert_matches(_frequencies(SamplingParams(top_p=top_p)), PROBS[:kept] + [0] * (5 - kept))


def test_tiny_top_p_keeps_the_top_token() -> None:
    freqs = _frequencies(SamplingParams(top_p=1e-9), PROBS[::-1])
    assert freqs == [0, 0, 0, 0, 1]


def test_top_p_boundary_survives_fp32_rounding() -> None:
    # Six of ten equal tokens reach exactly 0.6, but their fp32 cumulative sum falls just short of it.
    # Equal scores rank by token id, so the kept six are 0..5.
    freqs = _frequencies(SamplingParams(top_p=0.6), [0.1] * 10)
    _assert_matches(freqs, [1] * 6 + [0] * 4)


def test_min_p_drops_tokens_below_fraction_of_best() -> None:
    # threshold 0.3 * 0.4 = 0.12: 0.15 stays, 0.1 and 0.05 go
    _assert_matches(_frequencies(SamplingParams(min_p=0.3)), [0.4, 0.3, 0.15, 0, 0])


def test_filters_compose_after_temperature() -> None:
    # temperature 0.5 squares the probabilities to weights [0.16, 0.09, 0.0225, 0.01, 0.0025]; top_k=4
    # drops token 4, then min_p=0.1 drops weights below 0.1 * 0.16 = 0.016: token 3 goes.
    _assert_matches(
        _frequencies(SamplingParams(temperature=0.5, top_k=4, min_p=0.1)), [0.16, 0.09, 0.0225, 0, 0]
    )


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_rescales_probabilities(temperature: float) -> None:
    _assert_matches(
        _frequencies(SamplingParams(temperature=temperature)), [p ** (1 / temperature) for p in PROBS]
    )


def test_tiny_temperature_behaves_like_greedy() -> None:
    logits = torch.tensor([[1.0, 30.0, 29.99, -5.0]]).expand(50, 4)
    samplers = [RequestSampler(SamplingParams(temperature=1e-30, seed=i), []) for i in range(50)]
    assert set(sample(logits, samplers).token_ids) == {1}


def test_sampling_probs_masks_and_renormalises_exactly() -> None:
    logits = torch.tensor(PROBS).log().expand(4, 5)
    params = [SamplingParams(top_k=3), SamplingParams(top_p=0.7), SamplingParams(min_p=0.3), SamplingParams()]
    expected = torch.tensor(
        [
            [0.4 / 0.85, 0.3 / 0.85, 0.15 / 0.85, 0, 0],
            [0.4 / 0.7, 0.3 / 0.7, 0, 0, 0],
            [0.4 / 0.85, 0.3 / 0.85, 0.15 / 0.85, 0, 0],
            PROBS,
        ]
    )
    torch.testing.assert_close(sampling_probs(logits, params), expected)


def test_sampling_probs_of_a_row_do_not_depend_on_other_rows() -> None:
    # A long tail of tiny probabilities: the fp32 cumulative sum passes 1 - 1e-6 before the end, which
    # must not trim the tail of a top_p=1 row just because its neighbour needs the sort.
    logits = torch.full((2, 100_000), -20.0)
    logits[:, 0] = 0.0
    plain = SamplingParams(temperature=0.7, min_p=0.0)
    alone = sampling_probs(logits[:1], [plain])
    beside = sampling_probs(logits, [plain, SamplingParams(top_p=0.5, min_p=0.1)])
    assert torch.equal(alone[0], beside[0])
    assert beside[1].count_nonzero() == 1


def test_penalties_match_hand_computation() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]]).expand(4, 6).clone()
    both = RequestSampler(
        SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25), [0, 1, 1]
    )
    presence_only = RequestSampler(SamplingParams(presence_penalty=-1.0), [0, 1, 1])
    untouched = RequestSampler(SamplingParams(), [0, 1, 1])
    below_one = RequestSampler(SamplingParams(repetition_penalty=0.5), [5])
    for s in (both, presence_only, untouched, below_one):
        for token in (3, 3, 1):
            s.append(token)

    apply_penalties(logits, [both, presence_only, untouched, below_one])

    # Row 0, repetition over prompt+output {0, 1, 3}: 2/2 = 1, -1*2 = -2, 3/2 = 1.5; then output counts
    # {3: 2, 1: 1}: token 3 -= 0.5 + 2*0.25, token 1 -= 0.5 + 1*0.25. Prompt-only token 0 gets no
    # presence/frequency penalty. Row 3, penalty 0.5 over {5, 1, 3}: 1/0.5 = 2, -1*0.5 = -0.5, 3/0.5 = 6.
    expected = torch.tensor(
        [
            [1.0, -2.75, 0.5, 0.5, -2.0, 1.0],
            [2.0, 0.0, 0.5, 4.0, -2.0, 1.0],
            [2.0, -1.0, 0.5, 3.0, -2.0, 1.0],
            [2.0, -0.5, 0.5, 6.0, -2.0, 2.0],
        ]
    )
    assert torch.equal(logits, expected)


def test_output_counts_grow_and_are_kept_only_for_penalties() -> None:
    counted = RequestSampler(SamplingParams(frequency_penalty=0.1), [])
    plain = RequestSampler(SamplingParams(), [])
    for step in range(100):
        counted.append(step % 40)
        plain.append(step % 40)
    assert counted.output_ids.tolist() == list(range(40))
    assert counted.output_counts.tolist() == [3.0] * 20 + [2.0] * 20
    assert len(plain.output_ids) == 0


def test_penalties_steer_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.0, 0.0]])
    s = RequestSampler(SamplingParams(temperature=0, repetition_penalty=2.0), [0])
    assert sample(logits, [s]).token_ids == [1]  # 3/2 = 1.5 < 2
    s = RequestSampler(SamplingParams(temperature=0, frequency_penalty=2.0), [0])
    s.append(0)
    assert sample(logits, [s]).token_ids == [1]


def test_logprobs_are_raw_log_softmax_with_sorted_top_n() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(3))
    params = [
        SamplingParams(logprobs=5, temperature=0, repetition_penalty=3.0),
        SamplingParams(logprobs=0, seed=1),
        SamplingParams(seed=2),
        SamplingParams(logprobs=2, temperature=0.5, seed=3),
    ]
    result = sample(logits, [RequestSampler(p, [7]) for p in params])
    reference = logits.log_softmax(dim=-1)

    assert result.logprobs is not None and result.top_logprobs is not None
    for row, token in enumerate(result.token_ids):
        assert result.logprobs[row] == pytest.approx(reference[row, token].item())
    assert [len(top) for top in result.top_logprobs] == [5, 0, 0, 2]
    for row, top in enumerate(result.top_logprobs):
        values = [lp for _, lp in top]
        assert values == sorted(values, reverse=True)
        expected_ids = reference[row].argsort(descending=True)[: len(top)].tolist()
        assert [token for token, _ in top] == expected_ids
        for token, lp in top:
            assert lp == pytest.approx(reference[row, token].item())


def test_logprobs_clamped_to_vocabulary() -> None:
    result = sample(torch.zeros(1, 3), _samplers(SamplingParams(logprobs=20), 1))
    assert result.top_logprobs is not None and len(result.top_logprobs[0]) == 3


def test_empty_batch_and_shape_mismatch() -> None:
    assert sample(torch.zeros(0, 10), []).token_ids == []
    with pytest.raises(ValueError, match="does not match"):
        sample(torch.zeros(2, 10), _samplers(SamplingParams(), 1))


@pytest.mark.gpu
def test_cuda_matches_cpu_for_greedy_and_is_reproducible_when_seeded() -> None:
    logits = torch.randn(8, 151_936, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    greedy = SamplingParams(temperature=0, repetition_penalty=1.2, logprobs=3)
    cpu = sample(logits, _samplers(greedy, 8, [1, 2, 3]))
    cuda = sample(logits.cuda(), _samplers(greedy, 8, [1, 2, 3]))
    assert cuda.token_ids == cpu.token_ids

    seeded = SamplingParams(seed=11, top_p=0.9, top_k=50, min_p=0.01)
    first = sample(logits.cuda(), _samplers(seeded, 8)).token_ids
    assert sample(logits.cuda(), _samplers(seeded, 8)).token_ids == first


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_greedy_batches_take_the_logits_argmax_and_match_the_general_path(dtype):
    """A batch of plain greedy requests skips the row indexing (sampler.plain_greedy): the same tokens,
    ties to the lower id, and the same logprobs as a batch the general path samples."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=generator).to(dtype)
    logits[2, [7, 31]] = logits[2].max() + 1  # a tie: the lower id wins
    plain = [RequestSampler(SamplingParams(temperature=0.0, logprobs=0), [1]) for _ in range(6)]
    # A repetition penalty of a token no row favours sends every row through the general path.
    general = [RequestSampler(SamplingParams(temperature=0.0, logprobs=2), [1]) for _ in range(5)]
    general.append(
        RequestSampler(SamplingParams(temperature=0.0, logprobs=0, repetition_penalty=1.0001), [49])
    )
    logits[5, 49] = logits[5].min() - 1  # penalised or not, token 49 stays the worst of its row
    ours, reference = sample(logits, plain), sample(logits, general)
    assert ours.token_ids == reference.token_ids == logits.float().argmax(dim=-1).tolist()
    assert ours.token_ids[2] == 7
    assert ours.logprobs == reference.logprobs
    expected = logits.float().log_softmax(dim=-1).gather(1, torch.tensor(ours.token_ids).unsqueeze(1))
    assert ours.logprobs == expected.squeeze(1).tolist()
    assert ours.top_logprobs == [[] for _ in range(6)] and len(reference.top_logprobs[0]) == 2
