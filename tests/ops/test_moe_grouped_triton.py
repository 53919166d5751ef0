"""The grouped MoE path's fused elementwise kernels (ops/moe_grouped_triton.py) against the torch chains
they replace. On the CPU in Triton's interpreter (fp32 and fp16: it has no bf16), compiled on a GPU; the
80B's shapes in bf16 and e4m3 on the H200: test_moe_grouped_triton_gpu.py (and `moe_experts_grouped`
with them against the reference: test_moe_fp8_gpu.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from morion.ops.fp8 import quantize_fp8
from morion.ops.moe_grouped_triton import combine_pairs, swiglu_quantize

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.usefixtures("exact_e4m3_casts_in_the_interpreter")


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16))
def test_swiglu_quantize_is_the_torch_chain_quantized_per_row(dtype):
    """silu(gate) * up * w in `dtype` (the weights in another dtype, rounded to it first), quantized per
    row: the codes equal, bar an e4m3 step where silu's exp differs in its last fp32 bits; scales equal."""
    gen = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(37, 2 * 96, generator=gen) * 3).to(dtype)
    weights = torch.rand(37, 1, generator=gen, dtype=torch.float32)
    gate, up = gate_up.float().chunk(2, dim=-1)
    act = (F.silu(gate).to(dtype).float() * up).to(dtype).float() * weights.to(dtype).float()
    want_q, want_scale = quantize_fp8(act.to(dtype).float(), per_row=True)
    q, scale = swiglu_quantize(gate_up.to(DEVICE), weights.to(DEVICE))
    torch.testing.assert_close(scale.cpu(), want_scale, rtol=1e-6, atol=0)
    steps = (q.cpu().float() - want_q.float()).abs() / want_q.float().abs().clamp(min=2**-6)
    assert steps.max() <= 0.13 and (q.cpu().float() != want_q.float()).float().mean() < 0.01


def test_combine_pairs_sums_each_tokens_slots_from_the_sorted_rows():
    """Rows in expert-sorted order back to their tokens: token t's k rows summed in fp32, rounded once."""
    gen = torch.Generator().manual_seed(1)
    tokens, top_k, hidden = 9, 3, 700  # H past one program's 512 columns
    ids = torch.rand(tokens, 8, generator=gen).argsort(dim=-1)[:, :top_k]
    order = torch.argsort(ids.reshape(-1), stable=True)
    pair_rows = torch.randn(tokens * top_k, hidden, generator=gen).to(torch.float16)
    sorted_rows = pair_rows[order]
    out = combine_pairs(sorted_rows.to(DEVICE), order.to(DEVICE), top_k, torch.float16)
    want = pair_rows.float().view(tokens, top_k, hidden).sum(dim=1).to(torch.float16)
    torch.testing.assert_close(out.cpu(), want, rtol=0, atol=0)


def test_combine_pairs_refuses_rows_that_are_not_whole_tokens():
    with pytest.raises(ValueError, match="expected values"):
        combine_pairs(torch.zeros(7, 16, device=DEVICE), torch.arange(7, device=DEVICE), 2, torch.float32)
