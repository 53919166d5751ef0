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

import torch
from torch import nn

from morion.errors import ModelLoadError
from morion.models.checkpoint import copy_checkpoint_tensor, fp8_scales

logger = logging.getLogger(__name__)

# Per-expert checkpoint names, scattered into the stacked parameters.
_PER_EXPERT = re.compile(
    r"^(?P<experts>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)


class MoECheckpointLoader:
    """One `load_weights` pass over `model` (which has an `mtp` attribute): `copy` every checkpoint
    tensor that goes to a parameter, then `finish`, which gives the checkpoint names still missing."""

    def __init__(self, model: nn.Module, model_type: str) -> None:
        self.model = model
        self.model_type = model_type
        self.params = dict(model.named_parameters())
        self.scales = fp8_scales(model)
        # Checkpoint names still to arrive; a stacked expert tensor counts as its per-expert names.
        self.missing = {
            unit for name, param in self.params.items() for unit in _checkpoint_names(name, param)
        }
        self.saw_mtp = False

    def copy(self, name: str, tensor: torch.Tensor) -> None:
        """Copies checkpoint tensor `name` (an HF name) into the parameter, or the stacked expert's slice,
        it fills."""
        self.saw_mtp = self.saw_mtp or name.startswith("mtp.")
        param_name, index, covered = self._target(name)
        scale = self.scales.get(param_name)
        copy_checkpoint_tensor(
            name, tensor, self.params[param_name][index], None if scale is None else scale[index]
        )
        self.missing.difference_update(covered)

    def finish(self) -> set[str]:
        """Drops the MTP head if no `mtp.*` tensor came; returns the checkpoint names still missing."""
        if not self.saw_mtp and self.model.mtp is not None:
            logger.info("checkpoint has no mtp.* weights: the model has no MTP head")
            self.model.mtp = None
            self.missing = {name for name in self.missing if not name.startswith("mtp.")}
        return self.missing

    def _target(self, name: str) -> tuple[str, tuple[int | slice, ...], list[str]]:
        """The parameter that checkpoint tensor `name` fills, the index of the part it fills (a stacked
        expert's slice; the same index selects an FP8 parameter's per-row scales) and the checkpoint
        names it covers."""
        param = self.params.get(name)
        if param is not None:
            return name, (), _checkpoint_names(name, param)
        match = _PER_EXPERT.match(name)
        if match is not None:
            expert, proj = int(match["expert"]), match["proj"]
            kind = "down_proj" if proj == "down_proj" else "gate_up_proj"
            stacked_name = f"{match['experts']}.{kind}"
            stacked = self.params.get(stacked_name)
            if stacked is not None and expert < stacked.shape[0]:
                if proj == "down_proj":
                    return stacked_name, (expert,), [name]
                size = stacked.shape[1] // 2
                rows = slice(0, size) if proj == "gate_proj" else slice(size, 2 * size)
                return stacked_name, (expert, rows), [name]
        raise ModelLoadError(f"checkpoint tensor {name!r} has no place in {self.model_type}")


def _checkpoint_names(name: str, param: torch.Tensor) -> list[str]:
    """The per-expert checkpoint names a stacked expert parameter stands for; otherwise its own name."""
    experts, _, kind = name.rpartition(".")
    if not experts.endswith("mlp.experts") or kind not in ("gate_up_proj", "down_proj"):
        return [name]
    projections = ("gate_proj", "up_proj") if kind == "gate_up_proj" else ("down_proj",)
    return [f"{experts}.{e}.{proj}.weight" for e in range(param.shape[0]) for proj in projections]
