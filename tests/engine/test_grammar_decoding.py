"""Grammar-constrained decoding in the engine: xgrammar's bitmask applied before sampling, the matcher
advanced per accepted token, constrained and free requests in one batch."""

from __future__ import annotations

import json
import re

import pytest
import torch

from morion.engine.grammar import (
    GrammarCompilerCache,
    GrammarError,
    GrammarLRU,
    GrammarSpec,
    apply_grammar_masks,
)
from morion.engine.sampling_params import SamplingParams
from morion.llm import LLM

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "none"]},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(smollm2_gguf) -> LLM:
    torch.set_num_threads(1)
    return LLM(str(smollm2_gguf), device="cpu", kv_cache_tokens=4096, max_model_len=1024)


@pytest.fixture(scope="module")
def compiler(llm: LLM) -> GrammarCompilerCache:
    return GrammarCompilerCache(llm.tokenizer, llm.engine.model.config.vocab_size)


def test_schema_and_regex_hold_under_sampling_beside_a_free_request(llm, compiler) -> None:
    schema = compiler.compile(GrammarSpec("json_schema", json.dumps(SCHEMA)))
    assert compiler.compile(GrammarSpec("json_schema", json.dumps(SCHEMA))) is schema  # cached
    regex = compiler.compile(GrammarSpec("regex", r"(yes|no), [0-9]{1,3}"))
    prompt = llm.encode_chat([{"role": "user", "content": "Describe a person as JSON."}])
    params = [SamplingParams(max_tokens=64, temperature=1.0, seed=seed, grammar=schema) for seed in range(3)]
    params += [
        SamplingParams(max_tokens=16, temperature=1.0, seed=7, grammar=regex),
        SamplingParams(max_tokens=8, temperature=1.0, seed=8),
    ]
    outputs = llm.generate([prompt] * len(params), params)
    for output in outputs[:3]:
        assert output.finish_reason == "stop", output.text
        value = json.loads(output.text)
        assert set(value) == {"name", "age", "pet"} and value["pet"] in ("cat", "dog", "none")
        assert isinstance(value["age"], int) and len(value["name"]) <= 12
    assert re.fullmatch(r"(yes|no), [0-9]{1,3}", outputs[3].text), outputs[3].text
    assert outputs[4].finish_reason in ("stop", "length")


def test_invalid_specs_name_the_problem(compiler) -> None:
    with pytest.raises(GrammarError, match="objectx"):
        compiler.compile(GrammarSpec("json_schema", '{"type": "objectx"}'))
    with pytest.raises(GrammarError, match="parenthesis"):
        compiler.compile(GrammarSpec("regex", "a(b"))


def test_mask_touches_only_constrained_rows(llm, compiler) -> None:
    matcher = llm.engine.grammars.matcher(compiler.compile(GrammarSpec("regex", "7")))
    vocab = llm.engine.model.config.vocab_size
    scores = torch.zeros(2, vocab)
    apply_grammar_masks(scores, [None, matcher])
    assert torch.isfinite(scores[0]).all()
    allowed = torch.isfinite(scores[1]).nonzero().flatten().tolist()
    assert [llm.tokenizer.decode([t]) for t in allowed] == ["7"]


def test_grammar_caches_are_bounded_in_entries_and_in_bytes():
    """The compiled grammars a process keeps after their requests end (front end and engine alike): one
    grammar can take hundreds of megabytes, so a count alone bounds nothing."""
    cache = GrammarLRU(max_entries=3, max_bytes=100)
    for key, size in (("a", 40), ("b", 40), ("c", 10)):
        cache.put(key, key.upper(), size)
    assert (len(cache), cache.nbytes) == (3, 90)
    cache.get("a")  # used: now the most recent
    cache.put("d", "D", 30)  # 120 bytes: the least recently used goes
    assert cache.get("b") is None and cache.get("a") == "A" and cache.nbytes == 80
    cache.put("e", "E", 5)  # 4 entries: one more goes
    assert len(cache) == 3 and cache.get("c") is None
    cache.put("huge", "H", 101)  # alone over the bound: never kept
    assert cache.get("huge") is None and cache.nbytes <= 100
