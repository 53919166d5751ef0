"""The shared expert stacked as expert E of the routed experts (`SparseMoE(stack_shared_expert=True)`)
computes what the separate formulation computes: routed + sigmoid(shared_expert_gate(x)) * shared_expert(x).
On the CPU through the reference experts; on a GPU (marked gpu) through the router kernel and the fused
and grouped expert kernels at the 80B preset's shapes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from morion.layers.fp8_convert import convert_to_fp8
from morion.layers.moe import SparseMoE, StackedExperts
from morion.ops.fp8 import quantize_fp8_
from morion.ops.nvfp4 import quantize_nvfp4_parts
from morion.ops.slot_partials import SlotPartials
from tests.conftest import with_shared_expert_beside


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


@pytest.mark.parametrize("stacked", [True, False])
def test_nvfp4_conversion_puts_the_shared_expert_beside_in_fp8_and_fp8_keeps_it_stacked(stacked):
    shared_width = 32 if stacked else 48
    with torch.device("meta"):
        nvfp4 = nn.Sequential(SparseMoE(64, 8, 2, 32, shared_width, True, stack_shared_expert=stacked))
        fp8 = nn.Sequential(SparseMoE(64, 8, 2, 32, 32, True, stack_shared_expert=True)).to(torch.bfloat16)
    convert_to_fp8(nvfp4.to(torch.bfloat16), keep=("gate",), experts="nvfp4")
    block = nvfp4[0]
    assert block.shared_slot is None and block.shared_expert is None and block.shared_expert_gate is None
    assert block.experts.nvfp4 and block.experts.num_experts == 8
    assert block.gate.weight.shape == (9, 64) and block.gate.weight.dtype == torch.bfloat16  # + its gate
    shared = block.shared_experts
    assert shared.fp8 and shared.num_experts == 1 and shared.intermediate_size == shared_width
    assert block.reads_fp8_rows  # the shared stack reads the rows a norm quantized
    convert_to_fp8(fp8, keep=("gate",), experts="fp8")
    assert fp8[0].shared_slot == 8 and fp8[0].experts.fp8 and fp8[0].experts.num_experts == 9
    assert fp8[0].gate.weight.shape == (9, 64)


def load_nvfp4_experts(experts: StackedExperts, gate_up: torch.Tensor, down: torch.Tensor) -> None:
    """Fills NVFP4 `experts` as the loader quantizes them (gate and up rows apart)."""
    for name, weight, parts in (("gate_up_proj", gate_up, 2), ("down_proj", down, 1)):
        quantized = quantize_nvfp4_parts(weight, parts)
        getattr(experts, name).copy_(quantized.codes)
        getattr(experts, f"{name}_scale").copy_(quantized.block_scales)
        getattr(experts, f"{name}_scale_2").copy_(quantized.global_scale)


def load_fp8_experts(experts: StackedExperts, gate_up: torch.Tensor, down: torch.Tensor) -> None:
    for name, weight in (("gate_up_proj", gate_up), ("down_proj", down)):
        quantize_fp8_(weight, getattr(experts, name), getattr(experts, f"{name}_scale"))


def beside_copy(block: SparseMoE) -> SparseMoE:
    """The same block (separate or stacked) in the beside layout: the shared expert the one expert of
    `shared_experts`, its gate the router's row E."""
    return with_shared_expert_beside(nn.Sequential(block))[0]


@pytest.mark.parametrize("layout", ["separate", "stacked"])
@pytest.mark.parametrize("tokens", [1, 37])
def test_beside_equals_separate(layout, tokens):
    separate = separate_moe(64, 8, 2, 32)
    beside = beside_copy(stacked_copy(separate) if layout == "stacked" else separate)
    assert beside.shared_experts.num_experts == 1 and beside.experts.num_experts == 8
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(2))
    (routed_weights, routed_ids), (shared_weights, shared_ids) = beside.route_apart(x)
    separate_weights, separate_ids = separate.route(x)
    assert torch.equal(routed_ids, separate_ids) and torch.equal(routed_weights, separate_weights)
    assert shared_ids.shape == (tokens, 1) and (shared_ids == 0).all()  # its stack's only expert
    torch.testing.assert_close(shared_weights, torch.sigmoid(separate.shared_expert_gate(x)))
    torch.testing.assert_close(beside(x), separate(x), rtol=2e-6, atol=2e-6)


@pytest.mark.usefixtures("exact_e4m3_casts_in_the_interpreter")
def test_a_beside_block_hands_its_slots_to_the_kernel_after_it(monkeypatch):
    """On the fused decode kernels (Triton's interpreter here; the CPU otherwise takes the reference) the
    routed NVFP4 stack and the FP8 shared stack each leave their slots unsummed, and the block returns
    the k + 1 slots in the stacked order: summed, what the block returns when asked for a sum, and the
    NVFP4 and FP8 references' sum."""
    with torch.device("meta"):
        block = nn.Sequential(SparseMoE(64, 8, 2, 32, 48, True))
    convert_to_fp8(block, keep=("gate",), experts="nvfp4")
    block = block.to_empty(device="cpu")[0]
    generator = torch.Generator().manual_seed(3)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    with torch.no_grad():
        block.gate.weight.copy_(draw(9, 64) / 8)
        load_nvfp4_experts(block.experts, draw(8, 64, 64) / 8, draw(8, 64, 32) / 6)
        load_fp8_experts(block.shared_experts, draw(1, 96, 64) / 8, draw(1, 64, 48) / 7)
    x = draw(3, 64)
    expected = block(x)  # the reference path of both stacks on the CPU
    monkeypatch.setattr(StackedExperts, "_path", lambda self, x, pairs: "triton")
    slots = block(x, unsummed=True)
    assert isinstance(slots, SlotPartials) and slots.values.shape == (3, 3, 64)
    summed = block(x)
    assert torch.equal(slots.summed(), summed)
    torch.testing.assert_close(summed, expected, rtol=1e-4, atol=1e-4)
    # The last slot is the shared expert's, weighted by its gate.
    (_, _), (shared_weights, shared_ids) = block.route_apart(x)
    alone = block.shared_experts(x, shared_weights, shared_ids, unsummed=True)
    assert torch.equal(slots.values[:, 2:], alone.values)


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


@pytest.fixture(scope="module")
def beside_80b(blocks_80b) -> SparseMoE:
    """The 80B block of `blocks_80b` as `--weight-dtype nvfp4` serves it: the routed experts NVFP4, the
    shared expert beside them in a one-expert FP8 stack, the router (with the shared gate's row) bf16."""
    separate, _ = blocks_80b
    with torch.device("meta"):
        block = nn.Sequential(SparseMoE(2048, 512, 10, 512, 512, True))
    convert_to_fp8(block.to(torch.bfloat16), keep=("gate",), experts="nvfp4")
    block = block.to_empty(device="cuda")[0]
    shared = separate.shared_expert
    with torch.no_grad():
        block.gate.weight.copy_(torch.cat((separate.gate.weight, separate.shared_expert_gate.weight)))
        load_nvfp4_experts(
            block.experts, separate.experts.gate_up_proj.float(), separate.experts.down_proj.float()
        )
        shared_gate_up = torch.cat((shared.gate_proj.weight, shared.up_proj.weight))[None].float()
        load_fp8_experts(block.shared_experts, shared_gate_up, shared.down_proj.weight[None].float())
    return block


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 4, 64, 200])
def test_a_beside_block_on_cuda_equals_its_references_at_the_80b_shapes(beside_80b, tokens, monkeypatch):
    """The router kernel's apart columns, then the NVFP4 and FP8 fused kernels (up to 64 tokens: their
    k + 1 slots, summed by the kernel after the block) or the grouped ones (200), against the same block
    on the references (NVFP4 dequantized, FP8 quantized per row, in the activations' dtype)."""
    x = torch.randn(tokens, 2048, generator=torch.Generator().manual_seed(tokens)).cuda().bfloat16()
    with torch.no_grad():
        served = beside_80b(x, unsummed=True)
        if tokens <= 64:
            assert isinstance(served, SlotPartials) and served.values.shape == (tokens, 11, 2048)
            served = served.summed()
        monkeypatch.setattr(StackedExperts, "_path", lambda self, x, pairs: "reference")
        expected = beside_80b(x).float()
    if tokens <= 64:
        scale = expected.abs().max().item()
        torch.testing.assert_close(served.float(), expected, rtol=2e-2, atol=2e-2 * scale)
    else:
        # The grouped kernels round where the reference's bf16 loop does not (NVFP4: the global scale in
        # an fp32 epilogue, not in bf16 weights; FP8: the activations quantized per row from differently
        # rounded values, so some e4m3 roundings flip). On the H200 that is a relative L2 error of 1.66e-2
        # over 200 tokens (4 of 409,600 values past 2 % of the scale). A wrong or missing slot (one of 11
        # per token, the shared expert's included) moves the whole by far more than 3e-2.
        relative = ((served.float() - expected).norm() / expected.norm()).item()
        assert relative < 3e-2, relative


@pytest.mark.gpu
def test_a_beside_block_s_decode_row_launches_a_handful_of_kernels(beside_80b):
    """One decode row: the router's product and route, the NVFP4 stack's two kernels, the FP8 stack's row
    quantization and two kernels, the slots side by side; split-K tiles add a sum kernel a stack. The
    separate SwiGLU's dozen kernels a layer under nvfp4 are gone."""
    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        beside_80b(x, unsummed=True)  # compile outside the count
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
            beside_80b(x, unsummed=True)
            torch.cuda.synchronize()
    kernels = [event.name for event in profile.events() if event.device_type.name == "CUDA"]
    print(f"beside block, one decode row: {len(kernels)} kernels: {kernels}")
    assert len(kernels) <= 12, kernels  # 8, and a split-K sum for each of the four expert kernels at most
