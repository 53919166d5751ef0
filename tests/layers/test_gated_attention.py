"""Gated attention's projections and output gate against the code they replaced (each projection on its
own, the q/k norms, apply_rotary, sigmoid and o_proj one op at a time): on the CPU with full-precision
and FP8 projections, and on a GPU at the 80B model's shapes, where the fused kernels run."""

from __future__ import annotations

import pytest
import torch

from morion.layers.gated_attention import GatedAttention
from morion.layers.linear_fp8 import Fp8Linear
from morion.layers.rotary import RotaryEmbedding, apply_rotary
from morion.ops.fp8 import quantize_fp8_

ROPE = {"rope_type": "default", "rope_theta": 1e4}


def _layer(hidden: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, fp8: bool, device: str):
    torch.manual_seed(0)
    layer = GatedAttention(0, hidden, heads, kv_heads, head_dim, 1e-6)
    with torch.no_grad():
        for linear in (layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj):
            linear.weight.normal_(0.0, linear.in_features**-0.5)
        for norm in (layer.q_norm, layer.k_norm):
            norm.weight.normal_(0.0, 0.3)
    layer = layer.to(device=device, dtype=dtype)
    if fp8:
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            linear = getattr(layer, name)
            quantized = Fp8Linear.like(linear).to(device)
            quantize_fp8_(linear.weight, quantized.weight, quantized.weight_scale)
            setattr(layer, name, quantized)
    return layer


def _inputs(layer: GatedAttention, tokens: int, rotary_dim: int, dtype: torch.dtype, device: str):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, layer.q_proj.in_features, generator=generator).to(device=device, dtype=dtype)
    attended = torch.randn(tokens, layer.num_heads, layer.head_dim, generator=generator)
    cos, sin = RotaryEmbedding(rotary_dim, ROPE)(torch.arange(3, 3 + tokens, device=device))
    return x, attended.to(device=device, dtype=dtype), cos, sin


def _old_project(layer: GatedAttention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    tokens = x.shape[0]
    q, gate = layer.q_proj(x).view(tokens, layer.num_heads, 2 * layer.head_dim).chunk(2, dim=-1)
    q = layer.q_norm(q)
    k = layer.k_norm(layer.k_proj(x).view(tokens, layer.num_kv_heads, layer.head_dim))
    v = layer.v_proj(x).view(tokens, layer.num_kv_heads, layer.head_dim)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v, gate


def _old_gate_output(layer: GatedAttention, out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    tokens = out.shape[0]
    return layer.o_proj(out.reshape(tokens, -1) * torch.sigmoid(gate.reshape(tokens, -1)))


@pytest.mark.parametrize("fp8", [False, True], ids=["full precision", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_path_equals_the_old_code(dtype, fp8):
    """On the CPU the eager code is the reference: x quantized once for q/k/v and the gate applied before
    o_proj's quantization give the very bits of the old op-by-op code (full precision: within an ulp)."""
    layer = _layer(64, 4, 2, 16, dtype, fp8, "cpu")
    x, attended, cos, sin = _inputs(layer, 5, 8, dtype, "cpu")
    with torch.no_grad():
        got = layer.project(x, cos, sin)
        expected = _old_project(layer, x, cos, sin)
        for got_part, expected_part in zip(got, expected, strict=True):
            assert torch.equal(got_part, expected_part)
        got_out, expected_out = layer.gate_output(attended, got[3]), _old_gate_output(layer, attended, got[3])
        if fp8:
            assert torch.equal(got_out, expected_out)
        else:  # torch's sigmoid of the strided gate may take its scalar loop, the old contiguous copy a
            # vectorised one (machine-dependent last bits)
            torch.testing.assert_close(got_out, expected_out, rtol=torch.finfo(dtype).eps, atol=1e-6)
        assert layer.gate_output(attended[:0], got[3][:0]).shape == (0, 64)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 8, 300])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_cuda_path_at_the_80b_shapes(fp8, tokens):
    """Qwen3-Next-80B's attention (hidden 2048, 16 query heads, 2 K/V heads, head_dim 256, 64 dims
    rotated) in bf16: v and the gate bit for bit the old CUDA code's (one quantization per projection), q
    and k within an ulp of it (the fused norm + rotary kernel: tests/ops/test_qk_norm_rope.py); the output
    through o_proj bit for bit in bf16, and under FP8 within the fused sigmoid's bound (ops/fp8.py:
    quantize_fp8_sigmoid_gated)."""
    layer = _layer(2048, 16, 2, 256, torch.bfloat16, fp8, "cuda")
    x, attended, cos, sin = _inputs(layer, tokens, 64, torch.bfloat16, "cuda")
    with torch.no_grad():
        got = layer.project(x, cos, sin)
        expected = _old_project(layer, x, cos, sin)
        for got_part, expected_part in zip(got[:2], expected[:2], strict=True):
            torch.testing.assert_close(got_part, expected_part, rtol=2.0**-7, atol=2.0**-7)
        for got_part, expected_part in zip(got[2:], expected[2:], strict=True):
            assert torch.equal(got_part, expected_part)
        got_out = layer.gate_output(attended, got[3])
        expected_out = _old_gate_output(layer, attended, got[3])
    if not fp8:
        assert torch.equal(got_out, expected_out)
        return
    rows_equal = (got_out == expected_out).all(dim=-1).float().mean().item()
    relative = ((got_out.float() - expected_out.float()).norm() / expected_out.float().norm()).item()
    assert rows_equal > 0.5 and relative < 1e-2, (rows_equal, relative)
