"""Routed mixture-of-experts feed-forward over stacked expert weights: a grouped-GEMM path and the
pure-torch reference.

Expert e is SwiGLU: down_e(silu(gate_e(x)) * up_e(x)), with gate_e and up_e stacked as one matrix
`gate_up_proj[e]` ([2I, H]: the gate rows first) and `down_proj[e]` ([H, I]). This is the layout grouped-GEMM
kernels consume, and the one transformers keeps in memory.

FP8 experts are e4m3 with one fp32 scale per (expert, output channel): `gate_up_scale` [E, 2I] and
`down_scale` [E, H]. The activations feeding each GEMM are quantized per row (dynamically); the token
rows may come quantized already (`quantized`: by the norm that made them, Qwen3-Next's decoder layer).

NVFP4 experts (uint8 codes: layers/moe.py's StackedExperts) are weight-only: `gate_up_scale` and
`down_scale` are their e4m3 block scales, `gate_up_scale_2` [E, 2] and `down_scale_2` [E, 1] their global
scales; the reference dequantizes each used expert and multiplies in the activations' dtype.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from morion.ops.fp8 import QuantizedRows, dequantize_fp8, fake_quantize_fp8, quantize_fp8, rows_quantized
from morion.ops.log_once import log_once
from morion.ops.nvfp4 import dequantize_parts

logger = logging.getLogger(__name__)


def moe_experts_reference(
    hidden: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    gate_up_scale: torch.Tensor | None = None,
    down_scale: torch.Tensor | None = None,
    gate_up_scale_2: torch.Tensor | None = None,
    down_scale_2: torch.Tensor | None = None,
    quantized: QuantizedRows | None = None,
) -> torch.Tensor:
    """hidden [T, H]; gate_up_proj [E, 2I, H]; down_proj [E, H, I]; topk_weights, topk_ids [T, k].

    Returns sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden[t]) as [T, H] in hidden's dtype.
    With FP8 weights (scales given) it computes in fp32 what the FP8 kernels compute: each used expert's
    weights dequantized, the GEMM inputs quantized per row (hidden's rows read from `quantized` where
    given: `quantize_fp8(hidden, per_row=True)`'s values) and dequantized. NVFP4 weights (uint8 codes
    [E, 2I, H/2] and [E, H, I/2], all four scales given) are dequantized to hidden's dtype.
    """
    nvfp4 = gate_up_proj.dtype == torch.uint8
    fp8 = not nvfp4 and gate_up_scale is not None and down_scale is not None
    x = hidden
    if fp8:
        x = dequantize_fp8(*quantized) if quantized is not None else fake_quantize_fp8(hidden, per_row=True)
    out = torch.zeros_like(hidden)
    for expert in torch.unique(topk_ids).tolist():
        tokens, slot = torch.where(topk_ids == expert)
        w_gate_up, w_down = gate_up_proj[expert], down_proj[expert]
        if nvfp4:
            w_gate_up = dequantize_parts(w_gate_up, gate_up_scale[expert], gate_up_scale_2[expert], x.dtype)
            w_down = dequantize_parts(w_down, down_scale[expert], down_scale_2[expert], x.dtype)
        elif fp8:
            w_gate_up = dequantize_fp8(w_gate_up, gate_up_scale[expert])
            w_down = dequantize_fp8(w_down, down_scale[expert])
        gate, up = F.linear(x[tokens], w_gate_up).chunk(2, dim=-1)
        act = F.silu(gate) * up
        expert_out = F.linear(fake_quantize_fp8(act, per_row=True) if fp8 else act, w_down)
        weighted = expert_out * topk_weights[tokens, slot, None]
        out.index_add_(0, tokens, weighted.to(out.dtype))
    return out


def moe_experts_dense(
    hidden: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """The reference's result with no host sync: every expert runs on every token and is weighted by the
    token's routing weight for it (0 when not routed). E / k times the work, so it is only the CUDA path
    for weights no grouped kernel takes (fp32 test models), where it keeps decode CUDA-graph capturable.
    Shapes as `moe_experts_reference`."""
    num_experts = gate_up_proj.shape[0]
    routing = torch.zeros(hidden.shape[0], num_experts, dtype=topk_weights.dtype, device=hidden.device)
    routing.scatter_add_(1, topk_ids, topk_weights)
    out = torch.zeros_like(hidden)
    for expert in range(num_experts):
        gate, up = F.linear(hidden, gate_up_proj[expert]).chunk(2, dim=-1)
        expert_out = F.linear(F.silu(gate) * up, down_proj[expert])
        out += (expert_out * routing[:, expert, None]).to(out.dtype)
    return out


def moe_experts_grouped(
    hidden: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    gate_up_scale: torch.Tensor | None = None,
    down_scale: torch.Tensor | None = None,
    quantized: QuantizedRows | None = None,
) -> torch.Tensor:
    """The same contract as `moe_experts_reference` (`quantized` too), as two grouped GEMMs over the
    (token, slot) pairs sorted by expert: `torch._grouped_mm` for bf16/fp32 weights,
    `torch._scaled_grouped_mm` (sm90) for FP8 ones (emulated in fp32 off CUDA).

    Every shape depends only on T, k and the weights, and nothing reads device values on the host, so
    with a fixed T the whole function can be captured in a CUDA graph and replayed with new routing.
    Needs H and I such that rows are 16-byte aligned (multiples of 8 in bf16, 16 for FP8).
    """
    tokens, top_k = topk_ids.shape
    if tokens == 0:
        return torch.zeros_like(hidden)
    num_experts = gate_up_proj.shape[0]
    fp8 = gate_up_scale is not None and down_scale is not None
    # Pair p = t * k + j. `order` lists the pairs grouped by expert (stable: by token within an expert);
    # expert e's pairs are rows offsets[e-1]:offsets[e] of the sorted layout, with offsets the running
    # count of a device-side histogram.
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=hidden.device)
    counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids, dtype=torch.int32))
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    token_of = order // top_k
    pair_weights = topk_weights.reshape(-1)[order, None]

    if fp8:
        # One scale per token row, shared by its k copies: quantize the T rows, then gather.
        q, scale = rows_quantized(hidden, quantized)
        gate_up = _scaled_grouped_mm(q[token_of], scale[token_of], gate_up_proj, gate_up_scale, offsets)
    else:
        gate_up = torch._grouped_mm(hidden[token_of], gate_up_proj.transpose(-2, -1), offs=offsets)
    # The routing weight scales the down projection's input (it is linear), I wide instead of H wide.
    if fp8:
        q, scale = _swiglu_quantized(gate_up, pair_weights)
        expert_out = _scaled_grouped_mm(q, scale, down_proj, down_scale, offsets)
    else:
        gate, up = gate_up.chunk(2, dim=-1)
        act = F.silu(gate) * up * pair_weights.to(gate_up.dtype)
        expert_out = torch._grouped_mm(act, down_proj.transpose(-2, -1), offs=offsets)
    # Each token's k outputs, back from the sorted layout, summed in fp32 in slot order. Unlike index_add_
    # this has no atomics: the result does not depend on thread scheduling.
    if expert_out.is_cuda:
        from morion.ops.moe_grouped_triton import combine_pairs

        return combine_pairs(expert_out, order, top_k, hidden.dtype)
    unsorted = torch.empty_like(expert_out).index_copy_(0, order, expert_out)
    return unsorted.view(tokens, top_k, -1).sum(dim=1, dtype=torch.float32).to(hidden.dtype)


def _swiglu_quantized(gate_up: torch.Tensor, pair_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """silu(gate) * up * the pair's routing weight (in gate_up's dtype), quantized per row for the FP8 down
    GEMM: one Triton kernel on CUDA (ops/moe_grouped_triton.py), this torch chain elsewhere."""
    if gate_up.is_cuda:
        from morion.ops.moe_grouped_triton import swiglu_quantize

        return swiglu_quantize(gate_up, pair_weights)
    gate, up = gate_up.chunk(2, dim=-1)
    return quantize_fp8(F.silu(gate) * up * pair_weights.to(gate_up.dtype), per_row=True)


def _scaled_grouped_mm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    offsets: torch.Tensor,
) -> torch.Tensor:
    """a [M, K] e4m3 (rows grouped by expert as `offsets` says) with a_scale [M]; weight [E, N, K] e4m3
    with weight_scale [E, N]. Returns [M, N]: bf16 from the sm90 kernel, fp32 from the CPU emulation."""
    if a.is_cuda:
        # weight.transpose is [E, K, N] column-major per expert: the layout the kernel requires.
        return torch._scaled_grouped_mm(
            a, weight.transpose(-2, -1), a_scale, weight_scale, offs=offsets, out_dtype=torch.bfloat16
        )
    log_once(logger, f"FP8 grouped MoE GEMM on {a.device.type}: emulated in fp32 (dequantize + _grouped_mm)")
    return torch._grouped_mm(
        dequantize_fp8(a, a_scale), dequantize_fp8(weight, weight_scale).transpose(-2, -1), offs=offsets
    )
