"""The skinny linear kernel (decode-size rows, one pass over the weight, scales in the epilogue): against
F.linear and the FP8 reference in every MMA mode, a row the same bits alone as in any batch, the tuned-tile
files that decide where it runs, and its wiring into the FP8 linear (rows quantized before it, once per
input: the operands the tuner times; model-dtype rows with FP8 weights are refused), the router and
in_proj_ba. On the CPU the kernel runs in Triton's interpreter (no bf16 there: fp32 and fp16)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from morion.bench import skinny_tune
from morion.layers import linear_fp8
from morion.layers.linear_fp8 import Fp8Linear
from morion.ops import fp8, skinny_linear_triton, skinny_tiles
from morion.ops.fp8 import FP8_DTYPE, fp8_linear_quantized, fp8_linear_quantized_reference, quantize_fp8
from morion.ops.moe_tiles import Tiles
from morion.ops.skinny_linear_triton import MAX_ROWS, skinny_linear

MODES = [Tiles(32, 32, 4, 2, "dot"), Tiles(16, 64, 4, 2, "gemv"), Tiles(64, 32, 4, 2, "swapped")]
# K split over programs (a tuned file may choose it): at K = 100 in tiles of 32, two slices of two tiles,
# or three of which the last is empty.
SPLIT = [Tiles(32, 32, 4, 2, "dot", split_k=2), Tiles(16, 32, 4, 2, "gemv", split_k=3)]
# What the untuned model-dtype products (router, gates, QSA indexer) run on CUDA at decode sizes.
MODEL_DTYPE_TILES = [*MODES, *SPLIT, skinny_tiles.INVARIANT_GEMV]


def _operands(rows: int, outputs: int, depth: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, depth, generator=generator)
    return x, torch.randn(outputs, depth, generator=generator) * depth**-0.5


@pytest.mark.parametrize("tiles", MODEL_DTYPE_TILES, ids=lambda t: "-".join(map(str, t)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_model_dtype_rows_match_f_linear_and_do_not_depend_on_the_batch(tiles, dtype):
    x, weight = _operands(19, 72, 100, seed=1)  # N and K not multiples of the tile
    x, weight = x.to(dtype), weight.to(dtype)
    out = skinny_linear(x, weight, tiles)
    assert out.shape == (19, 72) and out.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 2e-3
    expected = F.linear(x.float(), weight.float())
    torch.testing.assert_close(out.float(), expected, rtol=tolerance, atol=tolerance)
    for rows in (1, 2, 3, 17):
        assert torch.equal(skinny_linear(x[:rows], weight, tiles), out[:rows])


@pytest.mark.parametrize("tiles", [*MODES[:2], *SPLIT], ids=lambda t: f"{t.mma}-split{t.split_k}")
def test_fp8_rows_take_both_scales_and_the_bias_before_one_rounding(tiles):
    x, weight = _operands(9, 48, 96, seed=2)
    q, row_scale = quantize_fp8(x, per_row=True)
    weight_q, weight_scale = quantize_fp8(weight)
    bias = torch.randn(48, generator=torch.Generator().manual_seed(3)).to(torch.float16)
    out = skinny_linear(
        q, weight_q, tiles, x_scale=row_scale, weight_scale=weight_scale, bias=bias, out_dtype=torch.float16
    )
    reference = fp8_linear_quantized_reference(q, row_scale, weight_q, weight_scale, bias, torch.float16)
    assert out.dtype == torch.float16
    # Both sum exact products in fp32 (scales after the sum here, before it there): a last-bit difference
    # of the fp32 sum at most, then one rounding to fp16.
    torch.testing.assert_close(out, reference, rtol=1e-3, atol=1e-3)
    for rows in (1, 4):
        alone = skinny_linear(
            q[:rows], weight_q, tiles, x_scale=row_scale[:rows], weight_scale=weight_scale, bias=bias,
            out_dtype=torch.float16,
        )  # fmt: skip
        assert torch.equal(alone, out[:rows])
    with pytest.raises(ValueError, match="x_scale"):
        skinny_linear(q, weight_q, tiles)
    with pytest.raises(ValueError, match="out_dtype"):
        skinny_linear(q, weight_q, tiles, x_scale=row_scale, weight_scale=weight_scale)


@pytest.mark.parametrize("swap", (False, True), ids=("fp8-first", "fp8-second"))
@pytest.mark.parametrize("rows", (1, 5, 19))
def test_a_paired_launch_gives_each_product_the_bits_of_its_own_launch(rows, swap):
    """An FP8 product (e4m3 rows, a scale per column, a bias; a tl.dot tile: 16-row blocks) and a
    model-dtype one (a GEMV tile: one-row blocks) of one input in one launch: each output equals its own
    `skinny_linear` launch bit for bit, with N not a multiple of either tile and the row blocks of one
    product idle in the other's grid."""
    x, weight = _operands(rows, 72, 96, seed=4)
    q, row_scale = quantize_fp8(x, per_row=True)
    weight_q, _ = quantize_fp8(weight)
    column_scales = torch.rand(72, generator=torch.Generator().manual_seed(5)) + 0.5
    bias = torch.randn(72, generator=torch.Generator().manual_seed(6)).to(torch.float16)
    fp8_product = skinny_linear_triton.SkinnyProduct(
        q, weight_q, Tiles(32, 32, 4, 3, "dot"), row_scale, column_scales, bias, torch.float16
    )
    _, small = _operands(rows, 24, 96, seed=7)
    plain = skinny_linear_triton.SkinnyProduct(x.half(), small.half(), Tiles(16, 64, 4, 2, "gemv"))
    pair = (plain, fp8_product) if swap else (fp8_product, plain)
    outs = skinny_linear_triton.skinny_linear_pair(*pair)
    for product, out in zip(pair, outs, strict=True):
        alone = skinny_linear(
            product.x, product.weight, product.tiles, x_scale=product.x_scale,
            weight_scale=product.weight_scale, bias=product.bias, out_dtype=product.out_dtype,
        )  # fmt: skip
        assert out.shape == alone.shape and torch.equal(out, alone)


@pytest.mark.parametrize("tiles", SPLIT, ids=lambda t: t.mma)
def test_split_k_adds_its_slices_fp32_sums_in_slice_order(tiles):
    """Each slice's sums are those of a launch over its K columns alone, and the sum kernel adds them in
    slice order: in fp32 (no rounding after the sum), the split result is exactly that sum."""
    x, weight = _operands(5, 72, 100, seed=9)
    span = 64  # two K tiles of 32 a slice
    unsplit = Tiles(*tiles[:5])
    slices = [skinny_linear(x[:, k : k + span], weight[:, k : k + span], unsplit) for k in (0, span)]
    assert torch.equal(skinny_linear(x, weight, tiles), slices[0] + slices[1])
    # The unsplit launch sums the four tiles in one chain: another fp32 order, other last bits.
    assert not torch.equal(skinny_linear(x, weight, unsplit), slices[0] + slices[1])


def test_a_pair_takes_one_warp_count_and_rows_of_one_shape():
    x, weight = _operands(3, 32, 64, seed=8)
    first = skinny_linear_triton.SkinnyProduct(x, weight, Tiles(16, 64, 4, 2, "gemv"))
    with pytest.raises(ValueError, match="one warp count"):
        skinny_linear_triton.skinny_linear_pair(first, first._replace(tiles=Tiles(16, 64, 2, 2, "gemv")))
    with pytest.raises(ValueError, match="rows of one shape"):
        skinny_linear_triton.skinny_linear_pair(first, first._replace(x=x[:2]))
    assert skinny_linear_triton.pairable(Tiles(32, 256, 4, 4, "dot"), Tiles(8, 512, 4, 2, "gemv"))
    # Split K is a launch of its own (the slices, then their sum kernel).
    assert not skinny_linear_triton.pairable(
        Tiles(32, 256, 4, 4, "dot"), Tiles(8, 512, 4, 2, "gemv", split_k=2)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_model_dtype_rows_with_fp8_weights_are_refused(dtype):
    """FP8 rows come quantized, once per input: the kernel has no quantization of its own (done in each of
    its column programs, it made the H200's decode step slower)."""
    x, weight = _operands(3, 32, 64, seed=8)
    x = x.to(dtype)
    q, row_scale = quantize_fp8(x, per_row=True)
    weight_q, weight_scale = quantize_fp8(weight)
    assert not skinny_linear_triton.supports(x, weight_q)
    assert skinny_linear_triton.supports(q, weight_q)
    for x_scale in (None, row_scale):
        with pytest.raises(ValueError, match="e4m3 rows"):
            skinny_linear(x, weight_q, MODES[0], x_scale=x_scale, weight_scale=weight_scale, out_dtype=dtype)


def test_fp8_swapped_tiles_are_refused_and_zero_rows_give_an_empty_result():
    x, weight = _operands(2, 32, 64, seed=4)
    q, row_scale = quantize_fp8(x, per_row=True)
    weight_q, weight_scale = quantize_fp8(weight)
    with pytest.raises(ValueError, match="swapped"):
        skinny_linear(q, weight_q, MODES[2], x_scale=row_scale, weight_scale=weight_scale, out_dtype=x.dtype)
    assert skinny_linear(x[:0], weight, MODES[0]).shape == (0, 32)


def test_supports_decode_rows_of_one_dtype_with_unit_strides():
    x, weight = _operands(MAX_ROWS, 16, 64, seed=5)
    assert skinny_linear_triton.supports(x, weight)
    assert not skinny_linear_triton.supports(torch.cat([x, x[:1]]), weight)  # a prefill chunk: cuBLAS
    assert not skinny_linear_triton.supports(x.half(), weight)
    assert not skinny_linear_triton.supports(x.t().contiguous().t(), weight)
    assert not skinny_linear_triton.supports(x[None], weight)


@pytest.fixture
def tuned_dir(tmp_path, monkeypatch):
    """An empty tuned-file directory in place of the package's, its cache cleared before and after."""
    monkeypatch.setattr(skinny_tiles, "CONFIG_DIR", tmp_path)
    skinny_tiles.tuned_tile.cache_clear()
    yield tmp_path
    skinny_tiles.tuned_tile.cache_clear()


def test_a_shape_runs_the_kernel_only_with_its_tuned_file(tuned_dir):
    shape = skinny_tiles.LinearShape(12288, 2048, "fp8")
    assert skinny_tiles.tuned_tile("NVIDIA H200", shape) is None
    path = skinny_tiles.config_path("NVIDIA H200", shape)
    assert path == tuned_dir / "NVIDIA_H200_N12288_K2048_fp8.json"
    path.write_text(json.dumps({"tiles": [64, 128, 4, 3, "gemv"], "us_per_call": {"1": 5.0}}))
    skinny_tiles.tuned_tile.cache_clear()
    assert skinny_tiles.tuned_tile("NVIDIA H200", shape) == Tiles(64, 128, 4, 3, "gemv")
    assert skinny_tiles.linear_shape(torch.empty(8, 4, dtype=torch.bfloat16)) == (8, 4, "bfloat16")
    # Off CUDA nothing is looked up: cuBLAS's place is taken by F.linear and the references.
    x, weight = _operands(2, 8, 16, seed=6)
    assert skinny_tiles.tile_for(x, weight) is None
    assert torch.equal(skinny_tiles.product(x, weight), F.linear(x, weight))


def test_untuned_model_dtype_products_take_the_invariant_gemv_at_decode_sizes():
    """Without a tuned tile a model-dtype product runs INVARIANT_GEMV where the kernel takes its rows (on
    CUDA: `product_tile`), never cuBLAS, whose row sums depend on M; FP8 weights and long chunks do not."""
    weight = torch.randn(40, 64, dtype=torch.bfloat16)
    rows = torch.randn(MAX_ROWS + 1, 64, dtype=torch.bfloat16)
    assert skinny_tiles.untuned_product_tile(rows[:1], weight) == skinny_tiles.INVARIANT_GEMV
    assert skinny_tiles.untuned_product_tile(rows[:MAX_ROWS], weight) == skinny_tiles.INVARIANT_GEMV
    assert skinny_tiles.untuned_product_tile(rows, weight) is None  # a long chunk: cuBLAS
    fp8_weight, _ = quantize_fp8(weight.float())
    assert skinny_tiles.untuned_product_tile(rows[:1], fp8_weight) is None  # Fp8Linear keeps cuBLAS
    assert skinny_tiles.product_tile(rows[:1], weight) is None  # off CUDA: F.linear


@pytest.fixture
def every_shape_tuned(monkeypatch):
    """`tile_for` as if the device had a tuned file for every shape the kernel takes (CPU tensors too)."""
    calls = []

    def tile_for(x, weight):
        calls.append(tuple(weight.shape))
        return MODES[0] if skinny_linear_triton.supports(x, weight) else None

    monkeypatch.setattr(skinny_tiles, "tile_for", tile_for)
    return calls


def test_fp8_linear_router_and_in_proj_ba_take_the_kernel_where_a_tile_is_tuned(every_shape_tuned):
    layer = Fp8Linear(64, 32, bias=True, bias_dtype=torch.float32)
    source = torch.randn(32, 64) / 8
    q_weight, weight_scale = quantize_fp8(source)
    layer.weight.data, layer.weight_scale = q_weight, weight_scale
    layer.bias.data = torch.randn(32)
    x = torch.randn(5, 64)
    q, row_scale = quantize_fp8(x, per_row=True)
    reference = fp8_linear_quantized_reference(q, row_scale, q_weight, weight_scale, layer.bias, x.dtype)
    out = fp8_linear_quantized(q, row_scale, q_weight, weight_scale, layer.bias, x.dtype)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    assert every_shape_tuned == [(32, 64)]

    plain = nn.Linear(64, 24, bias=False)
    torch.testing.assert_close(skinny_tiles.linear_forward(plain, x), plain(x), rtol=1e-5, atol=1e-5)
    biased = nn.Linear(64, 24)
    assert torch.equal(skinny_tiles.linear_forward(biased, x), biased(x))  # not a plain product: as is
    assert every_shape_tuned == [(32, 64), (24, 64)]


def test_the_tuner_lists_a_model_s_decode_shapes_and_needs_a_gpu():
    shapes = skinny_tune.model_shapes("preset:qwen3-next-tiny", "fp8")
    dtypes = {shape.dtype for shape in shapes}
    assert dtypes == {"fp8", "bfloat16"} and len(set(shapes)) == len(shapes)
    # The router (4 experts and the stacked shared gate's row, hidden 64) and in_proj_ba (2 x 4 value
    # heads) in the model dtype.
    assert {(5, 64, "bfloat16"), (8, 64, "bfloat16")} <= set(shapes)
    # Gated attention's q/k/v as the one weight CUDA serving merges them into (q with its gate 128, k and v
    # 32 each): the tuner times the group's own shape.
    assert (192, 64, "fp8") in set(shapes)
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            skinny_tune.main(["--model", "preset:qwen3-next-tiny"])


def test_the_tuner_takes_chosen_shapes_of_the_model_and_names_a_bad_one():
    shapes = skinny_tune.model_shapes("preset:qwen3-next-tiny", "fp8")
    assert skinny_tune.chosen_shapes("192x64, 5x64", shapes) == {(192, 64), (5, 64)}
    with pytest.raises(ValueError, match="7x7 is not a shape of this model"):
        skinny_tune.chosen_shapes("192x64,7x7", shapes)
    with pytest.raises(ValueError, match="'192-64' is not NxK"):
        skinny_tune.chosen_shapes("192-64", shapes)


@pytest.fixture
def skinny_calls(monkeypatch, every_shape_tuned):
    """Each skinny kernel call's operands, with every shape tuned. Off CUDA `Fp8Linear.forward_quantized`
    takes the reference; here its CPU branch runs the CUDA branch's op, `fp8_linear_quantized`, which
    sends a tuned shape to the kernel (in Triton's interpreter)."""
    calls = []

    def spy(x, weight, tiles, **kwargs):
        calls.append({"x": x, "weight": weight, "tiles": tiles, **kwargs})
        return skinny_linear(x, weight, tiles, **kwargs)

    monkeypatch.setattr(skinny_linear_triton, "skinny_linear", spy)
    monkeypatch.setattr(linear_fp8, "fp8_linear_quantized_reference", fp8_linear_quantized)
    return calls


def _fp8_layer(inputs: int, outputs: int, seed: int, bias: bool = False) -> Fp8Linear:
    generator = torch.Generator().manual_seed(seed)
    layer = Fp8Linear(inputs, outputs, bias=bias, bias_dtype=torch.float32)
    layer.weight.data, layer.weight_scale = quantize_fp8(
        torch.randn(outputs, inputs, generator=generator) / 8
    )
    if bias:
        layer.bias.data = torch.randn(outputs, generator=generator)
    return layer


def test_fp8_linear_runs_the_tuned_kernel_on_rows_quantized_before_it(skinny_calls, every_shape_tuned):
    """The op the tuner times (bench/skinny_tune.py: e4m3 rows, their x_scale, the weight's scale) is the
    op the layer runs at a tuned shape, with the reference's values."""
    layer = _fp8_layer(64, 32, seed=9, bias=True)
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(10))
    out = layer(x)
    q, row_scale = quantize_fp8(x.reshape(-1, 64), per_row=True)  # the tuner's `random_rows`
    assert every_shape_tuned == [(32, 64)] and len(skinny_calls) == 1
    call = skinny_calls[0]
    assert call["x"].dtype == FP8_DTYPE and torch.equal(call["x"].float(), q.float())
    assert torch.equal(call["x_scale"], row_scale) and call["weight_scale"] is layer.weight_scale
    assert call["tiles"] == MODES[0] and call["out_dtype"] == x.dtype
    reference = fp8_linear_quantized_reference(
        q, row_scale, layer.weight, layer.weight_scale, layer.bias, x.dtype
    )
    assert out.shape == (2, 3, 32)
    torch.testing.assert_close(out.reshape(-1, 32), reference, rtol=1e-5, atol=1e-5)


def test_layers_of_one_input_quantize_it_once_for_their_tuned_kernels(
    skinny_calls, every_shape_tuned, monkeypatch
):
    layers = [_fp8_layer(64, n, seed=n) for n in (32, 16)]
    quantized = []

    def quantize(x, per_row=False):
        quantized.append(x.shape)
        return quantize_fp8(x, per_row)

    monkeypatch.setattr(fp8, "quantize_fp8", quantize)  # where `rows_quantized` quantizes
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(11))
    outs = linear_fp8.linears_of_one_input(x, layers)
    assert quantized == [(6, 64)]  # one quantization for both layers
    assert every_shape_tuned == [(32, 64), (16, 64)] and len(skinny_calls) == 2
    q, row_scale = quantize_fp8(x.reshape(-1, 64), per_row=True)
    assert skinny_calls[0]["x"] is skinny_calls[1]["x"] and skinny_calls[0]["x"].dtype == FP8_DTYPE
    for layer, out, call in zip(layers, outs, skinny_calls, strict=True):
        assert torch.equal(call["x_scale"], row_scale)
        reference = fp8_linear_quantized_reference(
            q, row_scale, layer.weight, layer.weight_scale, None, x.dtype
        )
        assert out.shape == (2, 3, layer.out_features)
        torch.testing.assert_close(out.reshape(-1, layer.out_features), reference, rtol=1e-5, atol=1e-5)
