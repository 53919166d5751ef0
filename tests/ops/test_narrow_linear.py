"""The narrow (gate) linear kernel: F.linear's result up to summation order, and a row's result the same
bits alone as at every batch size (the property cuBLAS's N = 1 kernels lack on the GPU). On the CPU the
kernel runs in Triton's interpreter, compiled on a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from morion.layers.narrow_linear import NarrowLinear
from morion.ops import narrow_linear_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter has no bf16: fp32 and fp16 there, bf16 (the models' dtype) on the GPU.
DTYPES = [torch.bfloat16, torch.float32] if DEVICE == "cuda" else [torch.float32, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("outputs", "depth"), [(1, 2048), (4, 1000), (16, 300)])
def test_matches_f_linear_and_a_row_is_the_same_at_every_batch_size(dtype, outputs, depth):
    generator = torch.Generator().manual_seed(outputs)
    x = torch.randn(24, depth, generator=generator).to(DEVICE, dtype)
    weight = (torch.randn(outputs, depth, generator=generator) / depth**0.5).to(DEVICE, dtype)
    out = narrow_linear_triton.narrow_linear(x, weight)
    assert out.shape == (24, outputs) and out.dtype == dtype
    expected = F.linear(x.float(), weight.float())
    tolerance = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(out.float(), expected, rtol=tolerance, atol=tolerance)
    for rows in (1, 2, 3, 8, 17):
        assert torch.equal(narrow_linear_triton.narrow_linear(x[:rows], weight), out[:rows])


def test_the_module_keeps_nn_linear_parameters_and_takes_the_kernel_only_where_it_fits():
    gate = NarrowLinear(64, 1, bias=False)
    assert isinstance(gate, torch.nn.Linear) and set(gate.state_dict()) == {"weight"}
    x = torch.randn(3, 5, 64)
    assert torch.equal(gate(x), F.linear(x, gate.weight))  # off CUDA: F.linear itself
    assert narrow_linear_triton.supports(x, gate.weight)
    assert not narrow_linear_triton.supports(x, torch.randn(17, 64))  # more outputs than a gate's
    assert not narrow_linear_triton.supports(x[..., ::2], torch.randn(1, 32))  # strided K
