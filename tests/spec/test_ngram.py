from __future__ import annotations

import random
from collections.abc import Sequence
from unittest.mock import patch

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from morion.spec import ngram
from morion.spec.drafter import DraftRequest
from morion.spec.ngram import NgramDrafter


def propose(drafter: NgramDrafter, tokens: Sequence[int], width: int, request_id: str = "r") -> list[int]:
    drafts = drafter.propose([DraftRequest(request_id, tokens)], width)
    assert drafts.probs == [None]
    return drafts.tokens[0]


def reference(tokens: list[int], width: int, min_ngram: int, max_ngram: int) -> list[int]:
    """From scratch: the most recent earlier occurrence of the longest matching tail, then copying."""
    length = len(tokens)
    for n in range(max_ngram, min_ngram - 1, -1):
        for end in range(length - 1, n - 1, -1):
            if tokens[end - n : end] == tokens[length - n :]:
                extended = list(tokens)
                for position in range(end, end + width):
                    extended.append(extended[position])
                return extended[length:]
    return []


def test_proposes_what_followed_the_tail_last_time() -> None:
    tokens = [10, 1, 2, 3, 4, 5, 6, 11, 1, 2, 3]  # tail 1 2 3 (no earlier 11 1 2 3) was followed by 4 5 6
    drafter = NgramDrafter()
    assert propose(drafter, tokens, 3) == [4, 5, 6]
    assert propose(drafter, tokens, 2) == [4, 5]


def test_longest_match_wins_over_a_more_recent_shorter_one() -> None:
    tokens = [7, 1, 2, 3, 100, 101, 9, 2, 3, 200, 7, 1, 2, 3]
    # "2 3" last occurred before 200, but the whole tail "7 1 2 3" occurred before 100 101.
    assert propose(NgramDrafter(), tokens, 2) == [100, 101]
    assert propose(NgramDrafter(min_ngram=2, max_ngram=2), tokens, 1) == [200]


def test_most_recent_occurrence_among_equal_lengths() -> None:
    tokens = [1, 2, 5, 1, 2, 6, 1, 2]
    assert propose(NgramDrafter(min_ngram=2, max_ngram=2), tokens, 1) == [6]


def test_no_match_and_too_short_sequences_propose_nothing() -> None:
    drafter = NgramDrafter()
    assert propose(drafter, [1, 2, 3, 4, 5], 4) == []
    assert propose(drafter, [], 4, "empty") == []
    assert propose(drafter, [7], 4, "one") == []
    assert propose(drafter, [7, 7], 4, "two") == []  # a 2-gram needs an earlier end <= 1


def test_overlapping_match_continues_the_period() -> None:
    drafter = NgramDrafter()
    assert propose(drafter, [5, 5, 5, 5], 4) == [5, 5, 5, 5]
    assert propose(drafter, [9, 1, 2, 1, 2, 1, 2], 5, "period2") == [1, 2, 1, 2, 1]


def test_width_limits_the_proposal() -> None:
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3]
    drafter = NgramDrafter()
    assert propose(drafter, tokens, 0) == []
    assert propose(drafter, tokens, 1) == [4]
    assert propose(drafter, tokens, 5) == [4, 5, 6, 7, 8]


def test_requests_are_independent_and_release_forgets() -> None:
    drafter = NgramDrafter()
    a, b = [1, 2, 3, 9, 1, 2], [1, 2, 4, 9, 1, 2]
    drafts = drafter.propose([DraftRequest("a", a), DraftRequest("b", b)], 1)
    assert drafts.tokens == [[3], [4]]
    drafter.release("a")
    drafter.release("never-seen")
    assert propose(drafter, b, 1, "a") == [4]  # "a" now names a new sequence


def test_bad_ngram_bounds_are_rejected() -> None:
    with pytest.raises(ValueError, match="min_ngram"):
        NgramDrafter(min_ngram=3, max_ngram=2)
    with pytest.raises(ValueError, match="min_ngram"):
        NgramDrafter(min_ngram=0)


class CountingSequence(Sequence[int]):
    """A token list that counts how many elements the drafter reads."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.reads = 0

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, item):  # type: ignore[override]
        result = self.tokens[item]
        self.reads += len(result) if isinstance(item, slice) else 1
        return result


def test_a_step_costs_the_new_tokens_not_the_length() -> None:
    tokens = CountingSequence([(i * 7919) % 1000 for i in range(100_000)])
    drafter = NgramDrafter()
    propose(drafter, tokens, 4)
    for step in range(20):
        tokens.tokens.append(step % 3)
        tokens.reads = 0
        propose(drafter, tokens, 4)
        assert tokens.reads < 100, f"step {step} read {tokens.reads} tokens of {len(tokens)}"


sequences = st.lists(st.integers(0, 3), min_size=0, max_size=60)


@settings(max_examples=80, deadline=None)
@given(
    tokens=sequences,
    cuts=st.lists(st.integers(0, 60), min_size=1, max_size=8),
    bounds=st.sampled_from([(1, 1), (2, 4), (1, 3), (3, 5)]),
    width=st.integers(0, 6),
    bulk=st.booleans(),
)
def test_incremental_index_equals_a_search_from_scratch(tokens, cuts, bounds, width, bulk) -> None:
    """The drafter sees growing prefixes (in chunks of any size) of a random sequence; `bulk` indexes
    every chunk with numpy, which must make the same keys as the per-token path."""
    drafter = NgramDrafter(*bounds)
    with patch.object(ngram, "_BULK_TOKENS", 0 if bulk else 10**9):
        for cut in sorted(cuts):
            prefix = tokens[:cut]
            assert propose(drafter, prefix, width) == reference(prefix, width, *bounds)


@settings(max_examples=80, deadline=None)
@given(
    steps=st.lists(
        st.one_of(
            st.tuples(st.just("append"), sequences),
            st.tuples(st.just("truncate"), st.integers(0, 60)),
            st.tuples(st.just("replace_last"), st.integers(0, 3)),
        ),
        min_size=1,
        max_size=12,
    ),
    width=st.integers(1, 5),
    bulk=st.booleans(),
)
def test_retracted_or_rewritten_sequences_are_reindexed(steps, width, bulk) -> None:
    drafter = NgramDrafter()
    tokens: list[int] = []
    with patch.object(ngram, "_BULK_TOKENS", 0 if bulk else 10**9):
        for action, argument in steps:
            if action == "append":
                tokens = tokens + argument
            elif action == "truncate":
                tokens = tokens[: min(argument, len(tokens))]
            elif tokens:
                tokens = [*tokens[:-1], argument]
            assert propose(drafter, tokens, width) == reference(tokens, width, 2, 4)


def test_long_sequences_index_in_bulk_then_token_by_token() -> None:
    rng = random.Random(5)
    tokens = [rng.randrange(6) for _ in range(3000)]
    drafter = NgramDrafter()
    for cut in (2000, 2001, 2003, 2500, 2501, 3000):  # 2000 and 499 new tokens take the bulk path
        assert propose(drafter, tokens[:cut], 5) == reference(tokens[:cut], 5, 2, 4)
    with pytest.raises(ValueError, match="token ids must be in"):
        propose(drafter, [*tokens, -1, *tokens[:100]], 2)
    with pytest.raises(ValueError, match="token ids must be in"):
        propose(NgramDrafter(), [1, 2, 2**32], 2)
