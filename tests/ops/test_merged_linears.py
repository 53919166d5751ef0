"""Linear layers of one input merged into one weight (layers/merged_linears.py): one skinny launch gives
each layer the bits its own launch with the same tile gives, the layers' weights become views of the
merged one, and what may merge. On the CPU the kernel runs in Triton's interpreter; `group_tile` (CUDA
only in serving) is pointed at a test tile."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from morion.layers import merged_linears
from morion.layers.gated_attention import GatedAttentionProjections
from morion.layers.gated_delta_net_35 import GatedDeltaNet35
from morion.layers.linear_fp8 import Fp8Linear, linears_of_one_input
from morion.layers.merged_linears import MergedLinears, mergeable, products_of_one_input
from morion.ops import skinny_tiles
from morion.ops.fp8 import FP8_DTYPE, quantize_fp8
from morion.ops.moe_tiles import Tiles
from morion.ops.skinny_linear_triton import skinny_linear

TILES = [Tiles(32, 32, 4, 2, "dot"), Tiles(16, 64, 4, 2, "gemv")]


def _fp8_layer(outputs: int, depth: int, seed: int) -> Fp8Linear:
    """An FP8 layer with its own per-tensor scale (each layer of a group has a different one)."""
    generator = torch.Generator().manual_seed(seed)
    layer = Fp8Linear(depth, outputs)
    source = torch.randn(outputs, depth, generator=generator) * (seed + 1) / depth**0.5
    layer.weight.data, layer.weight_scale = quantize_fp8(source)
    return layer


@pytest.fixture
def group_tile(monkeypatch):
    """`group_tile` returning the test's tile for any rows; the tiles it was asked for recorded."""
    asked = []
    chosen = {"tile": TILES[0]}

    def tile(rows, merged, widest):
        asked.append((tuple(merged.shape), tuple(widest.shape)))
        return chosen["tile"]

    monkeypatch.setattr(merged_linears, "group_tile", tile)
    return chosen, asked


@pytest.mark.parametrize("tile", TILES, ids=lambda t: t.mma)
def test_merged_fp8_layers_give_each_layer_its_own_launch_bits(group_tile, tile):
    chosen, asked = group_tile
    chosen["tile"] = tile
    layers = [_fp8_layer(48, 64, seed=1), _fp8_layer(16, 64, seed=2), _fp8_layer(32, 64, seed=3)]
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(4))
    q, row_scale = quantize_fp8(x, per_row=True)
    alone = [
        skinny_linear(
            q, layer.weight, tile, x_scale=row_scale, weight_scale=layer.weight_scale, out_dtype=x.dtype
        )
        for layer in layers
    ]
    before = [layer.weight.clone() for layer in layers]
    merged = MergedLinears(layers)
    # The layers' weights are now views of the merged one's rows, holding the same values.
    assert merged.weight.shape == (96, 64) and merged.column_scale.shape == (96,)
    for layer, weight, start in zip(layers, before, (0, 48, 64), strict=True):
        assert layer.weight.data_ptr() == merged.weight[start].data_ptr()
        assert torch.equal(layer.weight.view(torch.uint8), weight.view(torch.uint8))
    outputs = linears_of_one_input(x, layers, merged=merged)
    assert asked == [((96, 64), (48, 64))]  # the merged shape's tile, else the widest layer's
    for out, expected in zip(outputs, alone, strict=True):
        assert torch.equal(out, expected)
    # Each row alone: the same bits (one tile for every M).
    for rows in (1, 3):
        for out, expected in zip(linears_of_one_input(x[:rows], layers, merged=merged), alone, strict=True):
            assert torch.equal(out, expected[:rows])


def test_rows_the_kernel_does_not_take_run_layer_by_layer(group_tile):
    chosen, _ = group_tile
    layers = [_fp8_layer(32, 64, seed=5), _fp8_layer(16, 64, seed=6)]
    x = torch.randn(3, 64)
    expected = linears_of_one_input(x, layers)  # the reference path, before merging
    merged = MergedLinears(layers)
    chosen["tile"] = None  # a prefill chunk, the CPU, or an untuned FP8 shape
    for out, want in zip(linears_of_one_input(x, layers, merged=merged), expected, strict=True):
        assert torch.equal(out, want)


def test_model_dtype_products_merge_without_scales(group_tile):
    chosen, _ = group_tile
    chosen["tile"] = Tiles(8, 32, 4, 2, "gemv")
    b, a = nn.Linear(64, 8, bias=False), nn.Linear(64, 8, bias=False)
    x = torch.randn(4, 64)
    alone = [skinny_linear(x, layer.weight, chosen["tile"]) for layer in (b, a)]
    merged = MergedLinears([b, a])
    assert merged.column_scale is None
    for out, expected in zip(products_of_one_input(x, (b, a), merged), alone, strict=True):
        assert torch.equal(out, expected)
    torch.testing.assert_close(alone[1], a(x), rtol=1e-5, atol=1e-5)


def test_what_may_merge(monkeypatch):
    """Two or more bias-free layers of one input, all FP8 or all plain model-dtype ones, on CUDA."""
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    fp8 = [_fp8_layer(32, 64, seed=7), _fp8_layer(16, 64, seed=8)]
    assert mergeable(fp8)
    assert merged_linears.merged_shape(fp8) == (48, 64, "fp8")
    assert not mergeable(fp8[:1])
    assert not mergeable([fp8[0], nn.Linear(64, 16, bias=False)])  # FP8 with model-dtype weights
    assert not mergeable([_fp8_layer(32, 64, seed=9), _fp8_layer(16, 48, seed=10)])  # another input width
    assert mergeable([nn.Linear(64, 8, bias=False), nn.Linear(64, 8, bias=False)])
    assert not mergeable([nn.Linear(64, 8), nn.Linear(64, 8)])  # biases
    odd = Fp8Linear(64, 24)
    assert not mergeable([fp8[0], odd])  # a shape the FP8 kernels do not take
    monkeypatch.undo()
    assert not mergeable([_fp8_layer(32, 64, seed=7), _fp8_layer(16, 64, seed=8)])  # the CPU


def test_gated_attention_names_its_group_and_the_model_walk_merges_it(monkeypatch):
    attention = GatedAttentionProjections(0, 64, num_heads=2, num_kv_heads=1, head_dim=16, rms_norm_eps=1e-6)
    assert attention.merge_groups() == {"merged_qkv": (attention.q_proj, attention.k_proj, attention.v_proj)}
    monkeypatch.setattr(merged_linears, "mergeable", lambda layers: True)
    model = nn.ModuleList([attention, nn.Linear(4, 4)])
    assert merged_linears.merge_projections(model) == 1
    assert isinstance(attention.merged_qkv, MergedLinears) and attention.merged_qkv.widths == (64, 16, 16)


def test_merging_again_keeps_the_first_merge_s_weights(monkeypatch):
    """A second engine on the same model merges again: the weights stay where the first merge put them
    (the first engine's CUDA graphs read them there; a new merge freed them, and those graphs replayed
    garbage), unless a layer's weight has since been replaced, which merges anew."""
    attention = GatedAttentionProjections(0, 64, num_heads=2, num_kv_heads=1, head_dim=16, rms_norm_eps=1e-6)
    monkeypatch.setattr(merged_linears, "mergeable", lambda layers: True)
    model = nn.ModuleList([attention])
    assert merged_linears.merged_groups(model) == 0
    assert merged_linears.merge_projections(model) == 1
    assert merged_linears.merged_groups(model) == 1  # what the disk tier's namespace reads
    first = attention.merged_qkv
    address = first.weight.data_ptr()
    values = first.weight.clone()
    assert merged_linears.merge_projections(model) == 1
    assert attention.merged_qkv is first and first.weight.data_ptr() == address
    assert attention.k_proj.weight.data_ptr() == first.weight[64:80].data_ptr()
    torch.testing.assert_close(first.weight, values, rtol=0, atol=0)
    attention.k_proj.weight = nn.Parameter(attention.k_proj.weight.detach().clone())  # e.g. reloaded
    assert not first.holds((attention.q_proj, attention.k_proj, attention.v_proj))
    assert merged_linears.merge_projections(model) == 1
    assert attention.merged_qkv is not first and attention.merged_qkv.holds(
        (attention.q_proj, attention.k_proj, attention.v_proj)
    )


def test_flash_next_gated_deltanet_reads_its_projections_from_the_merged_launches(group_tile):
    """in_proj_qkv with in_proj_z (FP8) and in_proj_b with in_proj_a (model dtype), merged: the layer's
    projections are the same values, each from its own columns."""
    chosen, _ = group_tile
    layer = GatedDeltaNet35(0, 64, num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16,
                            conv_kernel_size=4, rms_norm_eps=1e-6)  # fmt: skip
    layer.in_proj_qkv = _fp8_layer(layer.conv_dim, 64, seed=11)
    layer.in_proj_z = _fp8_layer(layer.value_dim, 64, seed=12)
    for proj in (layer.in_proj_b, layer.in_proj_a):
        nn.init.normal_(proj.weight, std=0.1)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(13))
    chosen["tile"] = None
    before = layer.project(x)
    chosen["tile"] = Tiles(16, 32, 4, 2, "gemv")
    groups = layer.merge_groups()
    assert set(groups) == {"merged_qkvz", "merged_ba"}
    for name, layers in groups.items():
        setattr(layer, name, MergedLinears(layers))
    after = layer.project(x)
    torch.testing.assert_close(after.qkv.x, before.qkv.x, rtol=1e-5, atol=1e-5)
    for got, want in ((after.z, before.z), (after.b, before.b), (after.a, before.a)):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_group_runs_its_merged_shapes_tile_else_its_widest_layers(monkeypatch):
    """The tuned tile of the merged weight's shape first (the skinny tuner times the groups), then the
    widest layer's; without either an FP8 group runs layer by layer and a model-dtype one the invariant
    GEMV."""
    tuned: dict[tuple[int, ...], Tiles] = {}
    monkeypatch.setattr(skinny_tiles, "tile_for", lambda rows, weight: tuned.get(tuple(weight.shape)))
    monkeypatch.setattr(skinny_tiles, "product_tile", lambda rows, weight: skinny_tiles.INVARIANT_GEMV)
    rows = torch.empty(1, 64)
    fp8_merged, fp8_widest = torch.empty(96, 64, dtype=FP8_DTYPE), torch.empty(48, 64, dtype=FP8_DTYPE)
    assert merged_linears.group_tile(rows, fp8_merged, fp8_widest) is None
    tuned[(48, 64)] = TILES[1]
    assert merged_linears.group_tile(rows, fp8_merged, fp8_widest) == TILES[1]
    tuned[(96, 64)] = TILES[0]
    assert merged_linears.group_tile(rows, fp8_merged, fp8_widest) == TILES[0]
    bf16_merged, bf16_widest = (
        torch.empty(16, 64, dtype=torch.bfloat16),
        torch.empty(8, 64, dtype=torch.bfloat16),
    )
    assert merged_linears.group_tile(rows, bf16_merged, bf16_widest) == skinny_tiles.INVARIANT_GEMV
    tuned[(8, 64)] = TILES[1]
    assert merged_linears.group_tile(rows, bf16_merged, bf16_widest) == TILES[1]
