"""Builds a byte-level BPE tokenizer and chat template from GGUF `tokenizer.ggml.*` metadata."""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as FastTokenizer

from morion.errors import ModelLoadError
from morion.text.tokenizer import Tokenizer

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# GGUF token types (llama.cpp's llama_token_type).
_CONTROL = 3
_USER_DEFINED = 4


def _pre_tokenizer(name: str) -> pre_tokenizers.PreTokenizer:
    """The split rule the vocabulary's merges were learned with, keyed by `tokenizer.ggml.pre`."""
    byte_level_regex = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    byte_level_plain = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if name in ("default", "gpt-2", "gpt2"):
        return byte_level_regex
    if name == "smollm":  # digits one by one, then the GPT-2 split (as SmolLM's tokenizer.json)
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level_regex])
    splits = {
        "llama3": _LLAMA3_SPLIT,
        "llama-bpe": _LLAMA3_SPLIT,
        "llama-v3": _LLAMA3_SPLIT,
        "qwen2": _QWEN2_SPLIT,
    }
    if name in splits:
        split = pre_tokenizers.Split(Regex(splits[name]), behavior="isolated")
        return pre_tokenizers.Sequence([split, byte_level_plain])
    raise ModelLoadError(
        f"unsupported GGUF pre-tokenizer {name!r} (supported: gpt2, smollm, llama3/llama-bpe, qwen2)"
    )


def build_gguf_tokenizer(metadata: dict[str, Any]) -> Tokenizer:
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelLoadError(f"unsupported GGUF tokenizer model {kind!r} (supported: gpt2 byte-level BPE)")
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    token_types: list[int] = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(merge.split(" ", 1)) for merge in metadata.get("tokenizer.ggml.merges", [])]
    vocab = {token: index for index, token in enumerate(tokens)}
    backend = FastTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    backend.pre_tokenizer = _pre_tokenizer(metadata.get("tokenizer.ggml.pre", "default"))
    backend.decoder = decoders.ByteLevel()
    typed = list(zip(tokens, token_types, strict=True))
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in typed if k == _CONTROL]
    )
    backend.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, k in typed if k == _USER_DEFINED]
    )

    def token_at(key: str) -> str | None:
        index = metadata.get(key)
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    bos_token = token_at("tokenizer.ggml.bos_token_id")
    eos_token = token_at("tokenizer.ggml.eos_token_id")
    if metadata.get("tokenizer.ggml.add_bos_token") and bos_token is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos_token} $A",
            pair=f"{bos_token} $A {bos_token} $B",
            special_tokens=[(bos_token, vocab[bos_token])],
        )
    eos_ids = [
        metadata[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in metadata
    ]
    return Tokenizer(backend, eos_ids, bos_token, eos_token, metadata.get("tokenizer.chat_template"))
