"""Gated DeltaNet in the Qwen3.5 form, as Qwen3.8-Flash-Next uses it.

The recurrence, conv, gates and state handling are Qwen3-Next's (`gated_delta_net.GatedDeltaNet`); two
things differ:

- projections are separate and head-first: `in_proj_qkv` gives [q all heads | k all heads | v all heads]
  (exactly the conv input), `in_proj_z` [T, HV * Dv], `in_proj_b` and `in_proj_a` [T, HV]. Value head j
  reads key head j // (HV / H), as in Qwen3-Next, so the kernels apply unchanged;
- the output gate may be sigmoid(z) (`output_gate_type: sigmoid`, the released model) instead of silu(z):
  the base class's `output_gate`.
"""

from __future__ import annotations

import torch
from torch import nn

from morion.layers.gated_delta_net import GatedDeltaNet, Projections
from morion.layers.linear_fp8 import linears_of_one_input
from morion.ops.causal_conv1d import GroupedChannels
from morion.ops.fp8 import QuantizedRows
from morion.ops.skinny_tiles import linear_forward


class GatedDeltaNet35(GatedDeltaNet):
    def _add_projections(self, hidden_size: int) -> None:
        self.in_proj_qkv = nn.Linear(hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden_size, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden_size, self.num_v_heads, bias=False)

    def _quantized_projections(self) -> tuple[nn.Module, ...]:
        return (self.in_proj_qkv, self.in_proj_z)

    def project(self, x: torch.Tensor, quantized: QuantizedRows | None = None) -> Projections:
        """qkv [T, conv_dim] (q | k | v, each head-major: one plain group), z [T, HV, Dv], b and a [T, HV].
        Under FP8 weights x is quantized once for in_proj_qkv and in_proj_z (`linears_of_one_input`), or
        read as `quantized`; b and a (kept in the model dtype) take the skinny kernel where the device
        tuned their shape."""
        qkv, z = linears_of_one_input(x, self._quantized_projections(), quantized)
        z = z.view(x.shape[0], self.num_v_heads, self.head_v_dim)
        b, a = linear_forward(self.in_proj_b, x), linear_forward(self.in_proj_a, x)
        return Projections(GroupedChannels.of(qkv), z, b, a)
