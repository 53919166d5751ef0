"""The fused MoE route (softmax, top-k, renormalisation, the stacked shared expert's column) against
`SparseMoE.route`'s torch code. On the CPU the kernel runs in Triton's interpreter (fp32, fp16: it has no
bf16), compiled on a GPU."""

from __future__ import annotations

import pytest
import torch

from morion.layers.moe import SparseMoE, route_reference
from morion.ops import router_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _torch_route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """SparseMoE.route's torch code on these logits (on the CPU, where it never takes the kernel)."""
    moe = SparseMoE(8, logits.shape[1], top_k, 8, 8, normalize)
    moe.gate = torch.nn.Identity()
    return moe.route(logits.cpu())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("num_experts", "top_k", "normalize"), [(512, 10, True), (60, 4, False), (7, 7, True)]
)
def test_route_matches_the_torch_code(dtype, num_experts, top_k, normalize):
    # Distinct in every row, in fp16 too (random fp16 logits of 512 experts tie, and torch.topk orders
    # ties its own way): a shuffled ladder with steps of 8 / E.
    generator = torch.Generator().manual_seed(num_experts)
    ladder = torch.stack([torch.randperm(num_experts, generator=generator) for _ in range(6)])
    logits = ((ladder - num_experts / 2) * (8 / num_experts)).to(dtype)
    weights, ids = router_triton.route(logits.to(DEVICE), top_k, normalize)
    expected_weights, expected_ids = _torch_route(logits, top_k, normalize)
    assert ids.dtype == torch.int64 and weights.dtype == dtype and weights.shape == (6, top_k)
    assert torch.equal(ids.cpu(), expected_ids)  # the same experts, best first
    torch.testing.assert_close(
        weights.cpu(), expected_weights, rtol=1e-5 if dtype == torch.float32 else 1e-3, atol=0
    )


def test_equal_probs_go_to_the_lower_expert():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0, 1.0, 3.0]], device=DEVICE)
    weights, ids = router_triton.route(logits, 4, normalize=True)
    assert ids.tolist() == [[1, 3, 5, 2]]
    torch.testing.assert_close(weights.sum().cpu(), torch.tensor(1.0))


def test_no_tokens_and_what_it_refuses():
    weights, ids = router_triton.route(torch.zeros(0, 16, device=DEVICE), 2, normalize=True)
    assert weights.shape == ids.shape == (0, 2)
    assert not router_triton.supports(torch.zeros(3, 16).t(), 2)  # strided experts
    assert not router_triton.supports(torch.zeros(3, 16), 17)  # k above E


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("num_experts", "top_k", "normalize"), [(512, 10, True), (7, 3, False), (4, 4, True)]
)
def test_the_shared_column_is_sigmoid_of_its_gate_logit_after_the_routed_k(
    dtype, num_experts, top_k, normalize
):
    generator = torch.Generator().manual_seed(num_experts + 1)
    ladder = torch.stack([torch.randperm(num_experts, generator=generator) for _ in range(5)])
    routed = (ladder - num_experts / 2) * (8 / num_experts)
    gate_logits = torch.tensor([[-6.0], [-0.5], [0.0], [0.75], [9.0]])
    logits, gate_logits = routed.to(dtype), gate_logits.to(dtype)
    weights, ids = router_triton.route(logits.to(DEVICE), top_k, normalize, gate_logits.to(DEVICE))
    expected_weights, expected_ids = route_reference(logits, top_k, normalize, gate_logits)
    assert weights.shape == ids.shape == (5, top_k + 1) and weights.dtype == dtype
    assert torch.equal(ids.cpu(), expected_ids)
    assert ids[:, top_k].tolist() == [num_experts] * 5  # the shared slot, last
    torch.testing.assert_close(
        weights.cpu(), expected_weights, rtol=1e-6 if dtype == torch.float32 else 1e-3, atol=0
    )
    # The routed k alone are renormalised (up to the order of the sum's terms); the shared weight is outside.
    routed_only, routed_ids = router_triton.route(logits.to(DEVICE), top_k, normalize)
    assert torch.equal(ids[:, :top_k], routed_ids)
    torch.testing.assert_close(weights[:, :top_k], routed_only)
    torch.testing.assert_close(
        weights[:, top_k].cpu(), torch.sigmoid(gate_logits[:, 0].to(dtype).float()).to(dtype)
    )


@pytest.mark.parametrize("tokens", [1, 5])
def test_the_route_apart_writes_each_stack_s_columns_contiguous(tokens):
    """A shared expert beside the routed ones (layers/moe.py): the same weights and routed ids as the
    stacked route, the routed k as [T, k] and the shared column as [T, 1] with id 0 (its one-expert
    stack's), each contiguous."""
    generator = torch.Generator().manual_seed(tokens)
    logits = torch.randn(tokens, 60, generator=generator).to(DEVICE)
    gate_logits = torch.randn(tokens, 1, generator=generator).to(DEVICE)
    (routed_weights, routed_ids), (shared_weights, shared_ids) = router_triton.route_apart(
        logits, 4, True, gate_logits
    )
    weights, ids = router_triton.route(logits, 4, True, gate_logits)
    for tensor in (routed_weights, routed_ids, shared_weights, shared_ids):
        assert tensor.is_contiguous()
    assert routed_ids.shape == (tokens, 4) and shared_ids.shape == (tokens, 1)
    assert torch.equal(routed_ids, ids[:, :4]) and torch.equal(routed_weights, weights[:, :4])
    assert torch.equal(shared_weights, weights[:, 4:]) and (shared_ids == 0).all()
    # The block's route_apart takes the kernel on CUDA and the torch code elsewhere: the same columns.
    moe = SparseMoE(60, 60, 4, 8, 8, True, stack_shared_expert=True)
    moe.gate = torch.nn.Identity()
    (reference_weights, reference_ids), (reference_shared, _) = moe.route_apart(
        torch.cat((logits, gate_logits), dim=1).cpu()
    )
    assert torch.equal(routed_ids.cpu(), reference_ids)
    torch.testing.assert_close(routed_weights.cpu(), reference_weights, rtol=1e-6, atol=0)
    torch.testing.assert_close(shared_weights.cpu(), reference_shared, rtol=1e-6, atol=0)
