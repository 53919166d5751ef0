"""The Gated DeltaNet output's gated norm and FP8 quantization in one kernel, against the two steps it
replaces: the norm kernel then the quantization kernel (and their torch references). On the CPU in
Triton's interpreter (fp32, fp16; its fp32 -> e4m3 rounding is wrong, so codes are compared on CUDA);
on the GPU at the 80B shapes, and the layer with FP8 out_proj weights."""

from __future__ import annotations

import copy

import pytest
import torch

from morion.layers.gated_delta_net import GatedDeltaNet
from morion.layers.linear_fp8 import Fp8Linear
from morion.layers.norm_variants import GatedRMSNorm, SigmoidGatedRMSNorm
from morion.ops import gated_norm_fp8_triton
from morion.ops import row_kernels_triton as rows
from morion.ops.fp8 import quantize_fp8, quantize_fp8_
from morion.ops.gated_norm_fp8_triton import gated_rms_norm_fp8_rows, supports

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def _inputs(
    tokens: int, groups: int, per_group: int, dim: int, dtype: torch.dtype, seed: int = 0, sigmoid=False
):
    """out [T, HV, Dv] contiguous; z a [T, G, r, Dv] view of a group-first projection; the norm (silu
    gate, or with `sigmoid` Qwen3.5's sigmoid gate)."""
    gen = torch.Generator().manual_seed(seed)
    out = (torch.randn(tokens, groups * per_group, dim, generator=gen) * 2).to(DEVICE, dtype)
    projection = torch.randn(tokens, groups, dim + per_group * dim, generator=gen).to(DEVICE, dtype)
    z = projection[..., dim:].unflatten(-1, (per_group, dim))
    norm = (SigmoidGatedRMSNorm if sigmoid else GatedRMSNorm)(dim, 1e-6)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.3, generator=gen)
    return out, z, norm.to(DEVICE, dtype)


def _mode(norm: torch.nn.Module) -> int:
    return rows.SIGMOID_GATED if isinstance(norm, SigmoidGatedRMSNorm) else rows.GATED


def _two_kernels(out, z, norm) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused CUDA path: the gated norm kernel, then the per-row quantization kernel."""
    normed = rows.rms_norm_rows(out.view(z.shape), norm.weight, norm.eps, _mode(norm), gate=z)
    return rows.quantize_fp8_rows(normed.reshape(out.shape[0], -1))


@pytest.mark.parametrize("sigmoid", [False, True], ids=["silu", "sigmoid"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_equals_norm_then_quantization(dtype, sigmoid):
    out, z, norm = _inputs(3, 2, 2, 16, dtype, sigmoid=sigmoid)
    got_q, got_scale = gated_rms_norm_fp8_rows(out, z, norm.weight, norm.eps, _mode(norm))
    assert got_q.shape == (3, 64) and got_scale.shape == (3,)
    expected_q, expected_scale = _two_kernels(out, z, norm)
    torch.testing.assert_close(got_scale, expected_scale, rtol=0, atol=0)
    # The torch reference: the module's torch code and quantize_fp8 (CPU: no kernel).
    torch_normed = norm.cpu()(out.cpu().view(z.shape), z.cpu()).reshape(3, -1)
    _, torch_scale = quantize_fp8(torch_normed, per_row=True)
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got_scale.cpu(), torch_scale, rtol=tolerance, atol=0)
    if DEVICE == "cuda":  # the interpreter's e4m3 rounding is wrong (test_row_kernels.py)
        assert torch.equal(got_q.float(), expected_q.float())


def test_head_major_gate_and_padding_of_the_tile():
    """z as [T, HV, Dv]; 3 heads of 12 (a tile padded to 4 x 16): the padding changes nothing."""
    out, z, norm = _inputs(2, 3, 1, 12, torch.float32, seed=1)
    z = z[:, :, 0]
    assert supports(out, z)
    _, got_scale = gated_rms_norm_fp8_rows(out, z, norm.weight, norm.eps)
    _, expected_scale = _two_kernels(out, z, norm)
    torch.testing.assert_close(got_scale, expected_scale, rtol=0, atol=0)


def test_supports_and_no_tokens():
    out, z, norm = _inputs(2, 2, 2, 16, torch.float32)
    assert supports(out, z)
    assert not supports(out[:, :3], z)  # heads do not match
    assert not supports(out.transpose(0, 1), z)  # not contiguous
    empty_q, empty_scale = gated_rms_norm_fp8_rows(out[:0], z[:0], norm.weight, norm.eps)
    assert empty_q.shape == (0, 64) and empty_scale.shape == (0,)
    with pytest.raises(ValueError, match="not a gated"):
        gated_rms_norm_fp8_rows(out, z, norm.weight, norm.eps, rows.ZERO_CENTRED)


# -- on the GPU, at Qwen3-Next-80B's shapes (16 key-head groups of 2 value heads of 128) ----------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 4, 64, 512])
@pytest.mark.parametrize("sigmoid", [False, True], ids=["silu", "sigmoid"])
def test_80b_fused_equals_the_two_kernels_on_cuda(tokens, sigmoid):
    out, z, norm = _inputs(tokens, 16, 2, 128, torch.bfloat16, seed=tokens, sigmoid=sigmoid)
    got_q, got_scale = gated_rms_norm_fp8_rows(out, z, norm.weight, norm.eps, _mode(norm))
    expected_q, expected_scale = _two_kernels(out, z, norm)
    # The same arithmetic in both; only a head's sum of squares is reduced over a 2-D tile here, so
    # an ulp of it could differ: scales to fp32 rounding, codes all but equal.
    torch.testing.assert_close(got_scale, expected_scale, rtol=1e-6, atol=0)
    same = (got_q.float() == expected_q.float()).float().mean().item()
    print(f"tokens {tokens}: codes equal {same:.6f}, scales equal {torch.equal(got_scale, expected_scale)}")
    assert same > 0.9999


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_80b_layer_with_fp8_out_proj_matches_the_unfused_path(pool_backend, monkeypatch):
    """The layer's output with FP8 out_proj weights through the fused kernel vs through the norm kernel
    and out_proj's own quantization (the same FP8 GEMM): the same values up to the rare ulp."""
    torch.manual_seed(0)
    layer = GatedDeltaNet(0, 2048, 16, 32, 128, 128, 4, 1e-6).cuda().bfloat16()
    fp8_out = Fp8Linear(layer.value_dim, 2048).cuda()
    with torch.no_grad():
        layer.A_log.uniform_(-5.8, 0.0)
        layer.dt_bias.normal_(0.0, 0.5)
        quantize_fp8_(layer.out_proj.weight, fp8_out.weight, fp8_out.weight_scale)
    layer.out_proj = fp8_out
    pools = {
        "conv": torch.zeros(4, 3, layer.conv_dim, dtype=torch.bfloat16, device="cuda"),
        "recurrent": torch.zeros(4, 32, 128, 128, device="cuda"),
    }
    x = torch.randn(4, 2048, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        fused = layer(x, pool_backend(copy.deepcopy(pools), [0, 1, 2, 3], [1, 1, 1, 1]))
        monkeypatch.setattr(gated_norm_fp8_triton, "supports", lambda out, z: False)
        unfused = layer(x, pool_backend(copy.deepcopy(pools), [0, 1, 2, 3], [1, 1, 1, 1]))
    torch.testing.assert_close(fused, unfused, rtol=1e-2, atol=1e-2)
