"""The grouped-GEMM MoE path (sorted pairs, device-side offsets, `torch._grouped_mm`) against the
per-expert reference loop, on the CPU: bf16/fp32 weights, and FP8 weights through the CPU emulation of
`torch._scaled_grouped_mm` (the kernel itself is sm90-only: tests/ops/test_moe_fp8_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from morion.ops.fp8 import QuantizedRows, quantize_fp8
from morion.ops.moe import moe_experts_dense, moe_experts_grouped, moe_experts_reference

EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = 8, 64, 32, 3
# Experts 0, 5 and 7 never get a token: empty groups at the start, in the middle and at the end.
ROUTABLE = torch.tensor([1, 2, 3, 4, 6])


def make_case(tokens: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, HIDDEN, generator=gen).to(dtype)
    gate_up = (torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=gen) * HIDDEN**-0.5).to(dtype)
    down = (torch.randn(EXPERTS, HIDDEN, INTERMEDIATE, generator=gen) * INTERMEDIATE**-0.5).to(dtype)
    # k distinct experts per token, in random order, like a top-k.
    picks = torch.rand(tokens, len(ROUTABLE), generator=gen).argsort(dim=-1)[:, :TOP_K]
    topk_ids = ROUTABLE[picks]
    topk_weights = torch.softmax(torch.randn(tokens, TOP_K, generator=gen), dim=-1).to(dtype)
    return hidden, gate_up, down, topk_weights, topk_ids


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


@pytest.mark.parametrize("tokens", (1, 37))
def test_grouped_equals_reference_fp32(tokens):
    hidden, gate_up, down, weights, ids = make_case(tokens, torch.float32)
    out = moe_experts_grouped(hidden, gate_up, down, weights, ids)
    expected = moe_experts_reference(hidden, gate_up, down, weights, ids)
    assert out.dtype == torch.float32 and out.shape == (tokens, HIDDEN)
    # Only the summation order differs (measured <= 6e-7 on outputs of magnitude ~2).
    assert torch.allclose(out, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("tokens", (1, 37))
def test_dense_equals_reference_fp32(tokens):
    hidden, gate_up, down, weights, ids = make_case(tokens, torch.float32, seed=5)
    out = moe_experts_dense(hidden, gate_up, down, weights, ids)
    expected = moe_experts_reference(hidden, gate_up, down, weights, ids)
    # Unrouted experts add exactly 0; only the summation order differs.
    assert torch.allclose(out, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("tokens", (1, 37))
def test_grouped_equals_reference_bf16(tokens):
    hidden, gate_up, down, weights, ids = make_case(tokens, torch.bfloat16)
    out = moe_experts_grouped(hidden, gate_up, down, weights, ids)
    expected = moe_experts_reference(hidden, gate_up, down, weights, ids)
    exact = moe_experts_reference(hidden.float(), gate_up.float(), down.float(), weights.float(), ids)
    assert out.dtype == torch.bfloat16
    # Both round to bf16 (8 bits) in different places: the reference adds the k expert outputs in bf16,
    # the grouped path weights the down projection's input and sums the k outputs in fp32. Each is
    # within a few bf16 roundings (2^-9 relative each) of the fp32 result, and so of the other
    # (measured 3e-3 to 5e-3).
    assert rel_l2(out, exact) < 1e-2
    assert rel_l2(out, expected) < 1e-2


def test_one_token_routed_to_every_reachable_expert():
    """k = 5: every non-empty group holds exactly one row."""
    hidden, gate_up, down, _, _ = make_case(1, torch.float32)
    ids = ROUTABLE[None, :]
    weights = torch.full(ids.shape, 1.0 / ids.shape[1])
    out = moe_experts_grouped(hidden, gate_up, down, weights, ids)
    assert torch.allclose(out, moe_experts_reference(hidden, gate_up, down, weights, ids), atol=1e-5, rtol=0)


def test_no_tokens():
    hidden, gate_up, down, weights, ids = make_case(0, torch.float32)
    assert moe_experts_grouped(hidden, gate_up, down, weights, ids).shape == (0, HIDDEN)


@pytest.mark.parametrize("tokens", (1, 37))
def test_fp8_grouped_emulation_equals_fp8_reference(tokens):
    """The FP8 path's sorting, scale gathering and per-row activation quantization, with the sm90
    kernel replaced by its fp32 emulation; the reference dequantizes per expert instead."""
    hidden, gate_up, down, weights, ids = make_case(tokens, torch.float32)
    gate_up_q, gate_up_scale = quantize_fp8(gate_up, per_row=True)
    down_q, down_scale = quantize_fp8(down, per_row=True)
    scales = dict(gate_up_scale=gate_up_scale, down_scale=down_scale)
    out = moe_experts_grouped(hidden, gate_up_q, down_q, weights, ids, **scales)
    expected = moe_experts_reference(hidden, gate_up_q, down_q, weights, ids, **scales)
    # Same quantized math in fp32 (measured <= 2e-7). Only the grouped path scales the down input by
    # the routing weight before quantizing it, which could move a value across an e4m3 rounding
    # boundary: hence 1e-3, not fp32 round-off.
    assert rel_l2(out, expected) < 1e-3
    # Against full precision: e4m3 keeps 3 mantissa bits (~2.6% rms error per rounded operand), four
    # operands are rounded on the way (measured 4-6%).
    full = moe_experts_reference(hidden, gate_up, down, weights, ids)
    assert rel_l2(out, full) < 0.1


@pytest.mark.parametrize(
    "experts", (moe_experts_grouped, moe_experts_reference), ids=("grouped", "reference")
)
def test_fp8_token_rows_given_quantized_are_read_as_they_are(experts):
    """`quantized` (the token rows quantized by the norm before, Qwen3-Next's decoder layer) gives the bits
    of quantizing them here."""
    hidden, gate_up, down, weights, ids = make_case(5, torch.float32)
    gate_up_q, gate_up_scale = quantize_fp8(gate_up, per_row=True)
    down_q, down_scale = quantize_fp8(down, per_row=True)
    scales = dict(gate_up_scale=gate_up_scale, down_scale=down_scale)
    quantized = QuantizedRows(*quantize_fp8(hidden, per_row=True))
    expected = experts(hidden, gate_up_q, down_q, weights, ids, **scales)
    assert torch.equal(
        experts(hidden, gate_up_q, down_q, weights, ids, **scales, quantized=quantized), expected
    )
