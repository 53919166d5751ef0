from __future__ import annotations

import math
import random

import pytest

from morion.spec.drafter import DraftRequest
from morion.spec.synthetic import SyntheticDrafter, acceptance_for_mean_accepted, mean_accepted

VOCAB = 50
PROMPT = [1, 2, 3]
ORACLE = [PROMPT + [random.Random(0).randrange(VOCAB) for _ in range(200)]]


def propose(drafter: SyntheticDrafter, tokens: list[int], width: int, request_id: str = "r") -> list[int]:
    drafts = drafter.propose([DraftRequest(request_id, tokens)], width)
    assert drafts.probs == [None]
    return drafts.tokens[0]


def accepted(draft: list[int], truth: list[int]) -> int:
    """Leading drafts equal to the oracle: what a greedy target reproducing the oracle accepts."""
    count = 0
    while count < len(draft) and draft[count] == truth[count]:
        count += 1
    return count


def test_is_labelled_synthetic() -> None:
    assert SyntheticDrafter(0.5, ORACLE, VOCAB, 0).name == "synthetic"


def test_acceptance_one_proposes_the_oracle() -> None:
    drafter = SyntheticDrafter(1.0, ORACLE, VOCAB, seed=0)
    oracle = ORACLE[0]
    for length in range(len(PROMPT), 60, 3):  # the request grows along the oracle
        assert propose(drafter, oracle[:length], 4) == oracle[length : length + 4]


def test_acceptance_zero_gets_every_position_wrong() -> None:
    drafter = SyntheticDrafter(0.0, ORACLE, VOCAB, seed=0)
    oracle = ORACLE[0]
    for length in range(len(PROMPT), 150):
        draft = propose(drafter, oracle[:length], 4, f"r{length}")
        truth = oracle[length : length + 4]
        assert len(draft) == 4 and all(d != t for d, t in zip(draft, truth, strict=True))
        assert all(0 <= d < VOCAB for d in draft)


def test_without_an_oracle_entry_nothing_is_proposed() -> None:
    drafter = SyntheticDrafter(1.0, ORACLE, VOCAB, seed=0)
    assert propose(drafter, [9, 9, 9], 4) == []
    assert propose(drafter, [9, 9, 9, 9], 4) == []  # still not on the oracle
    oracle = ORACLE[0]
    assert propose(drafter, [*oracle[:10], (oracle[10] + 1) % VOCAB], 4, "left") == []  # left it
    assert propose(drafter, oracle[:-2], 4, "end") == oracle[-2:]  # near the end: what is left


def test_follows_the_oracle_sequence_the_request_is_a_prefix_of() -> None:
    shared = [4, 5, 6]
    first, second = [*shared, 10, 11, 12, 13], [*shared, 20, 21, 22, 23]
    drafter = SyntheticDrafter(1.0, [first, second], VOCAB, seed=0)
    assert propose(drafter, shared, 2) == [10, 11]  # ambiguous: the first one
    assert propose(drafter, [*shared, 20], 2) == [21, 22]  # the request's tokens chose the second
    drafter.release("r")
    assert propose(drafter, [*shared, 10], 2) == [11, 12]


@pytest.mark.parametrize("acceptance,width", [(0.3, 1), (0.7, 4), (0.9, 3), (0.55, 6)])
def test_mean_accepted_length_matches_the_formula(acceptance: float, width: int) -> None:
    drafter = SyntheticDrafter(acceptance, ORACLE, VOCAB, seed=1)
    oracle = ORACLE[0]
    samples = []
    for trial in range(4000):
        length = len(PROMPT) + trial % 100
        draft = propose(drafter, oracle[:length], width, f"r{trial}")  # independent streams
        samples.append(1 + accepted(draft, oracle[length:]))
    mean = sum(samples) / len(samples)
    sd = math.sqrt(sum((s - mean) ** 2 for s in samples) / (len(samples) - 1))
    # Five standard errors: a false failure has probability < 1e-6 (and the seed is fixed).
    assert abs(mean - mean_accepted(acceptance, width)) < 5 * sd / math.sqrt(len(samples)) + 1e-9


def test_mean_accepted_counts_the_bonus_token() -> None:
    assert mean_accepted(0.0, 4) == 1.0
    assert mean_accepted(1.0, 4) == 5.0
    assert mean_accepted(0.5, 2) == pytest.approx(1.75)


@pytest.mark.parametrize("width", [1, 2, 3, 4, 7])
def test_acceptance_for_mean_accepted_inverts_the_formula(width: int) -> None:
    for acceptance in (0.0, 0.1, 0.5, 0.83, 1.0):
        mean = mean_accepted(acceptance, width)
        assert acceptance_for_mean_accepted(mean, width) == pytest.approx(acceptance, abs=1e-9)
    p = acceptance_for_mean_accepted(2.58, 3)
    assert mean_accepted(p, 3) == pytest.approx(2.58, abs=1e-12)


def test_acceptance_for_mean_accepted_rejects_impossible_means() -> None:
    with pytest.raises(ValueError, match=r"\[1, 4\]"):
        acceptance_for_mean_accepted(4.5, 3)
    with pytest.raises(ValueError, match=r"\[1, 4\]"):
        acceptance_for_mean_accepted(0.9, 3)
    with pytest.raises(ValueError, match="width"):
        acceptance_for_mean_accepted(1.0, 0)


def test_bad_parameters_are_rejected() -> None:
    with pytest.raises(ValueError, match="acceptance"):
        SyntheticDrafter(1.5, ORACLE, VOCAB, 0)
    with pytest.raises(ValueError, match="vocab_size"):
        SyntheticDrafter(0.5, ORACLE, 1, 0)
