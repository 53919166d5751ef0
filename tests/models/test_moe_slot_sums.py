"""A MoE block's unsummed slots (`SlotPartials`) go to the kernel after it, which adds them itself: in
Qwen3-Next the residual add + norm (the next layer's input norm, or the final norm), in Qwen3.8-Flash-Next
the hyper-connection inject. The logits are bit for bit those of the block summing its slots first, and
every MoE layer's output goes that way where the fused decode kernels run. On the CPU those kernels run in
Triton's interpreter (their path forced, as CUDA takes it at decode sizes) and the consumer sums the
slots with `summed()`; tests/ops/test_add_rms_norm.py and test_hyper_connection_triton.py check, on CUDA
too, the kernels that add the slots, bit for bit against the sum kernel they save."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import morion.models.qwen4_exp as qwen4_exp
from morion.layers.moe import SparseMoE, StackedExperts
from morion.layers.norm_variants import ZeroCentredRMSNorm
from morion.ops.slot_partials import SlotPartials
from tests.models.conftest import QWEN4_EXP_TINY, one_shot_logits

# The fused kernels forced on the tiny models' CPU tensors run in Triton's interpreter, which the test
# session turns on only where no GPU is (tests/conftest.py); on a GPU the qualification covers the path.
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="needs Triton's interpreter (no GPU)")


def _compare(trunk: torch.nn.Module, logits: Callable[[], torch.Tensor], received: list, monkeypatch) -> None:
    """Logits with the slots handed on (every MoE layer's of the `trunk`, the layers a forward runs: not
    the MTP head's; `received` records the consumer's inputs) against the blocks summing them first."""
    unsummed = logits()
    moe_layers = sum(isinstance(module, SparseMoE) for module in trunk.modules())
    assert moe_layers > 0 and received.count(SlotPartials) == moe_layers
    forward = StackedExperts.forward

    def summing(self, *args, unsummed=False, **options):
        return forward(self, *args, **options)

    monkeypatch.setattr(StackedExperts, "forward", summing)
    received.clear()
    summed = logits()
    assert SlotPartials not in received
    assert torch.equal(unsummed, summed)


@pytest.fixture
def fused_experts(monkeypatch):
    """The fused decode kernels for every MoE block, at any size, on the CPU (the interpreter)."""
    monkeypatch.setattr(StackedExperts, "_path", lambda self, x, num_pairs: "triton")


def test_qwen3_next_norms_add_the_slots(tiny_qwen3_next, prefill_logits, fused_experts, monkeypatch):
    model = tiny_qwen3_next.model
    received: list[type] = []
    add_and_norm = ZeroCentredRMSNorm.add_and_norm

    def spy(self, x, residual, quantize=False):
        received.append(type(x))
        return add_and_norm(self, x, residual, quantize)

    monkeypatch.setattr(ZeroCentredRMSNorm, "add_and_norm", spy)
    prompt = torch.randint(0, 512, (7,), generator=torch.Generator().manual_seed(11)).tolist()
    _compare(model.model.layers, lambda: prefill_logits(model, prompt), received, monkeypatch)


def test_flash_next_injects_add_the_slots(qwen4_exp_tiny, fused_experts, monkeypatch):
    model = qwen4_exp_tiny.model
    received: list[type] = []
    inject = qwen4_exp.inject

    def spy(streams, block_out, weights):
        received.append(type(block_out))
        return inject(streams, block_out, weights)

    monkeypatch.setattr(qwen4_exp, "inject", spy)
    vocab = QWEN4_EXP_TINY["vocab_size"]
    prompt = torch.randint(0, vocab, (6,), generator=torch.Generator().manual_seed(12)).tolist()
    _compare(model.model.layers, lambda: one_shot_logits(model, prompt, 16), received, monkeypatch)
