"""The fused residual add + RMSNorm kernel against the eager sequence it replaces: bit for bit against
the add followed by the row norm kernel (the CUDA path before the fusion), and against the pure-torch
reference (the add and the norm module's torch code) to the norm's rounding. On the CPU the kernel runs in
Triton's interpreter (fp32 and fp16: the interpreter has no bf16); bf16 and the 80B shapes run on CUDA."""

from __future__ import annotations

import copy

import pytest
import torch

from morion.layers.norm import RMSNorm
from morion.layers.norm_variants import ZeroCentredRMSNorm
from morion.ops import row_kernels_triton as rows
from morion.ops.add_rms_norm import add_rms_norm_reference
from morion.ops.add_rms_norm_triton import add_rms_norm_rows, supports

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
MODES = [(RMSNorm, rows.LLAMA), (ZeroCentredRMSNorm, rows.ZERO_CENTRED)]


def _module(module_type: type[torch.nn.Module], hidden: int, dtype: torch.dtype) -> torch.nn.Module:
    module = module_type(hidden, 1e-6)
    with torch.no_grad():
        module.weight.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(3))
    return module.to(dtype)


def _pair(rows_: int, hidden: int, dtype: torch.dtype, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(rows_ * 7 + hidden)
    x = torch.randn(rows_, hidden, generator=generator) * 3
    residual = torch.randn(rows_, hidden, generator=generator) * 10
    return x.to(dtype).to(device), residual.to(dtype).to(device)


def _check_against_eager(module, mode, x, residual) -> None:
    weight = module.weight.to(x.device)
    got = add_rms_norm_rows(x, residual, weight, module.eps, mode)
    summed = residual + x
    assert torch.equal(got.residual, summed)
    # The unfused CUDA path: the same row arithmetic, so the same bits.
    assert torch.equal(got.normed, rows.rms_norm_rows(summed, weight, module.eps, mode))
    reference = add_rms_norm_reference(x.cpu(), residual.cpu(), copy.deepcopy(module).cpu())  # module stays
    assert torch.equal(got.residual.cpu(), reference.residual)
    # The pure-torch norm: the same rounding points; only the sum of squares may round differently.
    tolerance = 1e-6 if x.dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.normed.cpu(), reference.normed, rtol=tolerance, atol=1e-5)
    assert got.normed.is_contiguous() and got.residual.is_contiguous()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("module_type", "mode"), MODES, ids=["llama", "zero_centred"])
def test_fused_add_norm_equals_the_eager_sequence(module_type, mode, dtype):
    module = _module(module_type, 48, dtype)
    x, residual = _pair(5, 48, dtype, DEVICE)
    _check_against_eager(module, mode, x, residual)


def test_strided_rows_are_read_in_place_and_inputs_left_alone():
    """x a column slice of a wider tensor (row stride > K); neither input is written."""
    module = _module(ZeroCentredRMSNorm, 40, torch.float16)
    wide, residual = _pair(3, 64, torch.float16, DEVICE)
    x, residual = wide[:, :40], residual[:, 24:].contiguous()
    before = (x.clone(), residual.clone())
    assert supports(x, residual)
    _check_against_eager(module, rows.ZERO_CENTRED, x, residual)
    assert torch.equal(x, before[0]) and torch.equal(residual, before[1])


def test_no_rows_and_gated_mode():
    x, residual = _pair(0, 32, torch.float32, DEVICE)
    weight = torch.zeros(32, device=DEVICE)
    got = add_rms_norm_rows(x, residual, weight, 1e-6, rows.ZERO_CENTRED)
    assert got.normed.shape == (0, 32) and got.residual.shape == (0, 32)
    with pytest.raises(ValueError, match="gated"):
        add_rms_norm_rows(x, residual, weight, 1e-6, rows.GATED)


def test_supports_only_matching_two_dimensional_rows():
    x, residual = _pair(2, 16, torch.float32, "cpu")
    assert supports(x, residual)
    assert not supports(x, residual.half())
    assert not supports(x[None], residual[None])
    assert not supports(x.t(), residual.t())


def test_module_add_and_norm_off_cuda_is_the_reference():
    module = _module(ZeroCentredRMSNorm, 24, torch.float32)
    x, residual = _pair(4, 24, torch.float32, "cpu")
    got = module.add_and_norm(x, residual)
    assert torch.equal(got.residual, residual + x)
    assert torch.equal(got.normed, module(residual + x))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_rows", [1, 4, 64, 512])
def test_80b_shapes_bit_exact_on_cuda(num_rows):
    """hidden 2048 (Qwen3-Next-80B), bf16: the module's fused path equals the add + norm kernels."""
    module = _module(ZeroCentredRMSNorm, 2048, torch.bfloat16).cuda()
    x, residual = _pair(num_rows, 2048, torch.bfloat16, "cuda")
    _check_against_eager(module, rows.ZERO_CENTRED, x, residual)
    got = module.add_and_norm(x, residual)
    assert torch.equal(got.normed, module(residual + x)) and torch.equal(got.residual, residual + x)
    # Batch-invariant: a row's result is the same alone as in the batch.
    alone = module.add_and_norm(x[:1], residual[:1])
    assert torch.equal(alone.normed, got.normed[:1])
