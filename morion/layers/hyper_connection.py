"""Hyper-connections (transformers' `Qwen4ExpTextGatedResidual`): the residual is `n` streams, not one.

The model carries `streams [T, n * H]` (stream s is columns s*H .. s*H+H-1); the embeddings start as n
copies. Around every block (the mixer and the MoE of each layer):

    normed = grouped_rmsnorm(streams)                          one RMS per stream, weight (1 + w)
    gate   = sigmoid(W_up(silu(W_down(normed) / n)))           [T, n * H]
    input  = mean over streams of (gate * normed)              [T, H]: what the block sees
    inject = 2 * sigmoid(W_inject(normed) / n)                 [T, n]: each stream's share of the output
    streams = streams + block(input)[:, None, :] * inject[:, :, None]      (the un-normalised streams)

The trunk ends with a mixer of the same form without the inject weights: its `input` is the final hidden
state that the LM head reads (there is no final RMSNorm).

On CUDA, for at most `hyper_connection_triton.MAX_TOKENS` tokens (decode), the mix runs as two Triton
kernels (ops/hyper_connection_triton.py: the eager code's rounding points, batch-invariant) instead of
about fifteen eager ones; past them (prefill) everything after silu, the `W_up` product through the mean
over the streams, runs as one kernel of tl.dot tiles (ops/hyper_connection_prefill_triton.py: the same
rounding points, so five passes over [T, n * H] tensors become one read of normed); elsewhere, and as the
reference, the eager code below.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from morion.layers.grouped_norm import GroupedRMSNorm
from morion.layers.narrow_linear import NarrowLinear
from morion.ops.log_once import log_once
from morion.ops.slot_partials import SlotPartials

logger = logging.getLogger(__name__)


class HyperConnection(nn.Module):
    def __init__(self, hidden_size: int, hc_count: int, lowrank: int, eps: float, inject: bool) -> None:
        super().__init__()
        self.hc_count = hc_count
        self.hidden_size = hidden_size
        width = hc_count * hidden_size
        self.hc_norm = GroupedRMSNorm(width, hidden_size, eps)
        self.input_mix_weight_down = nn.Linear(width, lowrank, bias=False)
        self.input_mix_weight_up = nn.Linear(lowrank, width, bias=False)
        # None for the final mixer, which feeds the LM head and writes nothing back.
        self.block_inject_weight = NarrowLinear(width, hc_count, bias=False) if inject else None

    def mix(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """streams [T, n * H] -> (block input [T, H], inject weights [T, n] or None for the final mixer)."""
        if streams.is_cuda:
            from morion.ops import hyper_connection_triton

            weights = (
                self.hc_norm.weight,
                self.input_mix_weight_down.weight,
                self.input_mix_weight_up.weight,
                None if self.block_inject_weight is None else self.block_inject_weight.weight,
            )
            if hyper_connection_triton.supports(streams, *weights, self.hc_count):
                log_once(logger, "hyper-connection mix: two fused Triton kernels (decode), batch-invariant")
                return hyper_connection_triton.mix(streams, *weights, self.hc_count, self.hc_norm.eps)
            return self.mix_tiled(streams)
        return self.mix_reference(streams)

    def mix_reference(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`mix` in eager torch at any size, on any device: the reference of the fused kernels."""
        return self._mix_around_up(streams, self._up_mix_reference)

    def mix_tiled(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`mix` with its up half in one kernel of tl.dot tiles (ops/hyper_connection_prefill_triton.py)
        where that kernel takes the rows, else `mix_reference`."""
        return self._mix_around_up(streams, self._up_mix_tiled)

    def _mix_around_up(
        self, streams: torch.Tensor, up_mix: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The norm, act = silu(W_down(normed) / n) and the inject weights in eager torch around
        `up_mix(act, normed)`, the block input from there."""
        normed = self.hc_norm(streams)
        mixed = up_mix(F.silu(self.input_mix_weight_down(normed) / self.hc_count), normed)
        if self.block_inject_weight is None:
            return mixed, None
        return mixed, 2 * torch.sigmoid(self.block_inject_weight(normed) / self.hc_count)

    def _up_mix_reference(self, act: torch.Tensor, normed: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(self.input_mix_weight_up(act))
        per_stream = (self.hc_count, self.hidden_size)
        return (gate.unflatten(-1, per_stream) * normed.unflatten(-1, per_stream)).mean(dim=-2)

    def _up_mix_tiled(self, act: torch.Tensor, normed: torch.Tensor) -> torch.Tensor:
        from morion.ops import hyper_connection_prefill_triton as tiled

        up = self.input_mix_weight_up.weight
        if not tiled.supports(act, up, normed, self.hc_count):
            return self._up_mix_reference(act, normed)
        log_once(logger, "hyper-connection mix (prefill): its up half in one Triton kernel of tl.dot tiles")
        return tiled.up_mix(act, up, normed, self.hc_count)


def inject(
    streams: torch.Tensor, block_out: torch.Tensor | SlotPartials, weights: torch.Tensor
) -> torch.Tensor:
    """streams [T, n * H] plus the block's output [T, H] scaled per stream by weights [T, n]: on CUDA one
    kernel (the same bits), elsewhere `inject_reference`. block_out may be a MoE block's unsummed slots
    (`SlotPartials`): the kernel adds them itself, elsewhere they are summed first (the same values)."""
    if streams.is_cuda:
        from morion.ops import hyper_connection_triton

        if hyper_connection_triton.inject_supports(streams, block_out, weights):
            return hyper_connection_triton.inject(streams, block_out, weights)
    if isinstance(block_out, SlotPartials):
        block_out = block_out.summed()
    return inject_reference(streams, block_out, weights)


def inject_reference(streams: torch.Tensor, block_out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """`inject` in eager torch (two kernels on CUDA)."""
    return streams + (block_out.unsqueeze(-2) * weights.unsqueeze(-1)).flatten(-2)
