"""An FP8 linear layer and a model-dtype product of one input in one skinny launch
(layers/paired_products.py), and Qwen3-Next's Gated DeltaNet taking it for in_proj_qkvz and in_proj_ba.
On the CPU the skinny kernel runs in Triton's interpreter: tiles are handed to it as a tuned CUDA device
would (`tile_for`, `product_tile`)."""

from __future__ import annotations

import pytest
import torch

from morion.layers import gated_delta_net, paired_products
from morion.layers.gated_delta_net import GatedDeltaNet
from morion.layers.linear_fp8 import Fp8Linear, linears_of_one_input
from morion.ops.fp8 import quantize_fp8
from morion.ops.moe_tiles import Tiles
from morion.ops.skinny_linear_triton import skinny_linear
from morion.ops.skinny_tiles import linear_forward

FP8_TILE = Tiles(32, 32, 4, 2, "dot")
PRODUCT_TILE = Tiles(16, 64, 4, 2, "gemv")


def _gated_delta_net() -> GatedDeltaNet:
    """A Qwen3-Next Gated DeltaNet (hidden 64, 2 key heads, 4 value heads of 16) with an FP8 in_proj_qkvz
    and in_proj_ba in the model dtype, as `--weight-dtype fp8` leaves them."""
    torch.manual_seed(0)
    block = GatedDeltaNet(0, 64, 2, 4, 16, 16, 4, 1e-6)
    qkvz = block.in_proj_qkvz
    fp8 = Fp8Linear(qkvz.in_features, qkvz.out_features, bias=False)
    fp8.weight.data, fp8.weight_scale = quantize_fp8(qkvz.weight.detach() / 4)
    block.in_proj_qkvz = fp8
    return block


@pytest.fixture
def tuned(monkeypatch):
    """Tiles for both products as a tuned CUDA device gives them (CPU tensors too); `tuned["product"]`
    may be changed by a test."""
    tiles = {"fp8": FP8_TILE, "product": PRODUCT_TILE}
    monkeypatch.setattr(paired_products, "tile_for", lambda x, weight: tiles["fp8"])
    monkeypatch.setattr(paired_products, "product_tile", lambda x, weight: tiles["product"])
    return tiles


def test_the_pair_gives_each_product_the_bits_of_its_own_launch(tuned):
    block = _gated_delta_net()
    x = torch.randn(3, 64)
    q, row_scale = quantize_fp8(x, per_row=True)
    layer, weight = block.in_proj_qkvz, block.in_proj_ba.weight.detach()
    qkvz, ba = paired_products.fp8_linear_and_product(layer, q, row_scale, x.dtype, x, weight)
    alone = skinny_linear(
        q, layer.weight, FP8_TILE, x_scale=row_scale, weight_scale=layer.weight_scale, out_dtype=x.dtype
    )
    assert torch.equal(qkvz, alone) and torch.equal(ba, skinny_linear(x, weight, PRODUCT_TILE))


def test_tiles_of_another_warp_count_take_the_two_calls(tuned):
    """The product's tile at 2 warps (the FP8 tile's 4): each product its own way (here on the CPU:
    the FP8 layer's reference and F.linear), not paired."""
    tuned["product"] = PRODUCT_TILE._replace(num_warps=2)
    block = _gated_delta_net()
    x = torch.randn(2, 64)
    q, row_scale = quantize_fp8(x, per_row=True)
    layer, weight = block.in_proj_qkvz, block.in_proj_ba.weight.detach()
    qkvz, ba = paired_products.fp8_linear_and_product(layer, q, row_scale, x.dtype, x, weight)
    assert torch.equal(qkvz, layer.forward_quantized(q, row_scale, x.dtype))
    assert torch.equal(ba, torch.nn.functional.linear(x, weight))


def test_gated_delta_net_projects_qkvz_and_ba_through_the_pair(tuned, monkeypatch):
    """`project` hands in_proj_qkvz, x's quantized rows and in_proj_ba's weight to the pair, and its qkv,
    b and a are views of the pair's two outputs (b and a: each key-head group's r columns of ba)."""
    block = _gated_delta_net()
    x = torch.randn(4, 64)
    calls = []
    pair = paired_products.fp8_linear_and_product

    def spy(layer, q, row_scale, out_dtype, rows, weight):
        outputs = pair(layer, q, row_scale, out_dtype, rows, weight)
        calls.append((layer, q, rows, weight, outputs))
        return outputs

    monkeypatch.setattr(gated_delta_net, "fp8_linear_and_product", spy)
    with torch.no_grad():
        projections = block.project(x)
    [(layer, q, rows, weight, (qkvz, ba))] = calls
    assert layer is block.in_proj_qkvz and rows is x and weight is block.in_proj_ba.weight
    assert torch.equal(q.float(), quantize_fp8(x, per_row=True)[0].float())
    assert torch.equal(projections.qkv.x.reshape(4, -1), qkvz)
    groups = ba.view(4, 2, 4)  # 2 key-head groups of r = 2 value heads: [b | a] each
    assert torch.equal(projections.b, groups[..., :2]) and torch.equal(projections.a, groups[..., 2:])


def test_without_an_fp8_in_proj_qkvz_the_layers_run_one_by_one(monkeypatch):
    """A model-dtype Gated DeltaNet (no `--weight-dtype fp8`) never pairs: its projections are
    `linears_of_one_input` and `linear_forward` as before."""
    monkeypatch.setattr(gated_delta_net, "fp8_linear_and_product", lambda *args: pytest.fail("paired"))
    torch.manual_seed(1)
    block = GatedDeltaNet(0, 64, 2, 4, 16, 16, 4, 1e-6)
    x = torch.randn(3, 64)
    with torch.no_grad():
        projections = block.project(x)
        (qkvz,) = linears_of_one_input(x, (block.in_proj_qkvz,), None)
        ba = linear_forward(block.in_proj_ba, x)
    assert torch.equal(projections.qkv.x.reshape(3, -1), qkvz)
    assert torch.equal(projections.b, ba.view(3, 2, 4)[..., :2])
