"""Linear layers that read one input, merged into one weight: one skinny launch at decode sizes instead of
one per layer (issue #23's launch budget: gated attention's q, k and v; Qwen3.8-Flash-Next's Gated
DeltaNet in_proj_qkv and in_proj_z, and its in_proj_b and in_proj_a).

At load, on CUDA (`merge_projections`, called by engine/assembly.py before the warm-up and graph capture),
every module with a `merge_groups()` names its groups of layers, and gets a `MergedLinears` for each group
that qualifies (`mergeable`): the layers' weights copied into one [sum of N, K] tensor whose row blocks
then become the layers' own weights (views: the weights are not held twice), and for FP8 layers the
weight scale of each column (each layer has one; the skinny kernel reads a scale per column). The
module keeps it under the name it gave, and passes it to `linears_of_one_input` (FP8) or
`products_of_one_input` (model-dtype weights).

Where the skinny kernel takes the rows (CUDA, at most `skinny_linear_triton.MAX_ROWS`: decode, verify and
short forwards) the merged weight runs as one launch with the device's tuned tile for the merged shape, or
else the tile of the group's widest layer (`group_tile`), and each
layer's output is a view of its columns of that launch's output; elsewhere (prefill chunks, the CPU) and
for an FP8 group whose widest layer the device has no tuned tile for, each layer runs on its own, as
before. The consumers read those views in place: every kernel after them takes strided rows.

Bits: each output column is summed over K, scaled and rounded by the same program code whichever
columns share its launch, so a layer whose own tile is the group's tile gives the same bits merged or
alone (`tests/ops/test_merged_linears.py`, `test_merged_linears_gpu.py`); a layer with another tile of
its own sums K in that tile's order instead (a last-bit difference, as between any two tiles). Either
way a row's bits do not depend on its batch (one tile for every M), and cold and cached forwards run the
same launch.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import nn

from morion.layers.linear_fp8 import Fp8Linear, all_fp8
from morion.ops.log_once import log_once
from morion.ops.moe_tiles import Tiles
from morion.ops.skinny_tiles import LinearShape, linear_shape

logger = logging.getLogger(__name__)


class MergedLinears:
    """`layers`' weights as one [sum of N, K] tensor (each layer's weight now a view of its rows), with a
    weight scale per column for FP8 layers. Build only where `mergeable(layers)`."""

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        self.widths = tuple(layer.weight.shape[0] for layer in layers)
        first = layers[0].weight
        merged = torch.empty((sum(self.widths), first.shape[1]), dtype=first.dtype, device=first.device)
        scales = []
        start = 0
        for layer, width in zip(layers, self.widths, strict=True):
            merged[start : start + width].copy_(layer.weight)
            layer.weight.data = merged[start : start + width]  # the layer's own storage is freed
            start += width
            if isinstance(layer, Fp8Linear):
                scales.append(layer.weight_scale.float().reshape(1).expand(width))
        self.weight = merged
        self.column_scale = torch.cat(scales) if scales else None
        # Without a tuned tile for the merged shape the widest layer's runs the group (`group_tile`): the
        # layer with the most columns keeps its bits.
        self.widest = max(layers, key=lambda layer: layer.weight.shape[0]).weight

    def holds(self, layers: Sequence[nn.Module]) -> bool:
        """Whether `layers`' weights are still this merge's row blocks, in order."""
        if tuple(layer.weight.shape[0] for layer in layers) != self.widths:
            return False
        start = 0
        for layer, width in zip(layers, self.widths, strict=True):
            if layer.weight.data_ptr() != self.weight[start : start + width].data_ptr():
                return False
            start += width
        return True

    def outputs(
        self, rows: torch.Tensor, row_scale: torch.Tensor | None, out_dtype: torch.dtype
    ) -> list[torch.Tensor] | None:
        """Each layer's output [M, N_i] for rows [M, K] (e4m3 with `row_scale` [M] for FP8 layers, else in
        the model dtype), views of one launch's output; None where the group runs layer by layer."""
        tile = group_tile(rows, self.weight, self.widest)
        if tile is None:
            return None
        from morion.ops.skinny_linear_triton import skinny_linear

        log_once(logger, "linear layers of one input: one skinny launch per group at decode sizes")
        out = skinny_linear(
            rows, self.weight, tile, x_scale=row_scale, weight_scale=self.column_scale, out_dtype=out_dtype
        )
        return list(out.split(self.widths, dim=1))


def group_tile(rows: torch.Tensor, merged: torch.Tensor, widest: torch.Tensor) -> Tiles | None:
    """The tile a merged group runs with for these rows: the device's tuned tile for the merged weight's
    own shape (`python -m morion.bench.skinny_tune` times the groups too), else its widest layer's; for
    FP8 weights None without either (the layers then take cuBLAS one by one), for model-dtype weights
    the invariant GEMV (`skinny_tiles.product_tile`). None where the kernel does not take the rows."""
    from morion.ops import skinny_tiles

    tile = skinny_tiles.tile_for(rows, merged) or skinny_tiles.tile_for(rows, widest)
    if tile is not None or widest.element_size() == 1:
        return tile
    return skinny_tiles.product_tile(rows, widest)


def merged_shape(layers: Sequence[nn.Module]) -> LinearShape | None:
    """The merged weight's shape (sum of N, K, dtype) where `layers` are of a kind that merges, on any
    device: two or more layers of one input without biases, all `Fp8Linear`s the FP8 kernels take or all
    plain nn.Linear of one model dtype; else None."""
    if len(layers) < 2 or any(getattr(layer, "bias", None) is not None for layer in layers):
        return None
    weights = [layer.weight for layer in layers]
    if any(w.dtype != weights[0].dtype or w.shape[1] != weights[0].shape[1] for w in weights):
        return None
    if all_fp8(layers):
        kind_ok = all(layer.kernel_shapes for layer in layers)
    else:
        kind_ok = all(type(layer) is nn.Linear for layer in layers) and weights[0].element_size() > 1
    shape = linear_shape(weights[0])
    return shape._replace(outputs=sum(w.shape[0] for w in weights)) if kind_ok else None


def mergeable(layers: Sequence[nn.Module]) -> bool:
    """Layers of a kind that merges (`merged_shape`), their weights contiguous on CUDA."""
    return merged_shape(layers) is not None and all(
        layer.weight.is_cuda and layer.weight.is_contiguous() for layer in layers
    )


def merge_projections(model: nn.Module) -> int:
    """Merges every qualifying group that the model's modules name (`merge_groups()`: {attribute: layers}),
    setting each module's attribute to its `MergedLinears`; returns how many groups are merged.

    Idempotent: a group an earlier call merged keeps its `MergedLinears`. Another engine built on the same
    model (tests, benchmarks, an A/B in one process) merges again, and a new merge would move the weights
    into new tensors and free the old ones, which the first engine's CUDA graphs still read (they replayed
    whatever the allocator put there next: garbage tokens, different on every run)."""
    merged = 0
    for module in model.modules():
        groups = getattr(module, "merge_groups", None)
        if groups is None:
            continue
        for name, layers in groups().items():
            current = getattr(module, name, None)
            if isinstance(current, MergedLinears) and current.holds(layers):
                merged += 1
            elif mergeable(layers):
                setattr(module, name, MergedLinears(layers))
                merged += 1
    return merged


def merged_groups(model: nn.Module) -> int:
    """How many groups of the model's modules run merged (a `MergedLinears` under their group's name)."""
    return sum(
        isinstance(getattr(module, name, None), MergedLinears)
        for module in model.modules()
        if hasattr(module, "merge_groups")
        for name in module.merge_groups()
    )


def products_of_one_input(
    x: torch.Tensor, layers: Sequence[nn.Module], merged: MergedLinears | None
) -> list[torch.Tensor]:
    """`[linear_forward(layer, x) for layer in layers]` for model-dtype layers of one input, x [T, K]: one
    launch where `merged` runs these rows."""
    from morion.ops.skinny_tiles import linear_forward

    if merged is not None:
        outputs = merged.outputs(x, None, x.dtype)
        if outputs is not None:
            return outputs
    return [linear_forward(layer, x) for layer in layers]
