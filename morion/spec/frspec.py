"""FR-Spec: a reduced draft vocabulary, so the drafter's LM head computes N rows instead of V.

The drafter's LM head is the largest part of a small draft model's step (Qwen3-Next: 151,936 rows of
2,048). FR-Spec (arXiv 2502.14856) keeps only the rows of tokens likely to be drafted: the drafter
proposes from the reduced vocabulary, its ids are mapped back to full ids, and the target verifies them
as usual. Output is unchanged: greedy verification compares full ids (a target token outside the map is
simply never drafted), and rejection sampling sees the draft distribution expanded to the full
vocabulary (zero outside the map), which is the distribution the drafts were really drawn from.

The map (`morion frspec build`) holds, sorted: every special token (the tokenizer's added tokens, both
control and user-defined such as tool-call and think markers, and the EOS ids: a drafter that cannot
propose the end of a turn or a tool call loses its best cases); the `base_count` lowest ids (in BPE
vocabularies the bytes and the earliest, most frequent merges); then the tokens most frequent in the
corpus (ties: lower id first); then, if the corpus runs out, the next lowest ids, so a map always has
exactly `size` ids (the draft head's shape is what was asked for). Pennyroyal's Flash-Next map is 65,536
ids with a base of 32,768, which is the default here: half the map.

File: JSON with a header (format, version, tokenizer source, SHA-256 of its canonical JSON and its
vocabulary size, size, base count, the special ids, corpus file names, bytes, tokens and SHA-256) and
`token_ids` with their SHA-256 (int64 little-endian bytes), checked on load.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from morion.errors import MorionError
from morion.json_file import read_json_file
from morion.loader import resolve_model_path
from morion.loader.tokenizer_loader import load_tokenizer
from morion.text.tokenizer import Tokenizer

FORMAT = "morion-frspec"
VERSION = 1
_CHUNK_CHARS = 1 << 20
_CHUNKS_PER_BATCH = 16  # encoded together (in parallel); bounds the encodings held at once
_LINE_START = re.compile(r"(?<=\n)(?=\S)")


def tokenizer_digest(tokenizer: Tokenizer) -> str:
    """Identity of a tokenizer: SHA-256 of its canonical `tokenizers` JSON (vocabulary, merges, added
    tokens, normalizer...), the same for a GGUF and a Hugging Face copy only if they tokenize alike."""
    return hashlib.sha256(tokenizer.backend.to_str().encode()).hexdigest()


def special_token_ids(tokenizer: Tokenizer) -> list[int]:
    """Every added token (control or user-defined) and every EOS id, sorted."""
    added = tokenizer.backend.get_added_tokens_decoder()
    return sorted(set(added) | set(tokenizer.eos_token_ids))


def build_token_map(
    tokenizer: Tokenizer,
    corpus: Sequence[str | Path],
    size: int,
    base_count: int | None = None,
    tokenizer_source: str = "",
) -> dict[str, Any]:
    """The map file's content (see the module doc); `base_count` defaults to half of `size`."""
    vocab_size = tokenizer.vocab_size
    base_count = size // 2 if base_count is None else base_count
    if not 1 <= size <= vocab_size:
        raise MorionError(f"--size must be in [1, {vocab_size}] (the tokenizer's vocabulary), got {size}")
    if not 0 <= base_count <= size:
        raise MorionError(f"--base-count must be in [0, {size}] (--size), got {base_count}")
    specials = special_token_ids(tokenizer)
    chosen = np.zeros(vocab_size, dtype=bool)
    chosen[specials] = True
    chosen[:base_count] = True
    if chosen.sum() > size:
        raise MorionError(
            f"--size {size} cannot hold {len(specials)} special tokens and the {base_count} lowest ids "
            f"({int(chosen.sum())} distinct ids); raise --size or lower --base-count"
        )
    counts, corpus_info = _count_tokens(tokenizer, corpus, vocab_size)
    by_frequency = np.argsort(-counts, kind="stable")  # descending count, lower id first on ties
    frequent = by_frequency[(counts[by_frequency] > 0) & ~chosen[by_frequency]]
    chosen[frequent[: size - int(chosen.sum())]] = True
    chosen[np.flatnonzero(~chosen)[: size - int(chosen.sum())]] = True
    token_ids = np.flatnonzero(chosen).astype(np.int64)
    tokenizer_info = {
        "source": tokenizer_source,
        "sha256": tokenizer_digest(tokenizer),
        "vocab_size": vocab_size,
    }
    return _map_file(tokenizer_info, base_count, specials, corpus_info, token_ids)


def lowest_ids_map(vocab_size: int, size: int) -> dict[str, Any]:
    """A map of the `size` lowest ids with no tokenizer or corpus behind it, for random-weight presets
    (`morion frspec lowest-ids`): at a forced acceptance a benchmark measures only the draft head's
    size, which this sets. Label results that use one as such."""
    if not 1 <= size <= vocab_size:
        raise MorionError(f"size must be in [1, {vocab_size}] (the vocabulary), got {size}")
    tokenizer_info = {"source": "none: the lowest ids", "sha256": None, "vocab_size": vocab_size}
    return _map_file(tokenizer_info, size, [], None, np.arange(size, dtype=np.int64))


def _map_file(
    tokenizer_info: dict[str, Any], base_count: int, specials: list[int], corpus: Any, token_ids: np.ndarray
) -> dict[str, Any]:
    """The map file's content (see the module doc) for sorted `token_ids`."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "tokenizer": tokenizer_info,
        "size": len(token_ids),
        "base_count": base_count,
        "special_ids": specials,
        "corpus": corpus,
        "ids_sha256": _ids_sha256(token_ids),
        "token_ids": token_ids.tolist(),
    }


def build_for_model(
    model: str, corpus: Sequence[str | Path], size: int, base_count: int | None = None
) -> dict[str, Any]:
    """`build_token_map` with the tokenizer of `model` (a directory, .gguf file or known model name)."""
    path = resolve_model_path(model)
    tokenizer = load_tokenizer(path)
    if tokenizer is None:
        raise MorionError(f"{path} has no tokenizer (tokenizer.json)")
    return build_token_map(tokenizer, corpus, size, base_count, tokenizer_source=model)


def write_token_map(data: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(data, separators=(",", ":")) + "\n")


def load_token_map(path: str | Path, vocab_size: int, tokenizer_sha256: str | None = None) -> torch.Tensor:
    """The map's ids as a sorted int64 tensor, after checking the file against itself and against the
    model (`vocab_size`: the LM head's rows) and, when given, the tokenizer's identity."""
    data = read_json_file(path, "token map")
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != VERSION:
        raise MorionError(f"token map {path}: not a {FORMAT} version {VERSION} file")
    ids = data.get("token_ids")
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise MorionError(f"token map {path}: token_ids must be a list of integers")
    token_ids = np.asarray(ids, dtype=np.int64)
    if len(ids) != data.get("size"):
        raise MorionError(f"token map {path}: size is {data.get('size')} but token_ids has {len(ids)} ids")
    if len(ids) == 0 or not (np.diff(token_ids) > 0).all():
        raise MorionError(f"token map {path}: token_ids must be non-empty and strictly increasing")
    if token_ids[0] < 0 or token_ids[-1] >= vocab_size:
        raise MorionError(
            f"token map {path}: token_ids must be in [0, {vocab_size}) (the model's vocabulary)"
        )
    if data.get("ids_sha256") != _ids_sha256(token_ids):
        raise MorionError(f"token map {path}: ids_sha256 does not match token_ids (corrupt or edited file)")
    built_for = data.get("tokenizer")
    built_for = built_for.get("sha256") if isinstance(built_for, dict) else None
    if tokenizer_sha256 is not None and built_for != tokenizer_sha256:
        raise MorionError(
            f"token map {path}: built for tokenizer {built_for}, not this model's {tokenizer_sha256}"
        )
    return torch.from_numpy(token_ids)


def reduced_lm_head(weight: torch.Tensor, token_map: torch.Tensor) -> torch.Tensor:
    """Rows `token_map` of an LM head weight [V, H]: a new [N, H] tensor on the weight's device."""
    if weight.dim() != 2 or int(token_map.max()) >= weight.shape[0]:
        raise ValueError(
            f"token map (max id {int(token_map.max())}) does not fit a weight {tuple(weight.shape)}"
        )
    return weight.index_select(0, token_map.to(weight.device))


def to_full_ids(reduced_ids: torch.Tensor, token_map: torch.Tensor) -> torch.Tensor:
    """Reduced-vocabulary ids (e.g. the draft head's argmax) → full-vocabulary ids."""
    return token_map.to(reduced_ids.device)[reduced_ids]


def expand_probs(probs_reduced: torch.Tensor, token_map: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[..., N] probabilities over the reduced vocabulary → [..., vocab_size], zero outside the map."""
    full = probs_reduced.new_zeros(*probs_reduced.shape[:-1], vocab_size)
    return full.index_copy_(-1, token_map.to(probs_reduced.device), probs_reduced)


def _count_tokens(
    tokenizer: Tokenizer, corpus: Sequence[str | Path], vocab_size: int
) -> tuple[np.ndarray, dict]:
    """Token counts over the corpus files, with the corpus's identity for the header."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    digest = hashlib.sha256()
    total_bytes = 0
    for path in corpus:
        try:
            raw = Path(path).read_bytes()
        except OSError as error:
            raise MorionError(f"cannot read corpus file {path}: {error.strerror}") from None
        digest.update(hashlib.sha256(raw).digest())
        total_bytes += len(raw)
        chunks = list(_chunks(raw.decode("utf-8", errors="replace")))
        for start in range(0, len(chunks), _CHUNKS_PER_BATCH):
            batch = chunks[start : start + _CHUNKS_PER_BATCH]
            for encoding in tokenizer.backend.encode_batch(batch, add_special_tokens=False):
                counts += np.bincount(np.asarray(encoding.ids, dtype=np.int64), minlength=vocab_size)
    info = {
        "files": [Path(p).name for p in corpus],
        "bytes": total_bytes,
        "tokens": int(counts.sum()),
        "sha256": digest.hexdigest(),
    }
    return counts, info


def _chunks(text: str) -> Iterator[str]:
    """`text` in pieces of about `_CHUNK_CHARS` (encoded in parallel), cut only after a newline that
    starts a non-blank line. That is a pre-token boundary for the GPT-2, Llama 3 and Qwen split rules, so
    the counts are those of the whole text; a cut anywhere else would, e.g., split the newline-plus-
    indent tokens that code is full of."""
    start = 0
    while start < len(text):
        cut = _LINE_START.search(text, start + _CHUNK_CHARS) if start + _CHUNK_CHARS < len(text) else None
        end = cut.start() if cut else len(text)
        yield text[start:end]
        start = end


def _ids_sha256(token_ids: np.ndarray) -> str:
    return hashlib.sha256(token_ids.astype("<i8").tobytes()).hexdigest()
