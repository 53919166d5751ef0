"""The MoE router's softmax and top-k in one Triton kernel (`SparseMoE.route` on CUDA).

In torch the route is six kernels per MoE layer: the fp32 softmax, top-k's selection and its sort, the
sum and division that renormalise, and the cast. On the 80B preset they took ~14 us of each layer's
decode step (`results/2026-11-30-h200-qwen3-next-80b-a3b-fp8-profile-kernels.md`). Here one program per
token does all of it:

- probs = softmax(logits) in fp32: exp(x - max) / sum, the divisions IEEE-rounded (`div_rn`), as torch's;
- k rounds of "take the largest remaining prob", one max over packed (prob, expert) keys a round: the k
  best, best first, and among equal probs the lower expert (torch.topk leaves the order of ties
  unspecified);
- with `normalize`, the k probs divided by their sum (fp32), then cast to the logits' dtype;
- with `shared_logits` (a stacked shared expert, layers/moe.py: its gate's logit per token, [T, 1]),
  column k gets the shared slot (the routed count E) with weight sigmoid(logit) in fp32, after the
  renormalisation, which covers the routed k only;
- `route_apart` (a shared expert beside the routed ones, in a one-expert stack of its own): the same
  weights, the routed k written as [T, k] and the shared slot as [T, 1] with id 0 (its stack's only
  expert), each contiguous, so each stack's kernels read their own pairs without a copy.

Same results as the torch route up to the exponential's last bits (Triton's exp is not libm's) and the
order of exact ties. No host sync, fixed shapes: capturable. The reference is
`layers.moe.route_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from morion.ops.pdl import launch_options, wait_for_previous_kernel

MAX_EXPERTS = 4096


# `apart_start` (T * k, route_apart's only) is not specialized on: its value class would follow the batch
# size, and a variant first met in serving compiles while every request waits.
@triton.jit(do_not_specialize=["apart_start"])
def _route_kernel(
    logits_ptr, shared_ptr, weights_ptr, ids_ptr, num_experts, stride_logits, stride_shared, apart_start,
    TOP_K: tl.constexpr, NORMALIZE: tl.constexpr, SHARED: tl.constexpr, WIDTH: tl.constexpr,
    APART: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous_kernel(USE_PDL)
    # With SHARED, shared_ptr holds each row's shared expert gate logit and each row's output has
    # WIDTH = TOP_K + 1 columns (TOP_K without); with APART too, the rows' routed columns are the first
    # T * TOP_K entries of the outputs and their shared columns the T entries from `apart_start` on.
    row = tl.cast(tl.program_id(0), tl.int64)
    experts = tl.arange(0, BLOCK_E)
    valid = experts < num_experts
    logits = tl.load(logits_ptr + row * stride_logits + experts, mask=valid, other=float("-inf"))
    logits = tl.cast(logits, tl.float32)
    shifted = tl.exp(logits - tl.max(logits, axis=0))  # 0 past num_experts
    probs = tl.math.div_rn(shifted, tl.broadcast_to(tl.sum(shifted, axis=0), (BLOCK_E,)))
    # One reduction a round: each expert's key packs its prob's bits (a non-negative fp32 orders as its
    # bits) above BLOCK_E - 1 - expert, so the largest key is the largest prob and, among equal probs,
    # the lower expert. Taken experts and those past num_experts get -1, below every prob's key.
    prob_bits = tl.cast(probs.to(tl.int32, bitcast=True), tl.int64)
    keys = tl.where(valid, (prob_bits << 32) | (BLOCK_E - 1 - experts), -1)
    slots = tl.arange(0, BLOCK_K)
    chosen_probs = tl.zeros((BLOCK_K,), dtype=tl.float32)
    chosen_ids = tl.zeros((BLOCK_K,), dtype=tl.int64)
    for slot in tl.static_range(TOP_K):
        best_key = tl.max(keys, axis=0)
        expert = BLOCK_E - 1 - (best_key & 0xFFFFFFFF)
        best = tl.cast(best_key >> 32, tl.int32).to(tl.float32, bitcast=True)
        chosen_probs = tl.where(slots == slot, best, chosen_probs)
        chosen_ids = tl.where(slots == slot, expert, chosen_ids)
        keys = tl.where(experts == expert, -1, keys)
    if NORMALIZE:
        total = tl.sum(tl.where(slots < TOP_K, chosen_probs, 0.0), axis=0)
        chosen_probs = tl.math.div_rn(chosen_probs, tl.broadcast_to(total, (BLOCK_K,)))
    if SHARED:
        gate_logit = tl.cast(tl.load(shared_ptr + row * stride_shared), tl.float32)
        gate = tl.math.div_rn(1.0, 1.0 + tl.exp(-gate_logit))
        chosen_probs = tl.where(slots == TOP_K, gate, chosen_probs)
        if APART:  # its one-expert stack's only expert
            chosen_ids = tl.where(slots == TOP_K, 0, chosen_ids)
        else:  # the stacked slot
            chosen_ids = tl.where(slots == TOP_K, tl.cast(num_experts, tl.int64), chosen_ids)
    if APART:  # noqa: SIM108 (a compile-time branch: Triton takes one side only)
        where = tl.where(slots < TOP_K, row * TOP_K + slots, apart_start + row)
    else:
        where = row * WIDTH + slots
    out = slots < WIDTH
    tl.store(weights_ptr + where, tl.cast(chosen_probs, weights_ptr.dtype.element_ty), mask=out)
    tl.store(ids_ptr + where, chosen_ids, mask=out)


def supports(logits: torch.Tensor, top_k: int) -> bool:
    """Whether the kernel takes these router logits [T, E]: unit stride on the logits, E <= MAX_EXPERTS."""
    if logits.dim() != 2 or logits.stride(-1) != 1:
        return False
    return 0 < top_k <= logits.shape[1] <= MAX_EXPERTS


def route(
    logits: torch.Tensor, top_k: int, normalize: bool, shared_logits: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights [T, k] in logits' dtype, topk_ids [T, k] int64), as `layers.moe.route_reference`;
    with `shared_logits` [T, 1], [T, k + 1]: the shared expert's slot E and sigmoid(shared_logits) in
    column k."""
    width = top_k + int(shared_logits is not None)
    weights, ids = _launch(logits, top_k, normalize, shared_logits, apart=False)
    return weights.view(-1, width), ids.view(-1, width)


def route_apart(
    logits: torch.Tensor, top_k: int, normalize: bool, shared_logits: torch.Tensor
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """`route` with `shared_logits`, its columns apart: ((routed weights, ids) [T, k], (shared weights
    [T, 1], ids [T, 1] all 0)), views of one buffer each for the weights and the ids."""
    tokens = logits.shape[0]
    weights, ids = _launch(logits, top_k, normalize, shared_logits, apart=True)
    routed = tokens * top_k
    return (
        (weights[:routed].view(tokens, top_k), ids[:routed].view(tokens, top_k)),
        (weights[routed:].view(tokens, 1), ids[routed:].view(tokens, 1)),
    )


def _launch(
    logits: torch.Tensor, top_k: int, normalize: bool, shared_logits: torch.Tensor | None, apart: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel over every row of `logits`: flat (weights, ids) of T x (k + 1 with a shared column)."""
    tokens, num_experts = logits.shape
    shared = shared_logits is not None
    width = top_k + int(shared)
    weights = torch.empty(tokens * width, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(tokens * width, dtype=torch.int64, device=logits.device)
    apart_start = tokens * top_k if apart else 0
    if tokens:
        _route_kernel[(tokens,)](
            logits, logits if shared_logits is None else shared_logits, weights, ids, num_experts,
            logits.stride(0), 0 if shared_logits is None else shared_logits.stride(0), apart_start,
            TOP_K=top_k, NORMALIZE=normalize, SHARED=shared, WIDTH=width, APART=apart,
            BLOCK_E=triton.next_power_of_2(num_experts),
            BLOCK_K=triton.next_power_of_2(width), **launch_options(), num_warps=4,
        )  # fmt: skip
    return weights, ids
