"""A token's routed-expert outputs before their sum, for the kernel after the MoE block to add up.

The fused MoE decode kernels (ops/moe_decode_triton.py) leave each (token, slot) pair's weighted output
in fp32; a third kernel adds each token's slots in slot order and rounds the sum once to the model dtype.
That sum has one reader, the kernel after the block: in Qwen3-Next the residual add + norm (the next
layer's input norm, or the final norm; ops/add_rms_norm_triton.py), in Qwen3.8-Flash-Next the
hyper-connection inject (ops/hyper_connection_triton.py). Each adds the slots itself, in the same order
and with the same rounding: one launch fewer per MoE layer of a decode step. Any other reader calls
`summed()`, which runs the sum kernel: the values are the same either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SlotPartials:
    values: torch.Tensor  # [T, S, H] fp32, contiguous: slot s of token t times its routing weight
    dtype: torch.dtype  # what the sum is rounded to: the block's output dtype

    @property
    def shape(self) -> torch.Size:
        """The summed output's shape, [T, H]."""
        return torch.Size((self.values.shape[0], self.values.shape[2]))

    def summed(self) -> torch.Tensor:
        """[T, H] in `dtype`: each token's slots added in slot order in fp32, rounded once (the fused
        kernels' own sum kernel: these values only exist where their kernels run)."""
        from morion.ops.moe_decode_triton import sum_slots

        return sum_slots(self.values, self.dtype)
