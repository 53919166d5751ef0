"""Gated DeltaNet in the Qwen3.5 form, as Qwen3.8-Flash-Next uses it.

The recurrence, conv, gates and state handling are Qwen3-Next's (`gated_delta_net.GatedDeltaNet`); two
things differ:

- projections are separate and head-first: `in_proj_qkv` gives [q all heads | k all heads | v all heads]
  (exactly the conv input), `in_proj_z` [T, HV * Dv], `in_proj_b` and `in_proj_a` [T, HV]. Value head j
  reads key head j // (HV / H), as in Qwen3-Next, so the kernels apply unchanged;
- the output gate may be sigmoid(z) (`output_gate_type: sigmoid`, the released model) instead of silu(z).
"""

from __future__ import annotations

import torch
from torch import nn

from morion.layers.gated_delta_net import GatedDeltaNet

OUTPUT_GATES = ("sigmoid", "silu")


class SigmoidGatedRMSNorm(nn.Module):
    """rmsnorm(x) * w * sigmoid(z) per value head. Rounding points as transformers'
    `Qwen4ExpTextRMSNormGated`: the normalised x is cast to the input dtype before the weight, the gate is
    applied in fp32, the product cast once. Pure torch on every device (no fused kernel yet)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (normed * torch.sigmoid(z.float())).to(x.dtype)


class GatedDeltaNet35(GatedDeltaNet):
    def __init__(
        self,
        linear_ordinal: int,
        hidden_size: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel_size: int,
        rms_norm_eps: float,
        output_gate: str,
    ) -> None:
        if output_gate not in OUTPUT_GATES:
            raise ValueError(f"output gate {output_gate!r} is not one of {', '.join(OUTPUT_GATES)}")
        super().__init__(
            linear_ordinal,
            hidden_size,
            num_k_heads,
            num_v_heads,
            head_k_dim,
            head_v_dim,
            conv_kernel_size,
            rms_norm_eps,
        )
        # The Qwen3-Next group-first projections are replaced (built on the meta device: nothing allocated).
        del self.in_proj_qkvz, self.in_proj_ba
        self.in_proj_qkv = nn.Linear(hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden_size, num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden_size, num_v_heads, bias=False)
        if output_gate == "sigmoid":
            self.norm = SigmoidGatedRMSNorm(head_v_dim, rms_norm_eps)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """mixed_qkv [T, conv_dim] (q | k | v, each head-major), z [T, HV, Dv], b and a [T, HV]."""
        z = self.in_proj_z(x).view(x.shape[0], self.num_v_heads, self.head_v_dim)
        return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)
