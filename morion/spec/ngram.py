"""Prompt-lookup drafting: continue a sequence the way it continued the last time its tail appeared.

For each request, the drafter looks for the most recent earlier occurrence of the sequence's last n
tokens, trying n from `max_ngram` down to `min_ngram` (longer matches predict better; the most recent
occurrence is the likeliest to be repeated: an edit loop, a quoted file, a tool call echoing its
arguments), and proposes the tokens that followed that occurrence.

Costs. Each request keeps an index, per n, from an n-gram to the end of its most recent occurrence that
is followed by at least one token. A call indexes only the tokens appended since the previous call and
then does `max_ngram - min_ngram + 1` dictionary lookups, so a 100K-token conversation costs O(new tokens)
per step (~15 us on one CPU core), not O(length). Many new tokens at once (the prompt, on a request's
first step) are indexed with numpy: ~60 ms for 100K tokens instead of ~300 ms token by token, a stall
every running request would feel. Memory is about 130 bytes per token per n (a dict entry and its key,
the n token ids as little-endian uint32 bytes): ~40 MB for a 100K-token request with the default 2..4.

Rewrites. The engine only appends to a sequence, but a request can come back shorter (retracted and
rewritten) or be a different sequence under a reused id. A sequence shorter than what was indexed, or
whose first token or last `max_ngram` indexed tokens differ from the ones indexed, is re-indexed from
scratch. A rewrite that keeps those tokens is not detected (checking everything would cost O(length));
that only makes proposals worse, never outputs wrong: verification rejects bad drafts. The engine
calls `release` when a request ends, and should call it when it rewrites a sequence.

Defaults: min 2, max 4. For comparison, vLLM's `prompt_lookup_min/max` default to 5/5 when unset (its
source calls them untuned), transformers' prompt lookup matches up to 2 tokens, SGLang's n-gram trie
matches windows of 1 to 12.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from morion.spec.drafter import DraftRequest, Drafts

_BULK_TOKENS = 64  # more new tokens than this are indexed with numpy


@dataclass
class _RequestIndex:
    """n-gram → end of its most recent occurrence, for every n-gram ending at e <= `length` - 1.

    Invariant: `by_n[n]` holds exactly the n-grams tokens[e-n:e] for n <= e <= length - 1 (those followed
    by a token), each mapped to the largest such e; `first` and `tail` are token 0 and the last
    `max_ngram` tokens of the indexed sequence, kept to notice a rewritten sequence.
    """

    by_n: dict[int, dict[bytes, int]]
    length: int = 0
    first: int | None = None
    tail: tuple[int, ...] = field(default_factory=tuple)


class NgramDrafter:
    """Deterministic proposals (no probabilities) from each request's own history."""

    name = "ngram"

    def __init__(self, min_ngram: int = 2, max_ngram: int = 4) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}..{max_ngram}")
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self._indexes: dict[str, _RequestIndex] = {}

    def propose(self, requests: Sequence[DraftRequest], width: int) -> Drafts:
        tokens = [self._propose_one(r.request_id, r.token_ids, width) for r in requests]
        return Drafts(tokens=tokens, probs=[None] * len(tokens))

    def release(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)

    def _propose_one(self, request_id: str, token_ids: Sequence[int], width: int) -> list[int]:
        index = self._updated_index(request_id, token_ids)
        if width <= 0:
            return []
        length = len(token_ids)
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            end = index.by_n[n].get(_key(token_ids, length, n))
            if end is not None:
                return _continuation(token_ids, end, width)
        return []

    def _updated_index(self, request_id: str, token_ids: Sequence[int]) -> _RequestIndex:
        index = self._indexes.get(request_id)
        if index is None or not self._extends(index, token_ids):
            index = _RequestIndex(by_n={n: {} for n in range(self.min_ngram, self.max_ngram + 1)})
            self._indexes[request_id] = index
        length = len(token_ids)
        # New n-gram ends: index.length .. length - 1 (an n-gram ending at `length` has no follower yet).
        first_end = max(index.length, self.min_ngram)
        if length - first_end > _BULK_TOKENS:
            self._index_bulk(index, token_ids, first_end, length)
        else:
            for end in range(first_end, length):
                for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                    index.by_n[n][_key(token_ids, end, n)] = end
        if length:
            index.length = length
            index.first = int(token_ids[0])
            index.tail = tuple(int(t) for t in token_ids[max(0, length - self.max_ngram) : length])
        return index

    def _index_bulk(
        self, index: _RequestIndex, token_ids: Sequence[int], first_end: int, length: int
    ) -> None:
        """The loop of `_updated_index` with the keys made by numpy: the same bytes as `_key`, one
        overlapping view of the uint32 tokens per n; a later end overwrites an earlier one, as there."""
        start = max(0, first_end - self.max_ngram)
        tokens = np.asarray(token_ids[start : length - 1], dtype=np.int64)
        if tokens.size and (tokens.min() < 0 or tokens.max() >= 1 << 32):
            raise ValueError(f"token ids must be in [0, 2**32), got {tokens.min()}..{tokens.max()}")
        packed = tokens.astype("<u4")
        for n in range(self.min_ngram, self.max_ngram + 1):
            lowest_end = max(first_end, n)
            if lowest_end >= length:
                continue
            count = length - lowest_end
            offset = 4 * (lowest_end - n - start)
            keys = np.ndarray(
                buffer=packed.data, dtype=f"V{4 * n}", shape=(count,), offset=offset, strides=(4,)
            )
            index.by_n[n].update(zip(keys.tolist(), range(lowest_end, length), strict=True))

    @staticmethod
    def _extends(index: _RequestIndex, token_ids: Sequence[int]) -> bool:
        """Whether `token_ids` plausibly continues the indexed sequence (see the module doc)."""
        if len(token_ids) < index.length:
            return False
        if index.length == 0:
            return True
        start = index.length - len(index.tail)
        return int(token_ids[0]) == index.first and all(
            int(token_ids[start + i]) == t for i, t in enumerate(index.tail)
        )


def _key(token_ids: Sequence[int], end: int, n: int) -> bytes:
    """The n tokens before `end` as little-endian uint32 bytes (exact; `_index_bulk` makes the same)."""
    window = [int(t) for t in token_ids[end - n : end]]
    try:
        return struct.pack(f"<{n}I", *window)
    except struct.error:
        raise ValueError(f"token ids must be in [0, 2**32), got {window}") from None


def _continuation(token_ids: Sequence[int], end: int, width: int) -> list[int]:
    """`width` tokens read from `end` on, continuing into the proposal itself past the sequence's end.

    The match may overlap the tail (…a b a b, tail "a b" last seen 2 tokens earlier): copying what came
    after it then runs into the proposal, which is exactly the hypothesis that the period repeats, so
    a repeating pattern yields a full-width proposal rather than the few tokens left before the end.
    """
    length = len(token_ids)
    draft: list[int] = []
    for position in range(end, end + width):
        draft.append(int(token_ids[position]) if position < length else draft[position - length])
    return draft
