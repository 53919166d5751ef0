"""`--weight-dtype fp8` / `nvfp4`: swap a model's linear layers and stacked experts for their FP8 forms,
or under nvfp4 the routed experts for their NVFP4 form (ops/nvfp4.py) and the linear layers for FP8 ones.

Runs on the meta device, after construction and before any weight is materialised, so the model never
exists in full precision on the device: each weight is quantized as it is loaded or generated
(loader/). Kept in the model dtype: modules the model names in `keep` (precision-critical, tiny ones),
and shapes the FP8 kernels cannot take (a dimension not a multiple of 16). Embeddings, norms and convs
are not linear layers and never convert. Dense layers stay FP8 under nvfp4: they are a small share of the
bytes (the routed experts are 93% of Qwen3.8-Flash-Next's), and the FP8 GEMM is there and exact per row
where a 4-bit dense GEMM would add NVFP4's error to every token's path for a few GiB. For the same reason
the shared expert goes beside the routed ones under nvfp4 (layers/moe.py's beside layout: a one-expert
stack of its own, `shared_experts`, which converts to FP8, while the routed stack converts to NVFP4);
under fp8 a stacked shared expert stays stacked and is quantized per (expert, row) with the routed ones.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection
from typing import NamedTuple

import torch
from torch import nn

from morion.layers.linear_fp8 import Fp8Linear
from morion.layers.moe import SparseMoE, StackedExperts

_GIB = 1 << 30
# The name of a shared expert's own stack in the beside layout (layers/moe.py): FP8 under nvfp4.
SHARED_STACK = ".shared_experts"


class Fp8Conversion(NamedTuple):
    modules: int  # modules swapped
    tensors: int  # weight tensors now in e4m3 (or NVFP4 codes)
    bytes_before: int  # those weights in the model dtype
    bytes_after: int  # the same weights in e4m3 or NVFP4, plus their scales
    kept: tuple[str, ...]  # linear layers left in the model dtype
    experts: str = "fp8"  # the routed experts' format: fp8 or nvfp4

    def summary(self) -> str:
        kinds = Counter(name.rpartition(".")[2] for name in self.kept)
        kept = ", ".join(f"{count} {kind}" for kind, count in kinds.items())
        kept = f"; kept in the model dtype: {kept}" if kept else ""
        kind = "fp8 weights" if self.experts == "fp8" else f"fp8 weights ({self.experts} routed experts)"
        return (
            f"{kind}: {self.tensors} tensors in {self.modules} modules, "
            f"{self.bytes_before / _GIB:.2f} GiB -> {self.bytes_after / _GIB:.2f} GiB{kept}"
        )


def convert_to_fp8(model: nn.Module, keep: Collection[str] = (), experts: str = "fp8") -> Fp8Conversion:
    """Replaces, in place, every nn.Linear and StackedExperts in `model` (on the meta device) by its FP8
    form (StackedExperts by its `experts` form: fp8 or nvfp4), except modules whose dotted name ends with
    an entry of `keep` (e.g. "mlp.gate") or that lie inside such a module, and shapes without a kernel
    (dimensions not multiples of 16). The replacements are unfilled, like the modules they replace."""
    if experts not in ("fp8", "nvfp4"):
        raise ValueError(f"experts must be fp8 or nvfp4, got {experts!r}")
    if experts == "nvfp4":  # the shared expert is dense traffic on every token: it stays FP8
        for module in model.modules():
            if isinstance(module, SparseMoE):
                module.set_shared_expert_beside()
    modules = tensors = before = after = 0
    kept = []
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear | StackedExperts):
            continue
        if _named_in(name, keep) or not _kernel_shapes(module):
            kept.append(name)
            continue
        with torch.device("meta"):
            replacement = _fp8_form(module, "fp8" if name.endswith(SHARED_STACK) else experts)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, replacement)
        old, new = _weights(module), _weights(replacement)
        modules += 1
        tensors += len(old)
        before += sum(w.numel() * w.element_size() for w in old)
        after += sum(w.numel() * w.element_size() for w in new)
    return Fp8Conversion(modules, tensors, before, after, tuple(kept), experts)


def _named_in(name: str, keep: Collection[str]) -> bool:
    """`name` ends with an entry of `keep`, or lies inside a module that does ("visual": the whole tower)."""
    dotted = "." + name + "."
    return any(f".{entry}." in dotted for entry in keep)


def _kernel_shapes(module: nn.Module) -> bool:
    if isinstance(module, StackedExperts):
        sizes = (module.hidden_size, module.intermediate_size)
    else:
        sizes = (module.in_features, module.out_features)
    return all(size % 16 == 0 for size in sizes)


def _fp8_form(module: nn.Module, experts: str) -> nn.Module:
    if isinstance(module, StackedExperts):
        return StackedExperts(module.num_experts, module.hidden_size, module.intermediate_size, experts)
    return Fp8Linear.like(module)


def _weights(module: nn.Module) -> list[torch.Tensor]:
    """The tensors a conversion changes: weights (not biases, which stay) and their scales."""
    return [t for name, t in (*module.named_parameters(), *module.named_buffers()) if name != "bias"]
