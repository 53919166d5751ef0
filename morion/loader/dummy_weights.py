"""Random weights of the real shapes (`--load-format dummy`): for benchmarks, never for answers.

Generated on the model's device with a seeded generator, so building a full-size model takes seconds
and the same seed gives the same weights. Values are scaled like a trained model's (fan-in scaled
matrices, norms near their identity) so activations stay finite through many layers; nothing is zero.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from morion.layers.norm import RMSNorm
from morion.progress import Progress


def fill_dummy_weights(model: nn.Module, seed: int) -> None:
    params = list(model.named_parameters())
    device = params[0][1].device
    generator = torch.Generator(device=device).manual_seed(seed)
    unit_norms = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    progress = Progress("random weights", len(params), " tensors")
    with torch.no_grad():
        for name, param in params:
            _fill(name, param, id(param) in unit_norms, generator)
            progress.advance()
    progress.finish()


def _fill(name: str, param: torch.Tensor, unit_norm: bool, generator: torch.Generator) -> None:
    if name.endswith("A_log"):  # decay rates A in [1, 16], the Gated DeltaNet initialisation
        param.uniform_(0.0, math.log(16.0), generator=generator)
    elif name.endswith("dt_bias"):
        param.fill_(1.0)
    elif param.dim() >= 2:
        fan_in = math.prod(param.shape[1:]) if param.dim() > 2 and "conv" in name else param.shape[-1]
        param.normal_(0.0, fan_in**-0.5, generator=generator)
    elif unit_norm:  # weight multiplies the normalised value directly
        param.normal_(1.0, 0.02, generator=generator)
    else:  # biases, and zero-centred norms whose scale is (1 + weight)
        param.normal_(0.0, 0.02, generator=generator)
