"""The shared expert stacked as expert E of the routed experts (`SparseMoE(stack_shared_expert=True)`)
computes what the separate formulation computes: routed + sigmoid(shared_expert_gate(x)) * shared_expert(x).
On the CPU through the reference experts; on a GPU (marked gpu) through the router kernel and the fused
and grouped expert kernels at the 80B preset's shapes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from morion.layers.fp8_convert import convert_to_fp8
from morion.layers.moe import SparseMoE


def separate_moe(
    hidden: int, experts: int, top_k: int, width: int, seed: int = 0, device: str = "cpu"
) -> SparseMoE:
    """A block in the separate layout with random weights, built and drawn on `device` (the 80B shapes'
    3 GB of fp32 experts take seconds on a GPU, tens of seconds on a CPU)."""
    generator = torch.Generator(device).manual_seed(seed)
    with torch.device(device):
        moe = SparseMoE(hidden, experts, top_k, width, width, norm_topk_prob=True)
    with torch.no_grad():
        for param in moe.parameters():
            draw = torch.randn(param.shape, generator=generator, device=device)
            param.copy_(draw * param.shape[-1] ** -0.5)
    return moe


def stacked_copy(separate: SparseMoE) -> SparseMoE:
    """The same block in the stacked layout: the shared expert at slot E, its gate the router's row E."""
    experts, width = separate.num_experts, separate.experts.intermediate_size
    with torch.device(separate.gate.weight.device):
        stacked = SparseMoE(
            separate.hidden_size, experts, separate.top_k, width, width, True, stack_shared_expert=True
        )
    shared = separate.shared_expert
    with torch.no_grad():
        stacked.gate.weight.copy_(torch.cat((separate.gate.weight, separate.shared_expert_gate.weight)))
        shared_gate_up = torch.cat((shared.gate_proj.weight, shared.up_proj.weight))
        stacked.experts.gate_up_proj.copy_(torch.cat((separate.experts.gate_up_proj, shared_gate_up[None])))
        stacked.experts.down_proj.copy_(
            torch.cat((separate.experts.down_proj, shared.down_proj.weight[None]))
        )
    return stacked


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
def test_stacked_equals_separate(dtype, tolerance):
    separate = separate_moe(64, 8, 2, 32)
    stacked = stacked_copy(separate).to(dtype)
    separate = separate.to(dtype)
    assert stacked.shared_slot == 8 and stacked.shared_expert is None
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    weights, ids = stacked.route(x)
    assert weights.shape == ids.shape == (37, 3) and (ids[:, 2] == 8).all()
    assert (ids[:, :2] < 8).all()  # the shared slot is never routed
    separate_weights, separate_ids = separate.route(x)
    assert torch.equal(ids[:, :2], separate_ids)
    torch.testing.assert_close(weights[:, :2], separate_weights)  # renormalised over the routed k only
    expected = separate(x).float()
    torch.testing.assert_close(stacked(x).float(), expected, rtol=tolerance, atol=tolerance)


def test_the_stacked_layout_is_only_for_equal_widths():
    with pytest.raises(ValueError, match="width 48 cannot stack with routed experts of width 32"):
        SparseMoE(64, 8, 2, 32, 48, True, stack_shared_expert=True)


def test_nvfp4_conversion_keeps_the_shared_expert_apart_and_fp8_keeps_it_stacked():
    with torch.device("meta"):
        nvfp4 = nn.Sequential(SparseMoE(64, 8, 2, 32, 32, True, stack_shared_expert=True)).to(torch.bfloat16)
        fp8 = nn.Sequential(SparseMoE(64, 8, 2, 32, 32, True, stack_shared_expert=True)).to(torch.bfloat16)
    convert_to_fp8(nvfp4, keep=("gate", "shared_expert_gate"), experts="nvfp4")
    block = nvfp4[0]
    assert block.shared_slot is None and block.experts.nvfp4 and block.experts.num_experts == 8
    assert block.gate.weight.shape == (8, 64) and block.gate.weight.dtype == torch.bfloat16
    assert block.shared_expert.down_proj.weight.dtype == torch.float8_e4m3fn  # FP8, as the dense layers
    assert block.shared_expert_gate.weight.shape == (1, 64)
    convert_to_fp8(fp8, keep=("gate",), experts="fp8")
    assert fp8[0].shared_slot == 8 and fp8[0].experts.fp8 and fp8[0].experts.num_experts == 9
    assert fp8[0].gate.weight.shape == (9, 64)


@pytest.fixture(scope="module")
def blocks_80b() -> tuple[SparseMoE, SparseMoE]:
    """(separate, stacked): the 80B preset's MoE block (hidden 2048, 512 experts of width 512, top 10) in
    both layouts with the same weights, bf16 on CUDA; built once for the module's GPU tests."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    separate = separate_moe(2048, 512, 10, 512, device="cuda")
    stacked = stacked_copy(separate).to(torch.bfloat16)
    return separate.to(torch.bfloat16), stacked


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 4, 64, 200])
def test_stacked_equals_separate_on_cuda_at_the_80b_shapes(blocks_80b, tokens):
    """Router kernel with the shared column, then the fused kernels (up to 64 tokens) or the grouped
    GEMMs (200), against the separate shared expert, in bf16."""
    separate, stacked = blocks_80b
    x = torch.randn(tokens, 2048, generator=torch.Generator().manual_seed(tokens)).cuda().bfloat16()
    _, ids = stacked.route(x)
    assert (ids[:, 10] == 512).all()
    expected = separate(x).float()
    scale = expected.abs().max().item()
    torch.testing.assert_close(stacked(x).float(), expected, rtol=2e-2, atol=2e-2 * scale)


@pytest.mark.gpu
def test_the_stacked_block_launches_the_shared_expert_s_kernels_no_more(blocks_80b):
    """One decode row through each block, kernels counted by the profiler: the separate shared expert's
    GEMMs, activation, sigmoid, multiply and add are gone (the experts' extra pair rides kernels that run
    anyway; its gate's narrow product stays)."""
    separate, stacked = blocks_80b
    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    counts = {}
    for name, block in (("separate", separate), ("stacked", stacked)):
        block(x)  # compile and autotune outside the count
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
            block(x)
            torch.cuda.synchronize()
        counts[name] = sum(1 for event in profile.events() if event.device_type.name == "CUDA")
    assert counts["stacked"] <= counts["separate"] - 6, counts


@pytest.mark.gpu
def test_a_token_s_route_does_not_depend_on_its_batch_on_cuda(blocks_80b):
    """The router's one product over the E + 1 rows (the skinny kernel at these sizes) gives a token the
    same logits, so the same route, alone and beside 1 to 15 others (a decode or short forward's sizes,
    engine/forward_groups.py), which cuBLAS's GEMM of N = E + 1 did not (layers/moe.py)."""
    _, stacked = blocks_80b
    x = torch.randn(16, 2048, generator=torch.Generator().manual_seed(5)).cuda().bfloat16()
    with torch.no_grad():
        logits, shared_logits = stacked.router_logits(x[:1])
        weights, ids = stacked.route(x[:1])
        for tokens in (2, 3, 4, 5, 8, 16):
            batch_logits, batch_shared_logits = stacked.router_logits(x[:tokens])
            assert torch.equal(batch_logits[:1], logits)
            assert torch.equal(batch_shared_logits[:1], shared_logits)
            batch_weights, batch_ids = stacked.route(x[:tokens])
            assert torch.equal(batch_weights[:1], weights) and torch.equal(batch_ids[:1], ids)
