"""`--weight-dtype fp8`: swap a model's linear layers and stacked experts for their FP8 forms.

Runs on the meta device, after construction and before any weight is materialised, so the model never
exists in full precision on the device: each weight is quantized as it is loaded or generated
(loader/). Kept in the model dtype: modules the model names in `keep` (precision-critical, tiny ones),
and shapes the FP8 kernels cannot take (a dimension not a multiple of 16). Embeddings, norms and convs
are not linear layers and never convert.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection
from typing import NamedTuple

import torch
from torch import nn

from morion.layers.linear_fp8 import Fp8Linear
from morion.layers.moe import StackedExperts

_GIB = 1 << 30


class Fp8Conversion(NamedTuple):
    modules: int  # modules swapped
    tensors: int  # weight tensors now in e4m3
    bytes_before: int  # those weights in the model dtype
    bytes_after: int  # the same weights in e4m3, plus their fp32 scales
    kept: tuple[str, ...]  # linear layers left in the model dtype

    def summary(self) -> str:
        kinds = Counter(name.rpartition(".")[2] for name in self.kept)
        kept = ", ".join(f"{count} {kind}" for kind, count in kinds.items())
        kept = f"; kept in the model dtype: {kept}" if kept else ""
        return (
            f"fp8 weights: {self.tensors} tensors in {self.modules} modules, "
            f"{self.bytes_before / _GIB:.2f} GiB -> {self.bytes_after / _GIB:.2f} GiB{kept}"
        )


def convert_to_fp8(model: nn.Module, keep: Collection[str] = ()) -> Fp8Conversion:
    """Replaces, in place, every nn.Linear and StackedExperts in `model` (on the meta device) by its FP8
    form, except modules whose dotted name ends with an entry of `keep` (e.g. "mlp.gate") or that lie
    inside such a module, and shapes without an FP8 kernel. The replacements are unfilled, like the
    modules they replace."""
    modules = tensors = before = after = 0
    kept = []
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear | StackedExperts):
            continue
        if _named_in(name, keep) or not _kernel_shapes(module):
            kept.append(name)
            continue
        with torch.device("meta"):
            replacement = _fp8_form(module)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, replacement)
        old, new = _weights(module), _weights(replacement)
        modules += 1
        tensors += len(old)
        before += sum(w.numel() * w.element_size() for w in old)
        after += sum(w.numel() * w.element_size() for w in new)
    return Fp8Conversion(modules, tensors, before, after, tuple(kept))


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


def _fp8_form(module: nn.Module) -> nn.Module:
    if isinstance(module, StackedExperts):
        return StackedExperts(module.num_experts, module.hidden_size, module.intermediate_size, fp8=True)
    return Fp8Linear.like(module)


def _weights(module: nn.Module) -> list[torch.Tensor]:
    """The tensors a conversion changes: weights (not biases, which stay) and their scales."""
    return [t for name, t in (*module.named_parameters(), *module.named_buffers()) if name != "bias"]
