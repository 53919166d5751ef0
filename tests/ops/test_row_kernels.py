"""The fused row kernels (RMSNorm variants, per-group weights, per-row FP8 quantization, row dot products)
against the torch code they replace on CUDA. On the CPU they run in Triton's interpreter (fp32 and fp16:
the interpreter has no bf16)."""

from __future__ import annotations

import pytest
import torch

from morion.layers.grouped_norm import GroupedRMSNorm
from morion.layers.norm import RMSNorm
from morion.layers.norm_variants import GatedRMSNorm, SigmoidGatedRMSNorm, ZeroCentredRMSNorm
from morion.layers.ple import stream_dots
from morion.ops import row_kernels_triton as rows
from morion.ops.fp8 import _cast, fp8_scale, quantize_fp8

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def _norm(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    with torch.no_grad():
        module.weight.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(3))
    return module.to(dtype)


def _torch_reference(module: torch.nn.Module, *args: torch.Tensor) -> torch.Tensor:
    """The module's own torch code, on the CPU (where it never dispatches to the kernel)."""
    return module.cpu()(*(a.cpu() for a in args))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("module_type", "mode"),
    [(RMSNorm, rows.LLAMA), (ZeroCentredRMSNorm, rows.ZERO_CENTRED)],
    ids=["llama", "zero_centred"],
)
def test_rms_norm_rows_matches_the_module(module_type, mode, dtype):
    module = _norm(module_type(48, 1e-6), dtype)
    x = torch.randn(5, 48, generator=torch.Generator().manual_seed(0)).to(dtype)
    expected = _torch_reference(module, x)
    got = rows.rms_norm_rows(x.to(DEVICE), module.weight.to(DEVICE), 1e-6, mode)
    assert got.dtype == dtype and got.shape == x.shape
    # Same rounding points; only the sum of squares may round differently (one ulp of the dtype).
    torch.testing.assert_close(got.cpu(), expected, rtol=2e-3 if dtype != torch.float32 else 1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_norm_on_strided_head_views(dtype):
    """[T, H, D] views with a row stride wider than H * D (halves of a wider projection), as the layers
    pass them; the output is contiguous."""
    module = _norm(GatedRMSNorm(16, 1e-6), dtype)
    wide = torch.randn(3, 4, 32, generator=torch.Generator().manual_seed(1)).to(dtype)
    x, z = wide[..., :16], wide[..., 16:]
    expected = _torch_reference(module, x, z)
    got = rows.rms_norm_rows(x.to(DEVICE), module.weight.to(DEVICE), 1e-6, rows.GATED, gate=z.to(DEVICE))
    assert got.is_contiguous()
    torch.testing.assert_close(got.cpu(), expected, rtol=2e-3 if dtype != torch.float32 else 1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sigmoid_gated_norm_matches_the_module(dtype):
    """Qwen3.5's output norm (sigmoid gate) on strided [T, H, D] head views."""
    module = _norm(SigmoidGatedRMSNorm(16, 1e-6), dtype)
    wide = torch.randn(3, 4, 32, generator=torch.Generator().manual_seed(6)).to(dtype)
    x, z = wide[..., :16], wide[..., 16:]
    expected = _torch_reference(module, x, z)
    got = rows.rms_norm_rows(
        x.to(DEVICE), module.weight.to(DEVICE), 1e-6, rows.SIGMOID_GATED, gate=z.to(DEVICE)
    )
    torch.testing.assert_close(got.cpu(), expected, rtol=2e-3 if dtype != torch.float32 else 1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_norm_on_group_first_views(dtype):
    """[T, G, R, D] views of a group-first projection (Qwen3-Next's in_proj_qkvz: per key-head group
    G, other columns, then z for its R value heads), read in place: the same values as the copied rows."""
    module = _norm(GatedRMSNorm(16, 1e-6), dtype)
    tokens, groups, per_group = 3, 2, 3
    projection = torch.randn(tokens, groups, 8 + per_group * 16, generator=torch.Generator().manual_seed(4))
    projection = projection.to(dtype)
    z = projection[..., 8:].unflatten(-1, (per_group, 16))
    x = torch.randn(tokens, groups, per_group, 16, generator=torch.Generator().manual_seed(5)).to(dtype)
    expected = _torch_reference(module, x, z)
    got = rows.rms_norm_rows(x.to(DEVICE), module.weight.to(DEVICE), 1e-6, rows.GATED, gate=z.to(DEVICE))
    assert got.shape == x.shape and got.is_contiguous()
    torch.testing.assert_close(got.cpu(), expected, rtol=2e-3 if dtype != torch.float32 else 1e-6, atol=1e-6)
    flat = rows.rms_norm_rows(
        x.reshape(-1, 16).to(DEVICE), module.weight.to(DEVICE), 1e-6, rows.GATED,
        gate=z.reshape(-1, 16).to(DEVICE),
    )  # fmt: skip
    assert torch.equal(got.reshape(-1, 16), flat)


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_fp8_rows_equals_the_torch_quantization(dtype):
    x = torch.randn(6, 40, generator=torch.Generator().manual_seed(2)).to(dtype) * 7
    x[2] = 0  # an all-zero row gets the minimum scale, not a division by zero
    scale = fp8_scale(x.abs().amax(dim=-1))
    expected_q = _cast(x, scale)
    q, got_scale = rows.quantize_fp8_rows(x.to(DEVICE))
    assert q.dtype == torch.float8_e4m3fn and got_scale.shape == (6,)
    torch.testing.assert_close(got_scale.cpu(), scale, rtol=0, atol=0)
    if DEVICE == "cpu":
        # Triton 3.7's interpreter rounds fp32 -> e4m3 wrongly (127 -> 64, ties away from even), so the
        # values are checked where the hardware converts (the same test runs on CUDA).
        return
    assert torch.equal(q.cpu().float(), expected_q.float())


def test_supports_only_rows_it_can_address():
    assert rows.supports(torch.zeros(2, 8)) and rows.supports(torch.zeros(2, 3, 8)[..., :4])
    assert not rows.supports(torch.zeros(8, 2).t())  # the last dim is strided
    assert rows.supports(torch.zeros(2, 2, 2, 8))
    assert not rows.supports(torch.zeros(2, 2, 2, 2, 8))
    assert not rows.supports(torch.zeros(1, rows.MAX_ROW + 1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_sigmoid_gated_quantization_equals_the_torch_code(dtype):
    """Gated attention's output times sigmoid(gate) (a strided half of q_proj's output), each token's
    row of all heads quantized: the torch code's scale and, where the hardware converts, its values."""
    generator = torch.Generator().manual_seed(5)
    x = (torch.randn(4, 3, 16, generator=generator) * 5).to(dtype)
    gate = (torch.randn(4, 3, 32, generator=generator) * 4).to(dtype)[..., 16:]
    x[1] = 0  # an all-zero row gets the minimum scale
    expected_q, expected_scale = quantize_fp8((x * torch.sigmoid(gate)).reshape(4, -1), per_row=True)
    q, scale = rows.quantize_fp8_sigmoid_gated_rows(x.to(DEVICE), gate.to(DEVICE))
    assert q.shape == (4, 48) and scale.shape == (4,)
    # The kernel's exp may differ from torch's by an ulp of fp32 (ops/fp8.py bounds what that changes).
    torch.testing.assert_close(
        scale.cpu(), expected_scale, rtol=1e-2 if dtype != torch.float32 else 1e-6, atol=0
    )
    if DEVICE == "cpu":
        return  # the interpreter's e4m3 rounding is wrong (above)
    assert (q.cpu().float() != expected_q.float()).float().mean() < 0.01
    # A flipped value moves by at most one e4m3 step: 1/8 relative, or a subnormal step of its row's scale.
    torch.testing.assert_close(
        q.cpu().float() * scale.cpu()[:, None],
        expected_q.float() * expected_scale[:, None],
        rtol=0.13,
        atol=float(expected_scale.max()) * 2**-9,
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_norm_takes_each_groups_weight(dtype):
    """Flash-Next's per-stream norm: x [T, G * S] normalised per S-wide group, each group scaled by its own
    slice of the [G * S] weight (a kernel that used group 0's weight for all would fail here)."""
    module = _norm(GroupedRMSNorm(3 * 16, 16, 1e-6), dtype)
    x = torch.randn(5, 3 * 16, generator=torch.Generator().manual_seed(7)).to(dtype)
    expected = _torch_reference(module, x)
    got = rows.rms_norm_rows(
        x.view(5, 3, 16).to(DEVICE), module.weight.to(DEVICE), 1e-6, rows.ZERO_CENTRED, weight_per_group=True
    )
    assert got.shape == (5, 3, 16)
    torch.testing.assert_close(
        got.view(5, -1).cpu(), expected, rtol=2e-3 if dtype != torch.float32 else 1e-6, atol=1e-6
    )


def test_a_weight_per_group_must_cover_the_groups():
    with pytest.raises(ValueError, match="weight per group"):
        rows.rms_norm_rows(
            torch.zeros(2, 3, 8), torch.zeros(16), 1e-6, rows.ZERO_CENTRED, weight_per_group=True
        )
    with pytest.raises(ValueError, match="weight per group"):
        rows.rms_norm_rows(
            torch.zeros(2, 24), torch.zeros(24), 1e-6, rows.ZERO_CENTRED, weight_per_group=True
        )


@pytest.mark.parametrize("dtype", DTYPES)
def test_dot_rows_equals_the_torch_sum_of_products(dtype):
    generator = torch.Generator().manual_seed(8)
    a, b = (torch.randn(6, 40, generator=generator).to(dtype) for _ in range(2))
    expected = (a * b).sum(-1)
    got = rows.dot_rows(a.to(DEVICE), b.to(DEVICE))
    assert got.dtype == dtype and got.shape == (6,)
    # The same rounding points (products in the dtype, an fp32 sum, one rounding); the sum's order differs.
    torch.testing.assert_close(got.cpu(), expected, rtol=2e-3 if dtype != torch.float32 else 1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="dot_rows"):
        rows.dot_rows(a, b[:, :8])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens", [2, 4, 8, 16, 1024])
def test_flash_next_stream_reductions_are_batch_invariant_on_cuda(tokens):
    """Qwen3.8-Flash-Next's per-stream norm and PLE gate dots (4 streams of 2,560, bf16) through the layers'
    own code: row 0 computed alone has the bits it has beside other rows, over many random draws (torch's
    reductions differed in about one draw in 30 on an H200: results/2026-12-02-h200-row-invariance-*)."""
    norm = _norm(GroupedRMSNorm(4 * 2560, 2560, 1e-6), torch.bfloat16).cuda()
    generator = torch.Generator(device="cuda").manual_seed(9)
    for _ in range(200):
        x, key, query = (torch.randn(tokens, 4 * 2560, device="cuda", generator=generator) for _ in range(3))
        x = x.to(torch.bfloat16)
        assert torch.equal(norm(x[:1]), norm(x)[:1])
        key, query = (t.to(torch.bfloat16).view(tokens, 4, 2560) for t in (key, query))
        assert torch.equal(stream_dots(key[:1], query[:1]), stream_dots(key, query)[:1])
