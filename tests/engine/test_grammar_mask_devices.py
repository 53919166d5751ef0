"""The grammar mask on every device there is (the CPU here; CUDA too where present: xgrammar applies the
bitmask with its Triton kernel there), on a tiny word-level tokenizer so no model is needed."""

from __future__ import annotations

import re

import pytest
import torch
from tokenizers import Tokenizer as FastTokenizer
from tokenizers import models, pre_tokenizers

from morion.engine.grammar import GrammarCompilerCache, GrammarRuntime, GrammarSpec
from morion.engine.sampler import RequestSampler, sample
from morion.engine.sampling_params import SamplingParams
from morion.text.tokenizer import Tokenizer

VOCAB = ["</s>", *"abcxyz{}:,0123456789"]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    fast = FastTokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token="</s>"))
    fast.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return Tokenizer(fast, eos_token_ids=[0], eos_token="</s>")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sampling_under_a_regex_mask_on_each_device(tokenizer, device, temperature):
    vocab_size = len(VOCAB) + 3  # logits wider than the vocabulary, as padded LM heads are
    compiled = GrammarCompilerCache(tokenizer, vocab_size).compile(GrammarSpec("regex", "[ab]{3}[0-9]"))
    runtime = GrammarRuntime(tokenizer, vocab_size)
    generator = torch.Generator().manual_seed(7)
    for trial in range(5):
        constrained = RequestSampler(
            SamplingParams(temperature=temperature, seed=trial), [1], runtime.matcher(compiled)
        )
        free = RequestSampler(SamplingParams(temperature=temperature, seed=trial), [1])
        text = ""
        while not constrained.grammar.terminated:
            # Random logits that favour forbidden tokens: only the mask keeps the output in the language.
            logits = torch.randn(2, vocab_size, generator=generator)
            logits[:, VOCAB.index("x")] += 20
            result = sample(logits.to(device), [constrained, free])
            token = result.token_ids[0]
            constrained.append(token)
            free.append(result.token_ids[1])
            text += VOCAB[token] if token else ""
            assert result.token_ids[1] == VOCAB.index("x") or temperature > 0  # the free row is untouched
        assert re.fullmatch("[ab]{3}[0-9]", text), text
