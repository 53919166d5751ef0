from __future__ import annotations

import pytest

from morion.loader.gguf_loader import read_gguf
from morion.text.detokenizer import IncrementalDetokenizer

TEXTS = [
    "plain ascii words",
    "multi-byte: 日本語のテキスト, emoji 🙂🚀👍🏽, accents éàü",
    " leading space and trailing space ",
    "<|im_start|>special<|im_end|> tokens",
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf):
    return read_gguf(smollm2_gguf).tokenizer


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_pieces_join_to_the_full_decode(tokenizer, text):
    prompt = tokenizer.encode("Say:")
    ids = tokenizer.encode(text)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt)
    pieces = [detokenizer.add(token_id) for token_id in ids]
    assert "".join(pieces) == tokenizer.decode(ids)
    assert detokenizer.text == tokenizer.decode(ids)
    assert not any("\ufffd" in piece for piece in pieces)


def test_emoji_split_over_byte_tokens_waits_for_completion(tokenizer):
    ids = tokenizer.encode("🙂")
    assert len(ids) > 1, "the test needs a character spread over several byte tokens"
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    assert [detokenizer.add(i) for i in ids] == [""] * (len(ids) - 1) + ["🙂"]
