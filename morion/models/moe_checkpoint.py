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
from morion.layers.moe import SparseMoE
from morion.models.checkpoint import Nvfp4Scales, copy_checkpoint_tensor, fp8_scales, nvfp4_scales
from morion.ops.nvfp4 import Nvfp4Weight

logger = logging.getLogger(__name__)

# Per-expert checkpoint names, scattered into the stacked parameters.
_PER_EXPERT = re.compile(
    r"^(?P<experts>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)
# The shared expert's checkpoint names (its projections, or with no `proj` its gate), for stacked blocks.
_SHARED = re.compile(
    r"^(?P<mlp>.+\.mlp)\.(?:shared_expert\.(?P<proj>gate_proj|up_proj|down_proj)|shared_expert_gate)\.weight$"
)
# A block's router weight and stacked expert parameters, the ones a stacked shared expert shares.
_BLOCK_PARAM = re.compile(
    r"^(?P<mlp>.+\.mlp)\.(?P<param>gate\.weight|experts\.gate_up_proj|experts\.down_proj)$"
)
# The parameters of a shared expert's own stack (the beside layout, layers/moe.py).
_SHARED_STACK_PARAM = re.compile(r"^(?P<mlp>.+\.mlp)\.shared_experts\.(?P<param>gate_up_proj|down_proj)$")
# The checkpoint projections each stacked parameter holds.
_PROJECTIONS = {"experts.gate_up_proj": ("gate_proj", "up_proj"), "experts.down_proj": ("down_proj",)}


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
        # The router row of the shared expert's gate (= routed count) of each MoE block whose router
        # holds it, by its name: a stacked shared expert is that expert of `experts` too, one beside
        # (`beside`) the one expert of `shared_experts`.
        blocks = [(name, m) for name, m in model.named_modules() if isinstance(m, SparseMoE)]
        self.beside = {name for name, block in blocks if block.shared_experts is not None}
        self.shared_slots = {
            name: block.num_experts
            for name, block in blocks
            if block.shared_slot is not None or name in self.beside
        }
        # Checkpoint names still to arrive; a stacked expert tensor counts as its per-expert names.
        self.missing = {
            unit for name, param in self.params.items() for unit in self._checkpoint_names(name, param)
        }
        self.saw_mtp = False

    def copy(self, name: str, tensor: torch.Tensor | Nvfp4Weight) -> None:
        """Copies checkpoint tensor `name` (an HF name) into the parameter, or the stacked expert's slice,
        it fills."""
        self.saw_mtp = self.saw_mtp or name.startswith("mtp.")
        target = self._target(name, tensor.shape)
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

    def _target(self, name: str, shape: tuple[int, ...]) -> _Target:
        """The parameter that checkpoint tensor `name` (of `shape`) fills, the index of the part it fills
        (a stacked expert's slice, router rows; the same index selects an FP8 parameter's per-row scales
        and an NVFP4 one's block scales), the global scales of NVFP4 experts it sets, and the checkpoint
        names it covers."""
        shared = _SHARED.match(name)
        if shared is not None and shared["mlp"] in self.shared_slots:
            slot = self.shared_slots[shared["mlp"]]
            if shared["proj"] is None:  # the shared expert's gate: the router's last row
                return _Target(f"{shared['mlp']}.gate.weight", (slice(slot, slot + 1),), (), [name])
            if shared["mlp"] in self.beside:
                return self._expert_target(f"{shared['mlp']}.shared_experts", 0, shared["proj"], name)
            return self._expert_target(f"{shared['mlp']}.experts", slot, shared["proj"], name)
        param = self.params.get(name)
        if param is not None:
            block = _BLOCK_PARAM.match(name)
            slot = None if block is None else self.shared_slots.get(block["mlp"])
            if slot is not None and len(shape) == param.dim() and shape[0] == slot:
                # The router's E rows, or stacked checkpoint tensors of the E routed experts.
                rows = (slice(0, slot),)
                return _Target(name, rows, rows, _routed_names(block, slot))
            return _Target(name, (), (), self._checkpoint_names(name, param))
        match = _PER_EXPERT.match(name)
        if match is not None:
            experts, expert = match["experts"], int(match["expert"])
            stacked = self.params.get(f"{experts}.gate_up_proj")
            routed = self.shared_slots.get(experts.removesuffix(".experts"))
            if routed is None and stacked is not None:
                routed = stacked.shape[0]
            if routed is not None and expert < routed:
                return self._expert_target(experts, expert, match["proj"], name)
        raise ModelLoadError(f"checkpoint tensor {name!r} has no place in {self.model_type}")

    def _expert_target(self, experts: str, expert: int, proj: str, name: str) -> _Target:
        """Checkpoint matrix `name`, projection `proj` of expert `expert`, in the stacked `experts`."""
        if proj == "down_proj":
            return _Target(f"{experts}.down_proj", (expert,), (expert,), [name])
        stacked_name = f"{experts}.gate_up_proj"
        size = self.params[stacked_name].shape[1] // 2
        part = 0 if proj == "gate_proj" else 1
        rows = slice(part * size, (part + 1) * size)
        return _Target(stacked_name, (expert, rows), (expert, slice(part, part + 1)), [name])

    def _checkpoint_names(self, name: str, param: torch.Tensor) -> list[str]:
        """The checkpoint names a parameter stands for: a stacked expert parameter its per-expert names,
        and where the block stacks its shared expert, the shared expert's (its projections for the
        experts, its gate for the router); a beside block's shared stack its shared expert's projections;
        otherwise its own name."""
        stack = _SHARED_STACK_PARAM.match(name)
        if stack is not None:  # the one expert of a beside block's shared stack
            projections = _PROJECTIONS[f"experts.{stack['param']}"]
            return [f"{stack['mlp']}.shared_expert.{proj}.weight" for proj in projections]
        block = _BLOCK_PARAM.match(name)
        if block is None:
            return [name]
        slot = self.shared_slots.get(block["mlp"])
        if slot is None:
            return _routed_names(block, param.shape[0])
        if block["param"] == "gate.weight":
            return [name, f"{block['mlp']}.shared_expert_gate.weight"]
        if block["mlp"] in self.beside:
            return _routed_names(block, slot)
        projections = _PROJECTIONS[block["param"]]
        shared = [f"{block['mlp']}.shared_expert.{proj}.weight" for proj in projections]
        return _routed_names(block, slot) + shared


def _routed_names(block: re.Match[str], count: int) -> list[str]:
    """The checkpoint names of the router weight or of `count` routed experts' stacked parameter that
    `_BLOCK_PARAM` matched."""
    if block["param"] == "gate.weight":
        return [block[0]]
    projections = _PROJECTIONS[block["param"]]
    return [f"{block['mlp']}.experts.{e}.{proj}.weight" for e in range(count) for proj in projections]
