"""FR-Spec's reduced LM head (`spec/mtp.reduced_head`): the full head's logits at the map's ids, for an
unquantized head, tied embeddings and an FP8 head (`--weight-dtype fp8`)."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from morion.layers.linear_fp8 import Fp8Linear
from morion.ops.fp8 import quantize_fp8_
from morion.spec.mtp import reduced_head

HIDDEN, VOCAB = 32, 96
TOKEN_MAP = torch.tensor([0, 1, 2, 7, 50, 95, 30])


def _model(head: nn.Module | None) -> nn.Module:
    embed = nn.Embedding(VOCAB, HIDDEN)
    nn.init.normal_(embed.weight)
    return types.SimpleNamespace(lm_head=head, model=types.SimpleNamespace(embed_tokens=embed))


def _fp8_head() -> Fp8Linear:
    dense = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(1))
    head = Fp8Linear(HIDDEN, VOCAB)
    quantize_fp8_(dense, head.weight, head.weight_scale)
    return head


@pytest.mark.parametrize("kind", ["linear", "tied", "fp8"])
def test_reduced_logits_are_the_full_heads_at_the_map(kind):
    torch.manual_seed(0)
    head = {"linear": nn.Linear(HIDDEN, VOCAB, bias=False), "tied": None, "fp8": _fp8_head()}[kind]
    model = _model(head)
    x = torch.randn(5, HIDDEN)
    full = head(x) if head is not None else x @ model.model.embed_tokens.weight.T
    reduced = reduced_head(model, TOKEN_MAP)
    assert isinstance(reduced, Fp8Linear) == (kind == "fp8")
    out = reduced(x)
    assert out.shape == (5, len(TOKEN_MAP))
    torch.testing.assert_close(out, full.detach()[:, TOKEN_MAP], atol=1e-5, rtol=1e-5)
