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
from morion.layers.merged_linears import MergedLinears, products_of_one_input
from morion.ops.causal_conv1d import GroupedChannels
from morion.ops.fp8 import QuantizedRows


class GatedDeltaNet35(GatedDeltaNet):
    # in_proj_qkv with in_proj_z, and in_proj_b with in_proj_a, each pair one weight on CUDA
    # (layers/merged_linears.py, `merge_groups`), set after load.
    merged_qkvz: MergedLinears | None = None
    merged_ba: MergedLinears | None = None

    def _add_projections(self, hidden_size: int) -> None:
        self.in_proj_qkv = nn.Linear(hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden_size, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden_size, self.num_v_heads, bias=False)

    def _quantized_projections(self) -> tuple[nn.Module, ...]:
        return (self.in_proj_qkv, self.in_proj_z)

    def merge_groups(self) -> dict[str, tuple[nn.Module, ...]]:
        """The layers of one input that `merged_linears.merge_projections` may merge, by attribute."""
        return {
            "merged_qkvz": (self.in_proj_qkv, self.in_proj_z),
            "merged_ba": (self.in_proj_b, self.in_proj_a),
        }

    def project(self, x: torch.Tensor, quantized: QuantizedRows | None = None) -> Projections:
        """qkv [T, conv_dim] (q | k | v, each head-major: one plain group), z [T, HV, Dv], b and a [T, HV].
        Under FP8 weights x is quantized once for in_proj_qkv and in_proj_z (`linears_of_one_input`), or
        read as `quantized`; b and a (kept in the model dtype) through `products_of_one_input`. On CUDA
        each pair is one launch at decode sizes where it was merged (`merge_groups`)."""
        qkv, z = linears_of_one_input(x, self._quantized_projections(), quantized, self.merged_qkvz)
        z = z.view(x.shape[0], self.num_v_heads, self.head_v_dim)
        b, a = products_of_one_input(x, (self.in_proj_b, self.in_proj_a), self.merged_ba)
        return Projections(GroupedChannels.of(qkv), z, b, a)
