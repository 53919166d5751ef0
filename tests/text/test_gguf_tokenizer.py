"""The tokenizer and chat template morion builds from GGUF metadata, against transformers'."""

from __future__ import annotations

import pytest
import transformers

from morion.loader.gguf_loader import read_gguf

TEXTS = [
    "Hello, world!",
    "  leading spaces and\ttabs\nnew lines\n\n",
    "Ünïcödé — “quotes” and emoji 🙂🚀",
    "<|im_start|>user\nspecial tokens stay whole<|im_end|>",
    "def f(x):\n    return x ** two  # code",
]


@pytest.fixture(scope="module")
def tokenizers_pair(smollm2_gguf):
    ours = read_gguf(smollm2_gguf).tokenizer
    reference = transformers.AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    return ours, reference


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(tokenizers_pair, text):
    ours, reference = tokenizers_pair
    ids = ours.encode(text)
    assert ids == reference.encode(text, add_special_tokens=False)
    assert ours.decode(ids, skip_special_tokens=False) == text


def test_digits_split_one_by_one_like_smollm(tokenizers_pair):
    # SmolLM's own tokenizer (and llama.cpp's `smollm` pre-tokenizer) split every digit apart.
    ours, _ = tokenizers_pair
    ids = ours.encode("2024")
    assert [ours.decode([i]) for i in ids] == ["2", "0", "2", "4"]


def test_special_ids_and_template(tokenizers_pair):
    ours, reference = tokenizers_pair
    assert ours.eos_token_ids == (2,)
    assert ours.eos_token == "<|im_end|>"
    messages = [{"role": "user", "content": "What is 2+2?"}]
    expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.render_chat(messages) == expected
    assert ours.encode_chat(messages) == ours.encode(expected, add_special_tokens=False)
