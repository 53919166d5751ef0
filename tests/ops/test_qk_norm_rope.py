"""Gated attention's fused q/k norm + partial RoPE kernel against the eager sequence it replaces on CUDA
(ZeroCentredRMSNorm, then apply_rotary): in Triton's interpreter here (fp32 and fp16: the interpreter has
no bf16), compiled at the 80B model's shapes in bf16 and fp32 on a GPU."""

from __future__ import annotations

import copy

import pytest
import torch

from morion.layers.gated_attention import norm_and_rotate
from morion.layers.norm_variants import ZeroCentredRMSNorm
from morion.layers.rotary import RotaryEmbedding, apply_rotary
from morion.ops import qk_norm_rope_triton as heads
from morion.ops import row_kernels_triton as rows

EPS = 1e-6
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # where the unmarked tests run the kernel
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 1e4}


def _norms(head_dim: int, dtype: torch.dtype, device: str = DEVICE) -> tuple[ZeroCentredRMSNorm, ...]:
    generator = torch.Generator().manual_seed(3)
    norms = []
    for _ in range(2):
        norm = ZeroCentredRMSNorm(head_dim, EPS)
        with torch.no_grad():
            norm.weight.normal_(0.0, 0.5, generator=generator)
        norms.append(norm.to(device=device, dtype=dtype))
    return tuple(norms)


def _heads(tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device=DEVICE):
    """q (the query half of a gated q_proj output, a strided view) and k [T, Hkv, D], and the gate."""
    generator = torch.Generator().manual_seed(1)
    q_gate = torch.randn(tokens, num_heads, 2 * head_dim, generator=generator) * 3
    k = torch.randn(tokens, num_kv_heads * head_dim, generator=generator) * 3
    q_gate, k = q_gate.to(device=device, dtype=dtype), k.to(device=device, dtype=dtype)
    q, gate = q_gate.chunk(2, dim=-1)
    return q, k.view(tokens, num_kv_heads, head_dim), gate


def _rotation(rotary_dim: int, positions: torch.Tensor, rope: dict | None = None, sections=None):
    rope = rope or {"rope_type": "default", "rope_theta": 1e4}
    return RotaryEmbedding(rotary_dim, rope, sections)(positions.to(DEVICE))


def _assert_same(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Bit for bit in the interpreter; compiled, the row kernel's sum of squares may reduce in another
    order, so within an ulp of the dtype, or 4 in fp32 (measured on the H200: 4.8e-7 at a value of 2.4,
    where the rotary's a * cos + b * sin carries the inverse RMS's last-bit difference of both terms)."""
    if got.device.type == "cpu":
        assert torch.equal(got, expected)
    else:
        ulp = torch.finfo(got.dtype).eps * (4 if got.dtype == torch.float32 else 1)
        torch.testing.assert_close(got, expected, rtol=ulp, atol=ulp)


def _row_kernel_sequence(q, k, q_norm, k_norm, cos, sin):
    """Today's CUDA path before the fused kernel: the norm row kernel, then apply_rotary in torch."""
    normed_q = rows.rms_norm_rows(q, q_norm.weight, EPS, rows.ZERO_CENTRED)
    normed_k = rows.rms_norm_rows(k, k_norm.weight, EPS, rows.ZERO_CENTRED)
    return apply_rotary(normed_q, cos, sin), apply_rotary(normed_k, cos, sin)


CASES = {
    "partial": (5, 4, 2, 32, 8),  # tokens, heads, kv heads, head_dim, rotary_dim: Qwen3-Next's quarter
    "full": (3, 2, 1, 16, 16),
    "odd head_dim": (2, 3, 1, 24, 12),  # a block wider than the head
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_kernel_equals_the_row_kernel_sequence(case, dtype):
    """Bit for bit against the sequence it replaces (the norm's row kernel has the same sum of squares)."""
    tokens, num_heads, num_kv_heads, head_dim, rotary_dim = case
    q, k, _ = _heads(tokens, num_heads, num_kv_heads, head_dim, dtype)
    q_norm, k_norm = _norms(head_dim, dtype)
    cos, sin = _rotation(rotary_dim, torch.arange(7, 7 + tokens))
    got_q, got_k = heads.qk_norm_rope(q, k, q_norm.weight, k_norm.weight, EPS, cos, sin)
    expected_q, expected_k = _row_kernel_sequence(q, k, q_norm, k_norm, cos, sin)
    assert got_q.is_contiguous() and got_q.dtype == dtype and got_q.shape == q.shape
    _assert_same(got_q, expected_q)
    _assert_same(got_k, expected_k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_matches_the_eager_reference(dtype):
    """Against the layer's eager code (torch's own sum of squares): within one ulp of the dtype."""
    q, k, _ = _heads(4, 4, 2, 32, dtype)
    q_norm, k_norm = _norms(32, dtype)
    cos, sin = _rotation(8, torch.arange(4))
    got = heads.qk_norm_rope(q, k, q_norm.weight, k_norm.weight, EPS, cos, sin)
    cpu_norms = (copy.deepcopy(q_norm).cpu(), copy.deepcopy(k_norm).cpu())
    expected = norm_and_rotate(q.cpu(), k.cpu(), *cpu_norms, cos.cpu(), sin.cpu())  # CPU: the eager code
    tolerance = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-3, "atol": 1e-3}
    for got_part, expected_part in zip(got, expected, strict=True):
        torch.testing.assert_close(got_part.cpu(), expected_part, **tolerance)


@pytest.mark.parametrize(
    "rotation",
    [
        pytest.param((YARN, None, torch.arange(40, 45)), id="yarn"),
        pytest.param(
            (
                {"rope_type": "default", "rope_theta": 1e4},
                (2, 1, 1),
                torch.tensor([[3, 4, 5], [0, 1, 2], [7, 1, 0]]),
            ),
            id="mrope positions per axis",
        ),
    ],
)
def test_scaled_and_multi_axis_rotations(rotation):
    """YaRN's attention factor and mRoPE's per-axis positions are in cos/sin: the kernel takes them as is."""
    rope, sections, positions = rotation
    tokens = positions.shape[-1]
    q, k, _ = _heads(tokens, 4, 2, 32, torch.float32)
    q_norm, k_norm = _norms(32, torch.float32)
    cos, sin = _rotation(16, positions, rope, sections)
    got = heads.qk_norm_rope(q, k, q_norm.weight, k_norm.weight, EPS, cos, sin)
    expected = _row_kernel_sequence(q, k, q_norm, k_norm, cos, sin)
    for got_part, expected_part in zip(got, expected, strict=True):
        _assert_same(got_part, expected_part)


def test_a_row_does_not_depend_on_its_batch():
    q, k, _ = _heads(6, 4, 2, 32, torch.float32)
    q_norm, k_norm = _norms(32, torch.float32)
    cos, sin = _rotation(8, torch.arange(6))
    batched_q, batched_k = heads.qk_norm_rope(q, k, q_norm.weight, k_norm.weight, EPS, cos, sin)
    single_q, single_k = heads.qk_norm_rope(
        q[3:4], k[3:4], q_norm.weight, k_norm.weight, EPS, cos[3:4], sin[3:4]
    )
    assert torch.equal(batched_q[3:4], single_q) and torch.equal(batched_k[3:4], single_k)


def test_empty_batch_and_supported_shapes():
    q, k, _ = _heads(0, 2, 1, 16, torch.float32)
    cos, sin = torch.zeros(0, 8), torch.zeros(0, 8)
    got_q, got_k = heads.qk_norm_rope(q, k, torch.zeros(16), torch.zeros(16), EPS, cos, sin)
    assert got_q.shape == (0, 2, 16) and got_k.shape == (0, 1, 16)
    q, k, _ = _heads(2, 2, 1, 16, torch.float32)
    assert heads.supports(q, k, torch.zeros(2, 8), torch.zeros(2, 8))
    assert not heads.supports(q, k, torch.zeros(2, 7), torch.zeros(2, 7))  # an odd rotary_dim
    assert not heads.supports(q, k, torch.zeros(2, 32), torch.zeros(2, 32))  # wider than the head
    assert not heads.supports(q, k, torch.zeros(8, 2).t(), torch.zeros(8, 2).t())  # strided cos


# The 80B model's shapes (models/presets.py): 16 query heads, 2 K/V heads, head_dim 256, a quarter rotated.
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, ROTARY_DIM = 16, 2, 256, 64


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 4, 64, 1000])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_on_the_gpu_at_the_80b_shapes(dtype, tokens):
    """Compiled: within an ulp of the sequence it replaced on CUDA (the norm's row kernel, torch's rotary;
    measured on the H200: bf16 differs in the last bit of some elements, the row kernel's sum of squares
    reduces in another order), a row's result the same alone as in the batch, and within an ulp or two of
    the eager CPU reference."""
    q, k, _ = _heads(tokens, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, dtype, "cuda")
    q_norm, k_norm = _norms(HEAD_DIM, dtype, "cuda")
    cos, sin = _rotation(ROTARY_DIM, torch.arange(100, 100 + tokens, device="cuda"), YARN)
    got = heads.qk_norm_rope(q, k, q_norm.weight, k_norm.weight, EPS, cos, sin)
    expected = _row_kernel_sequence(q, k, q_norm, k_norm, cos, sin)
    # fp32: a few ulps of the values' scale (H200: 7.2e-7 on elements of order 1, 6 of 4.1 M, where the
    # rotary's sum cancels and keeps the inverse RMS's last-bit difference).
    ulp = {torch.bfloat16: 2.0**-7, torch.float32: 2.0**-20}[dtype]
    for got_part, expected_part in zip(got, expected, strict=True):
        torch.testing.assert_close(got_part, expected_part, rtol=ulp, atol=ulp)
    alone = heads.qk_norm_rope(q[-1:], k[-1:], q_norm.weight, k_norm.weight, EPS, cos[-1:], sin[-1:])
    assert torch.equal(alone[0], got[0][-1:]) and torch.equal(alone[1], got[1][-1:])
    cpu_norms = (q_norm.cpu(), k_norm.cpu())
    reference = norm_and_rotate(q.cpu(), k.cpu(), *cpu_norms, cos.cpu(), sin.cpu())
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 1e-2}
    for got_part, reference_part in zip(got, reference, strict=True):
        torch.testing.assert_close(got_part.cpu(), reference_part, **tolerance)
