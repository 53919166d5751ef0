"""The skinny linear kernel compiled on a GPU at the 80B preset's decode shapes: against the cuBLAS path
(FP8 rows and weights, then the router's bf16 product), a row the same bits alone as in every batch up to
MAX_ROWS, replayed in a CUDA graph with new rows, `Fp8Linear` at a tuned shape running the op the tuner
times (rows quantized first), the untuned model-dtype products of both presets (router, Gated DeltaNet
gates, QSA indexer) batch invariant through `product`, and the tuner's per-shape sweep end to end."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from morion.bench import skinny_tune
from morion.layers.linear_fp8 import Fp8Linear
from morion.ops import skinny_tiles
from morion.ops.fp8 import quantize_fp8, scaled_mm_rows
from morion.ops.moe_tiles import Tiles, device_name
from morion.ops.moe_tune import capture_graph
from morion.ops.skinny_linear_triton import MAX_ROWS, skinny_linear
from morion.ops.skinny_tiles import INVARIANT_GEMV, LinearShape, product, product_tile

pytestmark = pytest.mark.gpu

TILES = [Tiles(64, 128, 4, 3, "gemv"), Tiles(64, 128, 4, 3, "dot")]
# The same with K split over programs, as a tuned file may choose (K = 2,048: 16 tiles, 4 or 2 a slice).
SPLIT_TILES = [tiles._replace(split_k=split) for tiles, split in zip(TILES, (4, 8), strict=True)]


def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("tiles", TILES + SPLIT_TILES, ids=lambda t: f"{t.mma}-split{t.split_k}")
def test_fp8_rows_match_the_cublas_path_and_do_not_depend_on_the_batch(tiles):
    shape = LinearShape(12288, 2048, "fp8")
    operands = skinny_tune.random_weight(shape, torch.device("cuda"), 0)
    rows = skinny_tune.random_rows(shape, MAX_ROWS, torch.device("cuda"), 1)
    x, x_scale = rows["x"], rows["x_scale"]
    weight, weight_scale = operands["weight"], operands["weight_scale"]
    scales = {"x_scale": x_scale, "weight_scale": weight_scale}
    out = skinny_linear(x, weight, tiles, **scales, out_dtype=torch.bfloat16)
    cublas = scaled_mm_rows(x, x_scale, weight, weight_scale, None, torch.bfloat16)
    assert _rel_l2(out, cublas) < 5e-3  # cuBLAS rounds twice (its output, then times the row scale)
    for count in (1, 2, 3, 4, 8, 16, 17, 33):
        alone = skinny_linear(
            x[:count], weight, tiles, x_scale=x_scale[:count], weight_scale=weight_scale,
            out_dtype=torch.bfloat16,
        )  # fmt: skip
        assert torch.equal(alone, out[:count]), f"{count} rows differ from the same rows among {MAX_ROWS}"


@pytest.mark.parametrize("tiles", TILES + SPLIT_TILES, ids=lambda t: f"{t.mma}-split{t.split_k}")
def test_fp8_linear_at_a_tuned_shape_runs_the_op_the_tuner_times(tiles, tmp_path, monkeypatch):
    """With a tuned file for its shape, `Fp8Linear.forward` quantizes its bf16 rows once (the row kernel)
    and runs the skinny kernel on the e4m3 rows and their scales: the bits of the tuner's op."""
    shape = LinearShape(12288, 2048, "fp8")
    cuda = torch.device("cuda", torch.cuda.current_device())
    monkeypatch.setattr(skinny_tiles, "CONFIG_DIR", tmp_path)
    skinny_tiles.tuned_tile.cache_clear()
    skinny_tiles.config_path(device_name(cuda.index), shape).write_text(json.dumps({"tiles": list(tiles)}))
    try:
        operands = skinny_tune.random_weight(shape, cuda, 7)
        layer = Fp8Linear(shape.depth, shape.outputs).to(cuda)
        layer.weight.data, layer.weight_scale = operands["weight"], operands["weight_scale"]
        x = torch.randn(2, 4, shape.depth, device=cuda, generator=torch.Generator(cuda).manual_seed(8))
        x = x.to(torch.bfloat16)
        out = layer(x)
        q, x_scale = quantize_fp8(x.view(-1, shape.depth), per_row=True)
        tuned = skinny_tune.skinny_op(tiles)({"x": q, "x_scale": x_scale, **operands})
        assert out.shape == (2, 4, shape.outputs) and torch.equal(out.view(-1, shape.outputs), tuned)
        cublas = skinny_tune.cublas_op({"x": q, "x_scale": x_scale, **operands})
        assert _rel_l2(tuned, cublas) < 5e-3  # cuBLAS rounds twice
    finally:
        skinny_tiles.tuned_tile.cache_clear()


def test_bf16_router_rows_match_f_linear_and_replay_in_a_graph():
    shape = LinearShape(512, 2048, "bfloat16")
    weight = skinny_tune.random_weight(shape, torch.device("cuda"), 2)["weight"]
    x = skinny_tune.random_rows(shape, 4, torch.device("cuda"), 3)["x"]
    tiles = Tiles(32, 128, 4, 3, "gemv")
    eager = skinny_linear(x, weight, tiles)
    assert _rel_l2(eager, F.linear(x, weight)) < 5e-3
    static, out = x.clone(), torch.empty_like(eager)
    graph = capture_graph(lambda: out.copy_(skinny_linear(static, weight, tiles)))
    fresh = skinny_tune.random_rows(shape, 4, torch.device("cuda"), 4)["x"]
    static.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, skinny_linear(fresh, weight, tiles))


# (N, K) of the model-dtype products: 80B router (its shared gate's row stacked) and in_proj_ba; Flash-Next
# router, in_proj_b / a, indexer, PLE key and value.
PRODUCT_SHAPES = [(513, 2048), (64, 2048), (513, 2560), (48, 2560), (640, 2560), (10240, 2560), (2560, 2560)]


@pytest.mark.parametrize("outputs, depth", PRODUCT_SHAPES)
def test_untuned_products_are_batch_invariant_and_match_f_linear(outputs, depth):
    shape = LinearShape(outputs, depth, "bfloat16")
    weight = skinny_tune.random_weight(shape, torch.device("cuda"), 5)["weight"]
    x = skinny_tune.random_rows(shape, MAX_ROWS, torch.device("cuda"), 6)["x"]
    if product_tile(x, weight) != INVARIANT_GEMV:
        pytest.skip(f"this device has a tuned tile for {shape}")
    out = product(x, weight)
    assert _rel_l2(out, F.linear(x, weight)) < 5e-3
    for count in (1, 2, 3, 4, 5, 8, 16, 17, 33):
        assert torch.equal(product(x[:count], weight), out[:count]), f"{count} rows differ from {MAX_ROWS}"


def _split_over_four(tiles: Tiles, depth: int, dtype: str) -> list[Tiles]:
    return [tiles._replace(split_k=4)]


def test_the_tuner_times_a_shape_against_cublas(monkeypatch):
    monkeypatch.setattr(skinny_tune, "CANDIDATES", TILES)
    monkeypatch.setattr(skinny_tune, "launch_variants", lambda tiles: [tiles])
    monkeypatch.setattr(skinny_tune, "split_variants", _split_over_four)
    config = skinny_tune.tune_shape(LinearShape(2048, 4096, "fp8"), [1, 4], torch.device("cuda"))
    assert Tiles(*config["tiles"])._replace(split_k=1) in TILES and config["tiles"][-1] in (1, 4)
    assert set(config["us_per_call"]) == set(config["cublas_us_per_call"]) == {"1", "4"}
    assert all(us > 0 for us in [*config["us_per_call"].values(), *config["cublas_us_per_call"].values()])
    print(f"skinny 2048x4096 fp8: {config['us_per_call']} against cuBLAS {config['cublas_us_per_call']}")


def test_a_pair_at_the_80b_gated_delta_net_shapes_gives_each_product_its_own_bits(capsys):
    """in_proj_qkvz (FP8 12288 x 2048) and in_proj_ba (bf16 64 x 2048) with this device's tiles, paired
    (layers/paired_products.py): each output the bits of its own launch at M = 1, 4 and 16, and replayed
    in a CUDA graph; the pair's and the two launches' microseconds printed (never asserted)."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    weight, weight_scale = quantize_fp8(torch.randn(12288, 2048, device="cuda", generator=generator) / 45)
    ba = (torch.randn(64, 2048, device="cuda", generator=generator) / 45).bfloat16()
    lines = [_paired_at(rows, weight, weight_scale, ba, generator) for rows in (1, 4, 16)]
    with capsys.disabled():
        print("\n" + "\n".join(lines))


def _paired_at(
    rows: int, weight: torch.Tensor, weight_scale: torch.Tensor, ba: torch.Tensor, generator: torch.Generator
) -> str:
    """The pair's checks at `rows` rows; its timing line."""
    from morion.ops.moe_tune import graph_microseconds
    from morion.ops.skinny_linear_triton import SkinnyProduct, pairable, skinny_linear_pair

    x = torch.randn(rows, 2048, device="cuda", generator=generator).bfloat16()
    q, row_scale = quantize_fp8(x, per_row=True)
    fp8_tile, tile = skinny_tiles.tile_for(q, weight), product_tile(x, ba)
    if fp8_tile is None or not pairable(fp8_tile, tile):
        pytest.skip(f"no pairable tiles on {torch.cuda.get_device_name()}: {fp8_tile}, {tile}")
    first = SkinnyProduct(q, weight, fp8_tile, row_scale, weight_scale, None, torch.bfloat16)
    second = SkinnyProduct(x, ba, tile)

    def alone() -> tuple[torch.Tensor, torch.Tensor]:
        fp8_out = skinny_linear(
            q, weight, fp8_tile, x_scale=row_scale, weight_scale=weight_scale, out_dtype=torch.bfloat16
        )
        return fp8_out, skinny_linear(x, ba, tile)

    expected = alone()
    assert all(torch.equal(a, b) for a, b in zip(skinny_linear_pair(first, second), expected, strict=True))
    replayed = []
    capture_graph(lambda: replayed.append(skinny_linear_pair(first, second))).replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(replayed[-1], expected, strict=True))
    pair_us = graph_microseconds(lambda: [skinny_linear_pair(first, second) for _ in range(50)], 50)
    alone_us = graph_microseconds(lambda: [alone() for _ in range(50)], 50)
    return f"skinny pair M={rows}: paired {pair_us:.2f} us, two launches {alone_us:.2f} us"
