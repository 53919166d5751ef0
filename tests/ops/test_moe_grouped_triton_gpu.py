"""The grouped MoE path's fused elementwise kernels at the 80B's shapes (a 4K-token prefill chunk: P =
40,960 pairs, I = 512, H = 2,048) in bf16 and e4m3 against the torch chains they replace, and their
CUDA-graph time beside the chains' (printed, never asserted)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from morion.ops.fp8 import quantize_fp8
from morion.ops.moe_grouped_triton import combine_pairs, swiglu_quantize
from morion.ops.moe_tune import graph_microseconds
from tests.ops.conftest import CUDA, HIDDEN, INTERMEDIATE, TOP_K

pytestmark = pytest.mark.gpu
TOKENS = 4096


def torch_swiglu_quantize(gate_up: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    gate, up = gate_up.chunk(2, dim=-1)
    return quantize_fp8(F.silu(gate) * up * weights.to(gate_up.dtype), per_row=True)


def torch_combine(values: torch.Tensor, order: torch.Tensor, top_k: int) -> torch.Tensor:
    unsorted = torch.empty_like(values).index_copy_(0, order, values)
    return unsorted.view(-1, top_k, values.shape[1]).sum(dim=1, dtype=torch.float32).to(values.dtype)


@pytest.fixture(scope="module")
def pairs() -> dict[str, torch.Tensor]:
    generator = torch.Generator(device=CUDA).manual_seed(0)
    count = TOKENS * TOP_K
    ids = torch.randint(0, 512, (count,), device=CUDA, generator=generator)
    return {
        "gate_up": (torch.randn(count, 2 * INTERMEDIATE, device=CUDA, generator=generator) * 4).bfloat16(),
        "weights": torch.rand(count, 1, device=CUDA, generator=generator),
        "values": torch.randn(count, HIDDEN, device=CUDA, generator=generator).bfloat16(),
        "order": torch.argsort(ids, stable=True),
    }


def test_swiglu_quantize_matches_the_torch_chain(pairs, capsys):
    """Scales equal and codes equal bar a handful (silu's exp: the special function unit's, not torch's)."""
    q, scale = swiglu_quantize(pairs["gate_up"], pairs["weights"])
    want_q, want_scale = torch_swiglu_quantize(pairs["gate_up"], pairs["weights"])
    differ = (q.float() != want_q.float()).float().mean().item()
    assert (scale == want_scale).float().mean().item() > 0.999 and differ < 1e-4
    fused = graph_microseconds(lambda: swiglu_quantize(pairs["gate_up"], pairs["weights"]), 1)
    chain = graph_microseconds(lambda: torch_swiglu_quantize(pairs["gate_up"], pairs["weights"]), 1)
    with capsys.disabled():
        print(f"\nswiglu + quantize, {TOKENS} tokens x top-{TOP_K}: fused {fused:.1f} us, "
              f"torch {chain:.1f} us (codes differing: {differ:.2e})")  # fmt: skip


def test_combine_pairs_matches_the_torch_scatter_and_sum(pairs, capsys):
    out = combine_pairs(pairs["values"], pairs["order"], TOP_K, torch.bfloat16)
    want = torch_combine(pairs["values"], pairs["order"], TOP_K)
    differ = (out != want).float().mean().item()
    torch.testing.assert_close(out, want, rtol=2**-7, atol=2**-7)  # one bf16 step at most
    values, order = pairs["values"], pairs["order"]
    fused = graph_microseconds(lambda: combine_pairs(values, order, TOP_K, torch.bfloat16), 1)
    chain = graph_microseconds(lambda: torch_combine(values, order, TOP_K), 1)
    with capsys.disabled():
        print(f"\ncombine, {TOKENS} tokens x top-{TOP_K}: fused {fused:.1f} us, torch {chain:.1f} us "
              f"(outputs differing in a bit: {differ:.2e})")  # fmt: skip
