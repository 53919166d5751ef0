"""Loading checkpoints into the sparse-MoE models with an MTP head (Qwen3-Next, Qwen3.8-Flash-Next).

Checkpoints store the routed experts per expert (`mlp.experts.{e}.gate_proj.weight`, ...), the models
keep them stacked (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]): each
per-expert tensor is scattered into its slice. Already stacked checkpoints (transformers' in-memory
names) load as is. MTP weights are all or nothing: a checkpoint without any `mtp.*` tensor
(transformers' `save_pretrained` writes none) leaves the model without its MTP head (`model.mtp = None`).
"""

from __future__ import annotations

import logging
import re
from typing import NamedTuple

import torch
from torch import nn

from morion.errors import ModelLoadError
from morion.models.checkpoint import Nvfp4Scales, copy_checkpoint_tensor, fp8_scales, nvfp4_scales
from morion.ops.nvfp4 import Nvfp4Weight

logger = logging.getLogger(__name__)

# Per-expert checkpoint names, scattered into the stacked parameters.
_PER_EXPERT = re.compile(
    r"^(?P<experts>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)


class _Target(NamedTuple):
    param: str  # the parameter a checkpoint tensor fills
    index: tuple[int | slice, ...]  # the part it fills (a stacked expert's slice; also its scales' rows)
    part: tuple[int | slice, ...]  # for NVFP4 experts: the slice of the [E, P] global scales it sets
    covered: list[str]  # the checkpoint names it stands for


class MoECheckpointLoader:
    """One `load_weights` pass over `model` (which has an `mtp` attribute): `copy` every checkpoint
    tensor that goes to a parameter, then `finish`, which gives the checkpoint names still missing."""

    def __init__(self, model: nn.Module, model_type: str) -> None:
        self.model = model
        self.model_type = model_type
        self.params = dict(model.named_parameters())
        self.scales = fp8_scales(model)
        self.nvfp4 = nvfp4_scales(model)
        # Checkpoint names still to arrive; a stacked expert tensor counts as its per-expert names.
        self.missing = {
            unit for name, param in self.params.items() for unit in _checkpoint_names(name, param)
        }
        self.saw_mtp = False

    def copy(self, name: str, tensor: torch.Tensor | Nvfp4Weight) -> None:
        """Copies checkpoint tensor `name` (an HF name) into the parameter, or the stacked expert's slice,
        it fills."""
        self.saw_mtp = self.saw_mtp or name.startswith("mtp.")
        target = self._target(name)
        scale = self.scales.get(target.param)
        nvfp4 = self.nvfp4.get(target.param)
        copy_checkpoint_tensor(
            name,
            tensor,
            self.params[target.param][target.index],
            None if scale is None else scale[target.index],
            None if nvfp4 is None else Nvfp4Scales(nvfp4.block[target.index], nvfp4.parts[target.part]),
        )
        self.missing.difference_update(target.covered)

    def finish(self) -> set[str]:
        """Drops the MTP head if no `mtp.*` tensor came; returns the checkpoint names still missing."""
        if not self.saw_mtp and self.model.mtp is not None:
            logger.info("checkpoint has no mtp.* weights: the model has no MTP head")
            self.model.mtp = None
            self.missing = {name for name in self.missing if not name.startswith("mtp.")}
        return self.missing

    def _target(self, name: str) -> _Target:
        """The parameter that checkpoint tensor `name` fills, the index of the part it fills (a stacked
        expert's slice; the same index selects an FP8 parameter's per-row scales and an NVFP4 one's
        block scales), the global scales of NVFP4 experts it sets, and the checkpoint names it covers."""
        param = self.params.get(name)
        if param is not None:
            return _Target(name, (), (), _checkpoint_names(name, param))
        match = _PER_EXPERT.match(name)
        if match is not None:
            expert, proj = int(match["expert"]), match["proj"]
            kind = "down_proj" if proj == "down_proj" else "gate_up_proj"
            stacked_name = f"{match['experts']}.{kind}"
            stacked = self.params.get(stacked_name)
            if stacked is not None and expert < stacked.shape[0]:
                if proj == "down_proj":
                    return _Target(stacked_name, (expert,), (expert,), [name])
                size = stacked.shape[1] // 2
                part = 0 if proj == "gate_proj" else 1
                rows = slice(part * size, (part + 1) * size)
                return _Target(stacked_name, (expert, rows), (expert, slice(part, part + 1)), [name])
        raise ModelLoadError(f"checkpoint tensor {name!r} has no place in {self.model_type}")


def _checkpoint_names(name: str, param: torch.Tensor) -> list[str]:
    """The per-expert checkpoint names a stacked expert parameter stands for; otherwise its own name."""
    experts, _, kind = name.rpartition(".")
    if not experts.endswith("mlp.experts") or kind not in ("gate_up_proj", "down_proj"):
        return [name]
    projections = ("gate_proj", "up_proj") if kind == "gate_up_proj" else ("down_proj",)
    return [f"{experts}.{e}.{proj}.weight" for e in range(param.shape[0]) for proj in projections]
