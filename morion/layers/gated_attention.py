"""Qwen3-Next gated full attention.

Compared with Qwen3 attention: q_proj also yields a per-head output gate (for each head, D query dims
then D gate dims), q/k norms are zero-centred, RoPE rotates only the first `rotary_dim` dims of each
head, and the attention output is multiplied by sigmoid(gate) before o_proj.

The eager code is the reference and the CPU path. On CUDA the q/k norms and RoPE run as one kernel
(ops/qk_norm_rope_triton.py), and with FP8 projections x is quantized once for q/k/v and the output gate
is applied in o_proj's activation quantization (ops/fp8.py), all with the same rounding points. x may
come quantized already (`GatedAttention.reads_fp8_rows`: the decoder layer's norm quantizes it in its
kernel).
"""

from __future__ import annotations

import torch
from torch import nn

from morion.layers.attention import AttentionBackend
from morion.layers.linear_fp8 import Fp8Linear, all_fp8, linears_of_one_input
from morion.layers.merged_linears import MergedLinears
from morion.layers.norm_variants import ZeroCentredRMSNorm
from morion.layers.rotary import apply_rotary
from morion.ops.fp8 import QuantizedRows, quantize_fp8_sigmoid_gated


class GatedAttentionProjections(nn.Module):
    """The projections, norms and output gate of gated attention, for layers that differ in what they
    attend to: `project` gives the heads, `gate_output` finishes the attention's output."""

    # q, k and v as one weight on CUDA (layers/merged_linears.py, `merge_groups`), set after load.
    merged_qkv: MergedLinears | None = None

    def __init__(
        self,
        attention_ordinal: int,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rms_norm_eps: float,
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.attention_ordinal = attention_ordinal
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim * 2, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias)
        self.q_norm = ZeroCentredRMSNorm(head_dim, rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(head_dim, rms_norm_eps)

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, quantized: QuantizedRows | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [T, hidden]; cos, sin: [T, rotary_dim]; `quantized`: x's rows quantized per row, for FP8
        projections (`linears_of_one_input`). Returns q [T, H, D] and k [T, Hkv, D], normed and rotated,
        v [T, Hkv, D] and the output gate [T, H, D]."""
        tokens = x.shape[0]
        # Under FP8 weights x is quantized once for the three projections (or was, by whoever made x).
        q_gate, k, v = linears_of_one_input(
            x, (self.q_proj, self.k_proj, self.v_proj), quantized, self.merged_qkv
        )
        q, gate = q_gate.view(tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        q, k = norm_and_rotate(q, k, self.q_norm, self.k_norm, cos, sin)
        return q, k, v, gate

    def merge_groups(self) -> dict[str, tuple[nn.Module, ...]]:
        """The layers of one input that `merged_linears.merge_projections` may merge, by attribute."""
        return {"merged_qkv": (self.q_proj, self.k_proj, self.v_proj)}

    def gate_output(self, out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """The attention output [T, H, D] times sigmoid(gate), through o_proj: [T, hidden]."""
        tokens = out.shape[0]
        if isinstance(self.o_proj, Fp8Linear) and tokens:
            # The gate and o_proj's activation quantization in one pass (one kernel on CUDA).
            quantized, row_scale = quantize_fp8_sigmoid_gated(out, gate)
            return self.o_proj.forward_quantized(quantized, row_scale, out.dtype)
        # [T, H, D] shapes: the strided gate is read in place, where reshaping it first would copy it.
        return self.o_proj((out * torch.sigmoid(gate)).flatten(1))


def norm_and_rotate(
    q: torch.Tensor,
    k: torch.Tensor,
    q_norm: ZeroCentredRMSNorm,
    k_norm: ZeroCentredRMSNorm,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D] and k [T, Hkv, D] (views of the projections) normed, then rotated on their first
    `cos.shape[-1]` dims. On CUDA one kernel for both (ops/qk_norm_rope_triton.py, same rounding points);
    the eager code here is its reference and runs everywhere else, and for shapes the kernel does not
    take."""
    if q.is_cuda:
        from morion.ops import qk_norm_rope_triton as heads

        if q_norm.eps == k_norm.eps and heads.supports(q, k, cos, sin):
            return heads.qk_norm_rope(q, k, q_norm.weight, k_norm.weight, q_norm.eps, cos, sin)
    return apply_rotary(q_norm(q), cos, sin), apply_rotary(k_norm(k), cos, sin)


class GatedAttention(GatedAttentionProjections):
    @property
    def reads_fp8_rows(self) -> bool:
        """Whether `forward` reads x quantized per row (FP8 q/k/v projections, set by `--weight-dtype fp8`'s
        conversion): then a caller that has the rows quantized passes them (`quantized`)."""
        return all_fp8((self.q_proj, self.k_proj, self.v_proj))

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        backend: AttentionBackend,
        quantized: QuantizedRows | None = None,
    ) -> torch.Tensor:
        """x: [T, hidden]; cos, sin: [T, rotary_dim]; `quantized` as `project`'s. Returns [T, hidden]."""
        q, k, v, gate = self.project(x, cos, sin, quantized)
        return self.gate_output(backend.attend(self.attention_ordinal, q, k, v, self.scale), gate)
