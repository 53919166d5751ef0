"""Merged linear layers (layers/merged_linears.py) on a GPU at the presets' groups, with the shipped tuned
tiles: each layer's output from the one launch, against its own launch (the same bits where its own tile
is the group's, else within a last-bit difference), every row the same bits alone as in a batch, and
the launch replayed from a CUDA graph."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from morion.layers.linear_fp8 import Fp8Linear, linears_of_one_input
from morion.layers.merged_linears import MergedLinears, group_tile, mergeable, products_of_one_input
from morion.ops.fp8 import quantize_fp8
from morion.ops.moe_tune import capture_graph
from morion.ops.skinny_tiles import linear_forward, tile_for

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
# (outputs of each layer, K): the 80B's q (with its gate), k, v; Flash-Next's QSA q, k, v and its Gated
# DeltaNet in_proj_qkv and in_proj_z (FP8), in_proj_b and in_proj_a (bf16).
FP8_GROUPS = {"80b-qkv": ((8192, 512, 512), 2048), "flash-qkv": ((12288, 512, 512), 2560),
              "flash-qkvz": ((10240, 6144), 2560)}  # fmt: skip
BF16_GROUPS = {"flash-ba": ((48, 48), 2560)}


def _fp8_layers(widths: tuple[int, ...], depth: int) -> list[Fp8Linear]:
    generator = torch.Generator(device=CUDA).manual_seed(0)
    layers = []
    for i, width in enumerate(widths):
        layer = Fp8Linear(depth, width).to(CUDA)
        source = torch.randn(width, depth, device=CUDA, generator=generator) * (i + 1) / depth**0.5
        layer.weight.data, layer.weight_scale = quantize_fp8(source)
        layers.append(layer)
    return layers


@pytest.mark.parametrize("name", FP8_GROUPS)
def test_fp8_groups_match_each_layers_own_launch(name):
    widths, depth = FP8_GROUPS[name]
    layers = _fp8_layers(widths, depth)
    x = torch.randn(16, depth, device=CUDA).to(torch.bfloat16)
    alone = linears_of_one_input(x, layers)
    q, _ = quantize_fp8(x, per_row=True)  # the rows the kernel reads: tiles are looked up for e4m3 rows
    own_tiles = [tile_for(q, layer.weight) for layer in layers]
    assert mergeable(layers)
    merged = MergedLinears(layers)
    tile = group_tile(q, merged.weight, merged.widest)
    if tile is None:
        pytest.skip(f"no tuned tile on this device for {name}'s widest layer: the group runs layer by layer")
    together = linears_of_one_input(x, layers, merged=merged)
    for out, want, own in zip(together, alone, own_tiles, strict=True):
        if own == tile:
            assert torch.equal(out, want)
        else:  # another tile sums K in another order
            assert ((out.float() - want.float()).norm() / want.float().norm()).item() < 1e-2
    for rows in (1, 2, 4, 8):
        for out, full in zip(linears_of_one_input(x[:rows], layers, merged=merged), together, strict=True):
            assert torch.equal(out, full[:rows])
    static = x[:4].clone()
    outputs: list[torch.Tensor] = []

    def step() -> None:
        outputs[:] = linears_of_one_input(static, layers, merged=merged)

    graph = capture_graph(step)
    static.copy_(x[4:8])
    graph.replay()
    for out, full in zip(outputs, together, strict=True):
        assert torch.equal(out, full[4:8])


@pytest.mark.parametrize("name", BF16_GROUPS)
def test_model_dtype_groups_are_the_same_bits(name):
    widths, depth = BF16_GROUPS[name]
    layers = [nn.Linear(depth, w, bias=False, device=CUDA, dtype=torch.bfloat16) for w in widths]
    x = torch.randn(8, depth, device=CUDA).to(torch.bfloat16)
    alone = [linear_forward(layer, x) for layer in layers]
    merged = MergedLinears(layers)
    for out, want in zip(products_of_one_input(x, layers, merged), alone, strict=True):
        assert torch.equal(out, want)
