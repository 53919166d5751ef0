"""Named torch-profiler ranges over a step's parts, switched on only while something profiles
(`morion bench --profile`: bench/profile.py).

Off, a region costs one attribute test and a shared null context, so the step loop keeps its regions
always in place. On, the runner's forward, the LM head and the sampler run inside `morion:forward`,
`morion:lm_head` and `morion:sampling` (speculative decoding's drafting and acceptance inside
`morion:draft` and `morion:acceptance`), and, when asked for by module, every model part of a known
kind runs inside `morion:module:<kind>` through forward hooks (the hooks are removed when profiling
ends; they fire only in eager forwards, which is why profiling by module turns the CUDA graphs off).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

PREFIX = "morion:"
MODULE_PREFIX = f"{PREFIX}module:"
FORWARD = f"{PREFIX}forward"
LM_HEAD = f"{PREFIX}lm_head"
SAMPLING = f"{PREFIX}sampling"
DRAFT = f"{PREFIX}draft"  # speculative decoding: proposing, and launching the next step's drafts
ACCEPTANCE = f"{PREFIX}acceptance"  # speculative decoding: which drafts a verify accepts

# The MoE block's expert kernels (its `experts` stack: the routed experts, and a shared expert stacked
# with them, layers/moe.py), timed apart from the block's other ops so that `morion bench --profile` can
# set their device time against the bytes they read (bench/profile.py).
MOE_EXPERTS = "MoE experts"

# Kinds by the attribute a part has in its parent; `mlp` is the MoE block when it has routed experts (its
# own part is then the router and what surrounds the experts; a separate shared expert, or one beside them
# in a stack of its own, is a part of its own).
_KIND_BY_NAME = {
    "self_attn": "full attention",
    "linear_attn": "Gated DeltaNet",
    "experts": MOE_EXPERTS,
    "shared_expert": "shared expert",
    "shared_expert_gate": "shared expert",
    "shared_experts": "shared expert",
    "embed_tokens": "embedding",
    "mtp": "MTP head",
}

_OFF = contextlib.nullcontext()


def module_kind(name: str, module: nn.Module) -> str | None:
    """The kind a model part is profiled as, from its qualified name; None for parts timed with their
    parent (norms, projections inside a layer, ...)."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "mlp":
        return "MoE block, other ops (router, route)" if hasattr(module, "experts") else "dense MLP"
    return _KIND_BY_NAME.get(leaf)


class ProfileRanges:
    """The profiler ranges of one model runner's forwards and of the engine's sampling."""

    def __init__(self) -> None:
        self.enabled = False

    def region(self, name: str) -> contextlib.AbstractContextManager[object]:
        """A profiler range named `name` while profiling; nothing otherwise."""
        return torch.profiler.record_function(name) if self.enabled else _OFF

    @contextlib.contextmanager
    def on(self, model: nn.Module | None = None) -> Iterator[None]:
        """Regions on for the duration; with `model`, each of its parts of a known kind in a range too."""
        handles = _install_module_ranges(model) if model is not None else []
        self.enabled = True
        try:
            yield
        finally:
            self.enabled = False
            for handle in handles:
                handle.remove()


def _install_module_ranges(model: nn.Module) -> list[torch.utils.hooks.RemovableHandle]:
    open_ranges: list[torch.profiler.record_function] = []

    def enter(kind: str):
        def hook(module: nn.Module, args: object) -> None:
            open_ranges.append(torch.profiler.record_function(f"{MODULE_PREFIX}{kind}"))
            open_ranges[-1].__enter__()

        return hook

    def leave(module: nn.Module, args: object, output: object) -> None:
        open_ranges.pop().__exit__(None, None, None)

    handles = []
    for name, module in model.named_modules():
        kind = module_kind(name, module)
        if kind is not None:
            handles.append(module.register_forward_pre_hook(enter(kind)))
            handles.append(module.register_forward_hook(leave))
    return handles
