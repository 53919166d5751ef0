"""Incremental detokenization: emit text as tokens arrive without splitting multi-byte characters."""

from __future__ import annotations

from collections.abc import Sequence

from morion.text.tokenizer import Tokenizer

# Prompt tokens kept as left context so that tokenizers that drop a leading space when decoding a
# slice on its own (SentencePiece) decode the first generated token correctly.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Decodes a growing token list; `add` returns only the new, complete text.

    Text is decoded over a sliding window [prefix_offset, len) and the part beyond [prefix_offset,
    read_offset) is emitted once it no longer ends in U+FFFD, i.e. once a character's bytes are complete.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._token_ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)
        self.text = ""

    def add(self, token_id: int) -> str:
        self._token_ids.append(token_id)
        prefix = self._tokenizer.decode(self._token_ids[self._prefix_offset : self._read_offset])
        full = self._tokenizer.decode(self._token_ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        self.text += delta
        return delta
