"""The fused residual add + RMSNorm kernel against the eager sequence it replaces: bit for bit against
the add followed by the row norm kernel (the CUDA path before the fusion), and against the pure-torch
reference (the add and the norm module's torch code) to the norm's rounding. With `quantize`, its FP8
codes and scales bit for bit against `quantize_fp8_rows` of its normed rows (the CUDA path before that
fusion) and the scales against torch's. On the CPU the kernel runs in Triton's interpreter (fp32 and
fp16: the interpreter has no bf16, and its e4m3 rounding is not the GPU's, so codes are compared with
torch's only on CUDA); bf16 and the 80B shapes run on CUDA."""

from __future__ import annotations

import copy

import pytest
import torch

from morion.layers.norm import RMSNorm
from morion.layers.norm_variants import ZeroCentredRMSNorm
from morion.ops import row_kernels_triton as rows
from morion.ops.add_rms_norm import add_rms_norm_reference
from morion.ops.add_rms_norm_triton import add_rms_norm_rows, supports
from morion.ops.fp8 import FP8_DTYPE, _cast, fp8_scale, quantize_fp8
from morion.ops.slot_partials import SlotPartials

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


def _check_quantized_against_unfused(module, mode, x, residual) -> None:
    """`quantize=True` against the unfused kernels: the add + norm kernel, then `quantize_fp8_rows` of its
    normed rows (both in this process: the interpreter's e4m3 rounding on the CPU, the GPU's on CUDA);
    the scales against torch's, and on CUDA the codes too."""
    weight = module.weight.to(x.device)
    got = add_rms_norm_rows(x, residual, weight, module.eps, mode, quantize=True)
    unfused = add_rms_norm_rows(x, residual, weight, module.eps, mode)
    assert torch.equal(got.normed, unfused.normed) and torch.equal(got.residual, unfused.residual)
    assert unfused.quantized is None and got.quantized is not None
    q, scale = got.quantized
    expected_q, expected_scale = rows.quantize_fp8_rows(unfused.normed)
    assert q.dtype == FP8_DTYPE and q.shape == x.shape and scale.dtype == torch.float32
    assert torch.equal(scale, expected_scale) and torch.equal(
        q.view(torch.uint8), expected_q.view(torch.uint8)
    )
    # Torch's scale, divided on the CPU: on CUDA torch divides by a scalar as a product with its reciprocal,
    # which can be one ulp off the IEEE quotient (the kernels' and the CPU's).
    torch_scale = fp8_scale(unfused.normed.float().abs().amax(dim=-1).cpu()).to(x.device)
    assert torch.equal(scale, torch_scale)
    if x.is_cuda:
        assert torch.equal(q.view(torch.uint8), _cast(unfused.normed, torch_scale).view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("module_type", "mode"), MODES, ids=["llama", "zero_centred"])
def test_fused_quantization_equals_the_unfused_kernels(module_type, mode, dtype):
    """K = 48: a block wider than the row, whose masked columns must leave the amax alone; row 2 adds up
    to zero (the minimum scale, zero codes)."""
    module = _module(module_type, 48, dtype)
    x, residual = _pair(5, 48, dtype, DEVICE)
    x[2] = -residual[2]
    _check_quantized_against_unfused(module, mode, x, residual)


def _partials(rows_: int, slots: int, hidden: int, dtype: torch.dtype, device: str) -> SlotPartials:
    generator = torch.Generator().manual_seed(rows_ * 13 + slots)
    return SlotPartials(torch.randn(rows_, slots, hidden, generator=generator).to(device), dtype)


def _check_partials_against_summed(module, mode, partials: SlotPartials, residual) -> None:
    """x as a MoE block's slots against x summed by their own kernel first: every output bit for bit,
    with and without quantization."""
    weight = module.weight.to(residual.device)
    summed_first = partials.summed()
    for quantize in (False, True):
        got = add_rms_norm_rows(partials, residual, weight, module.eps, mode, quantize)
        expected = add_rms_norm_rows(summed_first, residual, weight, module.eps, mode, quantize)
        assert torch.equal(got.residual, expected.residual) and torch.equal(got.normed, expected.normed)
        if quantize:
            assert torch.equal(got.quantized.scale, expected.quantized.scale)
            assert torch.equal(got.quantized.q.view(torch.uint8), expected.quantized.q.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
def test_slot_partials_are_added_as_their_sum_kernel_adds_them(dtype):
    """K = 48 (a masked block), 11 slots (the 80B's top-10 and its shared expert), rows of both signs."""
    module = _module(ZeroCentredRMSNorm, 48, dtype)
    partials = _partials(5, 11, 48, dtype, DEVICE)
    residual = _pair(5, 48, dtype, DEVICE)[1]
    assert supports(partials, residual)
    _check_partials_against_summed(module, rows.ZERO_CENTRED, partials, residual)
    # The module takes them too, on the CPU by summing them first.
    got = module.to(DEVICE).add_and_norm(partials, residual)
    assert torch.equal(got.residual, residual + partials.summed())


def test_supports_slot_partials_only_of_the_rows_shape_and_dtype():
    partials = _partials(2, 3, 16, torch.float32, "cpu")
    residual = torch.zeros(2, 16)
    assert supports(partials, residual)
    assert not supports(partials, residual.half())  # the sum's dtype is the stream's
    assert not supports(partials, torch.zeros(3, 16))
    assert not supports(SlotPartials(partials.values.transpose(0, 1), torch.float32), torch.zeros(3, 16))
    assert not supports(SlotPartials(partials.values.half(), torch.float32), residual)
    assert not supports(SlotPartials(torch.zeros(2, 0, 16), torch.float32), residual)


def test_no_rows_and_gated_mode():
    x, residual = _pair(0, 32, torch.float32, DEVICE)
    weight = torch.zeros(32, device=DEVICE)
    got = add_rms_norm_rows(x, residual, weight, 1e-6, rows.ZERO_CENTRED)
    assert got.normed.shape == (0, 32) and got.residual.shape == (0, 32)
    q, scale = add_rms_norm_rows(x, residual, weight, 1e-6, rows.ZERO_CENTRED, quantize=True).quantized
    assert q.shape == (0, 32) and q.dtype == FP8_DTYPE and scale.shape == (0,)
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
    assert got.quantized is None  # nothing quantized unless asked


def test_module_quantized_add_and_norm_off_cuda_is_the_unfused_sequence():
    """`add_and_norm(quantize=True)` on the CPU: the reference add and norm, then `quantize_fp8` of the
    normed rows, bit for bit (what an FP8 layer reading them computed on its own before)."""
    module = _module(ZeroCentredRMSNorm, 24, torch.float32)
    x, residual = _pair(4, 24, torch.float32, "cpu")
    got = module.add_and_norm(x, residual, quantize=True)
    normed = module(residual + x)
    assert torch.equal(got.residual, residual + x) and torch.equal(got.normed, normed)
    expected_q, expected_scale = quantize_fp8(normed, per_row=True)
    assert torch.equal(got.quantized.q.view(torch.uint8), expected_q.view(torch.uint8))
    assert torch.equal(got.quantized.scale, expected_scale)


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_rows", [1, 4, 16, 512])
def test_80b_shapes_quantized_bit_exact_on_cuda(num_rows):
    """hidden 2048, bf16: `add_and_norm(quantize=True)` equals the add + norm kernel followed by
    `quantize_fp8_rows` (normed, residual, codes, scales) and torch's quantization, and a row's codes and
    scale are the same alone as in the batch."""
    module = _module(ZeroCentredRMSNorm, 2048, torch.bfloat16).cuda()
    x, residual = _pair(num_rows, 2048, torch.bfloat16, "cuda")
    _check_quantized_against_unfused(module, rows.ZERO_CENTRED, x, residual)
    got = module.add_and_norm(x, residual, quantize=True)
    unfused = module.add_and_norm(x, residual)
    expected_q, expected_scale = quantize_fp8(unfused.normed, per_row=True)
    assert torch.equal(got.normed, unfused.normed) and torch.equal(got.residual, unfused.residual)
    assert torch.equal(got.quantized.q.view(torch.uint8), expected_q.view(torch.uint8))
    assert torch.equal(got.quantized.scale, expected_scale)
    alone = module.add_and_norm(x[-1:], residual[-1:], quantize=True)
    assert torch.equal(alone.quantized.q.view(torch.uint8), got.quantized.q[-1:].view(torch.uint8))
    assert torch.equal(alone.quantized.scale, got.quantized.scale[-1:])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_rows", [1, 4, 16])
def test_80b_shapes_slot_partials_bit_exact_on_cuda(num_rows):
    """hidden 2048, bf16, 11 slots: the kernel adding a MoE block's slots itself equals the sum kernel
    followed by the add + norm kernel (normed, residual, codes, scales), and a row's result is the same
    alone as in the batch."""
    module = _module(ZeroCentredRMSNorm, 2048, torch.bfloat16).cuda()
    partials = _partials(num_rows, 11, 2048, torch.bfloat16, "cuda")
    residual = _pair(num_rows, 2048, torch.bfloat16, "cuda")[1]
    _check_partials_against_summed(module, rows.ZERO_CENTRED, partials, residual)
    got = module.add_and_norm(partials, residual, quantize=True)
    alone = module.add_and_norm(SlotPartials(partials.values[-1:], torch.bfloat16), residual[-1:], True)
    assert torch.equal(alone.normed, got.normed[-1:])
    assert torch.equal(alone.quantized.q.view(torch.uint8), got.quantized.q[-1:].view(torch.uint8))
