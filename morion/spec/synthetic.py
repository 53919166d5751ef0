"""A drafter with a chosen acceptance rate, for benchmarking speculation on random-weight models.

A random-weight model gives no real drafter anything to predict, but its greedy output is still
deterministic. The oracle holds that output: full sequences (prompt + greedy output) recorded by a run
without speculation. For a request whose tokens are a prefix of an oracle sequence, the drafter proposes
the oracle's next tokens, each "correct" (equal to the oracle's) with probability `acceptance` given
that the previous ones were; once a position is made wrong, it and every later position get tokens
that differ from the oracle's. With a greedy target that reproduces the oracle, the number of accepted
drafts A then follows P(A >= j) = p**j for j <= width, so

    mean accepted length (tokens per verify step, counting the target's bonus/correction token)
        = 1 + sum_{j=1..width} p**j                                  (`mean_accepted`)

which `acceptance_for_mean_accepted` inverts: a bench that wants 2.58 tokens per step at width 3 asks
for p = acceptance_for_mean_accepted(2.58, 3). The formula assumes `width` oracle tokens remain; near
the end of an oracle sequence fewer are proposed. Sampled (temperature > 0) runs do not reproduce the
oracle, so only greedy runs give the stated acceptance.

Numbers measured with this drafter say nothing about a real drafter's acceptance: label them with
`name` ("synthetic").
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from morion.spec.drafter import DraftRequest, Drafts

_BISECTION_STEPS = 60  # halves [0, 1] to below 1e-18: exact to double precision


@dataclass
class _Match:
    """Request → the oracle sequence its tokens are a prefix of (None: none is), as of `checked` tokens.

    Sequences only grow, so a later call checks just the tokens appended since; a shorter sequence or one
    whose new tokens leave the oracle is looked up again.
    """

    oracle_index: int | None
    checked: int
    rng: random.Random


class SyntheticDrafter:
    name = "synthetic"

    def __init__(
        self, acceptance: float, oracle: Sequence[Sequence[int]], vocab_size: int, seed: int
    ) -> None:
        if not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"acceptance must be in [0, 1], got {acceptance}")
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2 (a wrong token needs another id), got {vocab_size}")
        self.acceptance = acceptance
        self.vocab_size = vocab_size
        self.seed = seed
        self._oracle = [list(map(int, sequence)) for sequence in oracle]
        self._matches: dict[str, _Match] = {}

    def propose(self, requests: Sequence[DraftRequest], width: int) -> Drafts:
        tokens = [self._propose_one(r.request_id, r.token_ids, width) for r in requests]
        return Drafts(tokens=tokens, probs=[None] * len(tokens))

    def release(self, request_id: str) -> None:
        self._matches.pop(request_id, None)

    def _propose_one(self, request_id: str, token_ids: Sequence[int], width: int) -> list[int]:
        found = self._match(request_id, token_ids)
        if found is None:
            return []
        sequence, rng = found
        truth = sequence[len(token_ids) : len(token_ids) + max(width, 0)]
        draft, correct = [], True
        for token in truth:
            correct = correct and rng.random() < self.acceptance  # random() < 1.0 always holds
            draft.append(token if correct else self._other_than(token, rng))
        return draft

    def _match(self, request_id: str, token_ids: Sequence[int]) -> tuple[list[int], random.Random] | None:
        """The request's oracle sequence and generator; None when no oracle sequence starts with it."""
        length = len(token_ids)
        match = self._matches.get(request_id)
        if match is not None and length >= match.checked:
            if match.oracle_index is None:
                return None  # no extension of a sequence that is no oracle prefix is one
            new = [int(t) for t in token_ids[match.checked :]]
            sequence = self._oracle[match.oracle_index]
            if sequence[match.checked : length] == new:
                match.checked = length
                return sequence, match.rng
        tokens = [int(t) for t in token_ids]
        found = next((i for i, s in enumerate(self._oracle) if s[:length] == tokens), None)
        # Seeded per request, so a request's drafts do not depend on the batches it shares.
        match = _Match(found, length, random.Random(f"{self.seed}:{request_id}"))
        self._matches[request_id] = match
        return None if found is None else (self._oracle[found], match.rng)

    def _other_than(self, token: int, rng: random.Random) -> int:
        other = rng.randrange(self.vocab_size - 1)
        return other + 1 if other >= token else other


def mean_accepted(acceptance: float, width: int) -> float:
    """Expected tokens per verify step at `width`: 1 (the target's own token) + sum_{j=1..width} p**j."""
    return 1.0 + sum(acceptance**j for j in range(1, width + 1))


def acceptance_for_mean_accepted(mean: float, width: int) -> float:
    """The acceptance p with `mean_accepted(p, width) == mean`; `mean` counts the bonus token, so it
    lies in [1, width + 1]. `mean_accepted` increases strictly in p on [0, 1], so bisection finds it."""
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    if not 1.0 <= mean <= width + 1:
        raise ValueError(f"mean accepted length at width {width} must be in [1, {width + 1}], got {mean}")
    low, high = 0.0, 1.0
    for _ in range(_BISECTION_STEPS):
        middle = (low + high) / 2
        if mean_accepted(middle, width) < mean:
            low = middle
        else:
            high = middle
    return (low + high) / 2
