from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from tokenizers import AddedToken
from tokenizers import Tokenizer as FastTokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from morion.cli import main
from morion.errors import MorionError
from morion.loader.tokenizer_loader import load_tokenizer
from morion.spec import frspec
from morion.spec.frspec import (
    build_token_map,
    expand_probs,
    load_token_map,
    reduced_lm_head,
    special_token_ids,
    to_full_ids,
    tokenizer_digest,
    write_token_map,
)
from morion.text.tokenizer import Tokenizer

CORPUS = "def speculative_decoding(tokens):\n    return [token for token in tokens if token]\n" * 40


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_gguf) -> Tokenizer:
    tokenizer = load_tokenizer(smollm2_gguf)
    assert tokenizer is not None
    return tokenizer


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "code.py"
    path.write_text(CORPUS)
    return path


def test_map_holds_specials_lowest_ids_and_the_most_frequent_tokens(smollm2_tokenizer, corpus) -> None:
    size, base = 300, 100
    data = build_token_map(smollm2_tokenizer, [corpus], size, base, tokenizer_source="smollm2")
    ids = data["token_ids"]
    assert len(ids) == size == data["size"] and ids == sorted(set(ids))
    specials = special_token_ids(smollm2_tokenizer)
    assert specials == list(range(17))  # SmolLM2's added tokens <|endoftext|> .. <empty_output>
    assert set(specials) <= set(ids) and set(range(base)) <= set(ids)
    counts = Counter(smollm2_tokenizer.encode(CORPUS, add_special_tokens=False))
    assert set(counts) <= set(ids)  # the corpus has fewer distinct tokens than the map has room for
    # The rest is filled with the lowest ids left, so the map has exactly `size` ids.
    frequent = set(counts) - set(range(base))
    filler = sorted(set(ids) - set(range(base)) - frequent)
    assert filler == [i for i in range(base, max(ids) + 1) if i not in frequent][: len(filler)]
    assert data["tokenizer"] == {
        "source": "smollm2",
        "sha256": tokenizer_digest(smollm2_tokenizer),
        "vocab_size": 49152,
    }
    assert data["corpus"]["files"] == ["code.py"] and data["corpus"]["tokens"] == sum(counts.values())


def test_counts_equal_those_of_the_whole_text(smollm2_tokenizer, tmp_path, monkeypatch) -> None:
    """Large corpora are encoded in chunks; the cuts must not change a single count (indented code
    has newline-plus-indent tokens that a cut at every line would split)."""
    text = CORPUS.replace("return", "\n\n        return") + "  trailing \n\n\tspace"
    path = tmp_path / "corpus.txt"
    path.write_text(text)
    monkeypatch.setattr(frspec, "_CHUNK_CHARS", 50)
    monkeypatch.setattr(frspec, "_CHUNKS_PER_BATCH", 3)
    assert len(list(frspec._chunks(text))) > 20
    counts, info = frspec._count_tokens(smollm2_tokenizer, [path], smollm2_tokenizer.vocab_size)
    whole = Counter(smollm2_tokenizer.encode(text, add_special_tokens=False))
    assert {i: int(c) for i, c in enumerate(counts) if c} == dict(whole)
    assert info["tokens"] == sum(whole.values()) and info["bytes"] == len(text.encode())


def test_frequency_decides_when_the_map_is_tight(smollm2_tokenizer, corpus) -> None:
    counts = Counter(smollm2_tokenizer.encode(CORPUS, add_special_tokens=False))
    base = 20
    outside_base = [t for t, _ in sorted(counts.items(), key=lambda c: (-c[1], c[0])) if t >= base]
    data = build_token_map(smollm2_tokenizer, [corpus], base + 5, base)
    assert data["token_ids"] == sorted([*range(base), *outside_base[:5]])


def test_sizes_that_cannot_work_are_rejected(smollm2_tokenizer, corpus) -> None:
    with pytest.raises(MorionError, match="cannot hold 17 special tokens"):
        build_token_map(smollm2_tokenizer, [corpus], 10, 0)
    with pytest.raises(MorionError, match="--size must be in"):
        build_token_map(smollm2_tokenizer, [corpus], 50_000)
    with pytest.raises(MorionError, match="--base-count must be in"):
        build_token_map(smollm2_tokenizer, [corpus], 100, 101)
    with pytest.raises(MorionError, match="cannot read corpus file"):
        build_token_map(smollm2_tokenizer, [corpus.parent / "missing.txt"], 100)


@pytest.fixture(scope="module")
def map_file(smollm2_tokenizer, corpus, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("map") / "map.json"
    write_token_map(build_token_map(smollm2_tokenizer, [corpus], 256), path)
    return path


def test_load_round_trips(map_file, smollm2_tokenizer) -> None:
    token_map = load_token_map(map_file, 49152, tokenizer_digest(smollm2_tokenizer))
    assert (
        token_map.dtype == torch.int64 and token_map.tolist() == json.loads(map_file.read_text())["token_ids"]
    )


def edited(map_file: Path, tmp_path: Path, **changes) -> Path:
    data = json.loads(map_file.read_text())
    data.update(changes)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(
    "change,message",
    [
        ({"format": "other"}, "not a morion-frspec version 1 file"),
        ({"token_ids": "0,1"}, "token_ids must be a list of integers"),
        ({"size": 3}, "size is 3 but token_ids has 256 ids"),
        ({"token_ids": [5, 3], "size": 2}, "strictly increasing"),
        ({"token_ids": [1, 2, 49152], "size": 3}, "must be in [0, 49152)"),
        ({"token_ids": [1, 2, 3], "size": 3}, "ids_sha256 does not match"),
    ],
)
def test_load_rejects_bad_files(map_file, tmp_path, change, message) -> None:
    with pytest.raises(MorionError) as error:
        load_token_map(edited(map_file, tmp_path, **change), 49152)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_load_checks_the_model_and_tokenizer(map_file, tmp_path) -> None:
    with pytest.raises(MorionError, match=r"must be in \[0, 100\)"):
        load_token_map(map_file, 100)  # a model with a smaller vocabulary
    with pytest.raises(MorionError, match="built for tokenizer"):
        load_token_map(map_file, 49152, tokenizer_sha256="0" * 64)
    with pytest.raises(MorionError, match="cannot read token map"):
        load_token_map(tmp_path / "missing.json", 49152)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(MorionError, match="not valid JSON"):
        load_token_map(tmp_path / "bad.json", 49152)


def test_a_lowest_ids_map_for_presets_without_a_tokenizer(tmp_path) -> None:
    path = tmp_path / "lowest.json"
    write_token_map(frspec.lowest_ids_map(151936, 4096), path)
    assert torch.equal(load_token_map(path, 151936), torch.arange(4096))
    with pytest.raises(MorionError, match="built for tokenizer None"):
        load_token_map(path, 151936, tokenizer_sha256="0" * 64)  # a real model's tokenizer: refused
    with pytest.raises(MorionError, match=r"size must be in \[1, 100\]"):
        frspec.lowest_ids_map(100, 101)


def test_reduced_head_and_mapping_back_to_full_ids() -> None:
    generator = torch.Generator().manual_seed(0)
    vocab, hidden = 50, 8
    token_map = torch.tensor([0, 3, 7, 20, 49])
    weight = torch.randn(vocab, hidden, generator=generator)
    reduced = reduced_lm_head(weight, token_map)
    assert reduced.shape == (5, hidden) and torch.equal(reduced, weight[token_map])
    states = torch.randn(4, hidden, generator=generator)
    full_logits = states @ weight.T
    best = to_full_ids((states @ reduced.T).argmax(dim=-1), token_map)
    assert torch.equal(best, token_map[full_logits[:, token_map].argmax(dim=-1)])
    with pytest.raises(ValueError, match="does not fit"):
        reduced_lm_head(weight[:40], token_map)


def test_expand_probs_puts_mass_on_the_mapped_ids_only() -> None:
    token_map = torch.tensor([1, 4, 6])
    probs = torch.tensor([[0.2, 0.5, 0.3], [1.0, 0.0, 0.0]])
    full = expand_probs(probs, token_map, 8)
    assert full.shape == (2, 8)
    assert torch.equal(full[:, token_map], probs)
    assert full.sum().item() == pytest.approx(2.0) and full[:, [0, 2, 3, 5, 7]].abs().sum() == 0
    assert torch.equal(expand_probs(probs[0], token_map, 8), torch.tensor([0, 0.2, 0, 0, 0.5, 0, 0.3, 0]))


@pytest.fixture
def tiny_tokenizer_dir(tmp_path) -> Path:
    """A word-level tokenizer in a Hugging Face directory: 2 specials, one user-defined added token."""
    words = ["[UNK]", "<eos>", "the", "cat", "sat", "on", "mat", "dog", "ran", "far", "away", "fast"]
    backend = FastTokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = Whitespace()
    backend.add_special_tokens([AddedToken("[UNK]", special=True), AddedToken("<eos>", special=True)])
    backend.add_tokens([AddedToken("<tool>", special=False)])
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return tmp_path


def test_cli_builds_a_map(tiny_tokenizer_dir, tmp_path, capsys) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the dog ran far away\nthe dog ran fast\nthe dog sat\n")
    out = tmp_path / "map.json"
    args = ["frspec", "build", "--tokenizer", str(tiny_tokenizer_dir), "--corpus", str(corpus)]
    assert main([*args, "--size", "7", "--base-count", "2", "--out", str(out)]) == 0
    assert str(out) in capsys.readouterr().out
    # Specials 0, 1 and the added <tool> (12); lowest 0, 1; then by count: the, dog (3), ran (2), and of
    # the words seen once (far, away, fast, sat) the lowest id, sat.
    assert load_token_map(out, 13).tolist() == [0, 1, 2, 4, 7, 8, 12]
    assert main([*args, "--size", "2", "--out", str(out)]) == 1
    assert "morion: error: --size 2 cannot hold 3 special tokens" in capsys.readouterr().err


def test_cli_writes_a_lowest_ids_map_and_says_what_each_action_needs(tmp_path, capsys) -> None:
    out = tmp_path / "lowest.json"
    common = ["--size", "4096", "--out", str(out)]
    assert main(["frspec", "lowest-ids", "--vocab-size", "151936", *common]) == 0
    assert "the 4096 lowest of 151936 ids" in capsys.readouterr().out
    assert torch.equal(load_token_map(out, 151936), torch.arange(4096))
    assert main(["frspec", "lowest-ids", *common]) == 1
    assert "morion: error: frspec lowest-ids needs --vocab-size" in capsys.readouterr().err
    assert main(["frspec", "build", *common]) == 1
    assert "morion: error: frspec build needs --tokenizer and --corpus" in capsys.readouterr().err
