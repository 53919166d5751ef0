"""Tokenizer files of a Hugging Face model directory, against transformers reading the same files."""

from __future__ import annotations

import transformers

from morion.loader.hf_tokenizer import load_hf_tokenizer


def test_hf_directory_tokenizer_matches_transformers(tmp_path, smollm2_gguf):
    source = transformers.AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    source.save_pretrained(tmp_path)
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ours = load_hf_tokenizer(tmp_path, {"eos_token_id": 2})
    assert ours is not None
    for text in ["Hello there!", "tabs\tand\nlines", "émoji 🙂", "<|im_end|>"]:
        assert ours.encode(text) == reference.encode(text)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert ours.render_chat(messages) == reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert 2 in ours.eos_token_ids


def test_weights_only_directory_has_no_tokenizer(tmp_path):
    assert load_hf_tokenizer(tmp_path, {}) is None
