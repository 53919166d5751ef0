"""The CUDA fast paths at Qwen3-Next shapes (E=512, top-10, H=2048, I=512): `torch._grouped_mm` (bf16)
and `torch._scaled_grouped_mm` (FP8 rowwise, sm90) MoE against the reference, the grouped MoE replayed
in a CUDA graph with new routing, `torch._scaled_mm` FP8 linear layers, and an FP8 load whose peak stays
at the FP8 model plus one tensor (skipped where there is no GPU)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from morion.layers.linear_fp8 import Fp8Linear
from morion.loader import load_model
from morion.ops.fp8 import fp8_linear_reference, quantize_fp8_
from morion.ops.moe import moe_experts_grouped, moe_experts_reference
from morion.ops.moe_tune import run_experts
from tests.ops.conftest import (
    CUDA,
    HIDDEN,
    graph_replays_with_new_routings,
    make_moe_batch,
    rel_l2,
)

pytestmark = pytest.mark.gpu

GIB = 1 << 30


@pytest.mark.parametrize("tokens", (1, 16, 256, 2048))
def test_grouped_bf16_matches_reference(moe_experts, tokens):
    batch = make_moe_batch(tokens, seed=tokens)
    out = run_experts(moe_experts_grouped, moe_experts["bf16"], *batch)
    expected = run_experts(moe_experts_reference, moe_experts["bf16"], *batch)
    assert out.dtype == torch.bfloat16 and out.shape == (tokens, HIDDEN)
    # bf16 on both sides, rounded in different places (a CPU run of both at H=2048, I=512: 5.5e-3).
    assert rel_l2(out, expected) < 1.5e-2


@pytest.mark.parametrize("tokens", (1, 16, 256, 2048))
def test_scaled_grouped_fp8_matches_reference(moe_experts, tokens):
    batch = make_moe_batch(tokens, seed=tokens)
    out = run_experts(moe_experts_grouped, moe_experts["fp8"], *batch)
    same_math = rel_l2(out, run_experts(moe_experts_reference, moe_experts["fp8"], *batch))
    to_bf16 = rel_l2(out, run_experts(moe_experts_reference, moe_experts["bf16"], *batch))
    # The reference computes the same quantized math in fp32; the kernel returns the gate/up product in
    # bf16 before SiLU and the second quantization, so some values land on the other side of an e4m3
    # rounding boundary. A CPU emulation with bf16 rounding at that point measured 1.9%.
    assert same_math < 4e-2
    # Against the bf16 experts: four e4m3-rounded operands (~3% rms each; the CPU emulation: 6.6%).
    assert to_bf16 < 0.12
    assert same_math < 0.5 * to_bf16  # closer to its own math than to the unquantized experts'


@pytest.mark.parametrize("kind", ("bf16", "fp8"))
def test_grouped_moe_replays_in_a_cuda_graph_with_new_routing(moe_experts, kind):
    weights = moe_experts[kind]
    replays = graph_replays_with_new_routings(
        lambda batch: run_experts(moe_experts_grouped, weights, *batch), warmups=3
    )
    for batch, replayed in replays:
        eager = run_experts(moe_experts_grouped, weights, *batch)
        assert rel_l2(replayed, eager) < 1e-3  # same kernels, same shapes: expected bit-identical


@pytest.mark.parametrize("rows", (1, 7, 300))
def test_fp8_linear_scaled_mm(rows):
    gen = torch.Generator(device=CUDA).manual_seed(rows)
    weight = torch.randn(HIDDEN, HIDDEN, device=CUDA, generator=gen).to(torch.bfloat16) * HIDDEN**-0.5
    layer = Fp8Linear(HIDDEN, HIDDEN).to(CUDA)
    quantize_fp8_(weight, layer.weight, layer.weight_scale)
    x = torch.randn(1, rows, HIDDEN, device=CUDA, generator=gen).to(torch.bfloat16)  # with a leading dim
    out = layer(x)
    assert out.shape == (1, rows, HIDDEN) and out.dtype == torch.bfloat16
    expected = fp8_linear_reference(x[0], layer.weight, layer.weight_scale)
    assert rel_l2(out[0], expected) < 1e-2  # the same quantized product; bf16 output rounding
    assert rel_l2(out[0], x[0] @ weight.t()) < 0.06  # e4m3 weight and activation (CPU: 3.8%)


def test_fp8_linear_without_kernel_shapes_falls_back():
    linear = nn.Linear(40, 24, device=CUDA, dtype=torch.bfloat16)
    layer = Fp8Linear.like(linear).to(CUDA)
    quantize_fp8_(linear.weight, layer.weight, layer.weight_scale)
    layer.bias.data.copy_(linear.bias)
    x = torch.randn(5, 40, device=CUDA, dtype=torch.bfloat16)
    with torch.no_grad():
        assert rel_l2(layer(x), linear(x)) < 0.06


def test_fp8_load_peaks_at_the_fp8_model_plus_one_tensor():
    """12 of the 80B preset's 48 layers, random weights drawn and quantized one expert at a time."""
    torch.cuda.empty_cache()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    model = load_model("preset:qwen3-next-80b-a3b-12l", torch.bfloat16, CUDA, weight_dtype="fp8").model
    tensors = [*model.parameters(), *model.buffers()]
    model_bytes = sum(t.numel() * t.element_size() for t in tensors)
    # The largest temporary is the LM head drawn in bf16 (151936 x 2048: 0.58 GiB) plus a 64 MiB chunk.
    assert torch.cuda.max_memory_allocated() - start - model_bytes < 1.0 * GIB
    assert torch.cuda.memory_allocated() - start - model_bytes < 0.05 * GIB  # temporaries freed
    assert torch.cuda.memory_reserved() - torch.cuda.memory_allocated() < 1.0 * GIB  # and returned
    del model, tensors
    torch.cuda.empty_cache()
