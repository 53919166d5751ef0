"""A Qwen3-Next layer hands its MoE block's unsummed slots (`SlotPartials`) to the add + norm after it
(the next layer's input norm, or the final norm), which adds them itself: the logits are bit for bit
those of the block summing them first, and every MoE layer's output goes that way where the fused decode
kernels run. On the CPU those kernels run in Triton's interpreter (their path forced, as CUDA takes it at
decode sizes) and the add + norm in torch after `summed()`; tests/ops/test_add_rms_norm.py checks the
kernel that adds the slots on CUDA, bit for bit against the sum kernel before it."""

from __future__ import annotations

import torch

from morion.layers.moe import SparseMoE, StackedExperts
from morion.layers.norm_variants import ZeroCentredRMSNorm
from morion.ops.slot_partials import SlotPartials


def test_unsummed_moe_slots_give_the_summed_blocks_logits(tiny_qwen3_next, prefill_logits, monkeypatch):
    model = tiny_qwen3_next.model
    monkeypatch.setattr(StackedExperts, "_path", lambda self, x, num_pairs: "triton")
    received: list[type] = []
    add_and_norm = ZeroCentredRMSNorm.add_and_norm

    def spy(self, x, residual, quantize=False):
        received.append(type(x))
        return add_and_norm(self, x, residual, quantize)

    monkeypatch.setattr(ZeroCentredRMSNorm, "add_and_norm", spy)
    prompt = torch.randint(0, 512, (7,), generator=torch.Generator().manual_seed(11)).tolist()
    unsummed = prefill_logits(model, prompt)
    moe_layers = sum(isinstance(module, SparseMoE) for module in model.model.layers.modules())
    assert moe_layers == len(model.model.layers)  # the tiny model's layers are all sparse
    assert received.count(SlotPartials) == moe_layers

    forward = StackedExperts.forward

    def summing(self, *args, unsummed=False, **options):
        return forward(self, *args, **options)

    monkeypatch.setattr(StackedExperts, "forward", summing)
    received.clear()
    summed = prefill_logits(model, prompt)
    assert SlotPartials not in received
    assert torch.equal(unsummed, summed)
