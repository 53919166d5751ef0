"""The fused hyper-connection mix (ops/hyper_connection_triton.py) against the eager
`HyperConnection.mix_reference`: the same values up to the GEMVs' summation order, and a token row's
result the same bits alone as in any batch and at any place in it. On the CPU the kernels run in Triton's
interpreter (fp32 and fp16, small shapes: it is slow), on a GPU at the real shape in bf16."""

from __future__ import annotations

import pytest
import torch

from morion.layers.hyper_connection import HyperConnection
from morion.ops import hyper_connection_triton
from morion.ops.hc_tiles import MixTiles
from morion.ops.moe_tune import capture_graph

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6
# The interpreter has no bf16: fp32 and fp16 there, bf16 (the model's dtype) on the GPU.
DTYPES = [torch.bfloat16, torch.float32] if DEVICE == "cuda" else [torch.float32, torch.float16]
# fp32: the GEMVs' summation order only; fp16 and bf16: the roundings that order (or Triton's exp on the
# GPU) may flip, an ulp of the products the mean averages, which can be larger than the mean's own ulp.
TOLERANCE = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 2**-6}
# (hidden H, streams n, low rank R, with inject weights): a layer's mixer; an odd shape as the final mixer.
SMALL_SHAPES = [(64, 4, 24, True), (80, 4, 20, False)]
# Qwen3.8-Flash-Next (models/presets.py): H = 2560, n = 4, R = 320.
REAL_SHAPE = (2560, 4, 320, True)


def random_mix(shape: tuple[int, int, int, bool], dtype: torch.dtype, seed: int = 0) -> HyperConnection:
    """A HyperConnection with random weights (GroupedRMSNorm's weight starts at zeros: drawn too)."""
    hidden, count, lowrank, inject = shape
    generator = torch.Generator().manual_seed(seed)
    module = HyperConnection(hidden, count, lowrank, EPS, inject)
    with torch.no_grad():
        for parameter in module.parameters():
            fan_in = parameter.shape[-1] if parameter.dim() == 2 else 10
            parameter.copy_(torch.randn(parameter.shape, generator=generator) / fan_in**0.5)
    return module.to(DEVICE, dtype).requires_grad_(False)


def random_streams(module: HyperConnection, tokens: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    width = module.hc_count * module.hidden_size
    return (torch.randn(tokens, width, generator=generator) * 3).to(DEVICE, dtype)


def fused(
    module: HyperConnection, streams: torch.Tensor, tiles: MixTiles | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    inject = module.block_inject_weight
    return hyper_connection_triton.mix(
        streams,
        module.hc_norm.weight,
        module.input_mix_weight_down.weight,
        module.input_mix_weight_up.weight,
        None if inject is None else inject.weight,
        module.hc_count,
        EPS,
        tiles,
    )


def assert_same_mix(actual, expected, tolerance: float) -> None:
    torch.testing.assert_close(actual[0], expected[0], rtol=tolerance, atol=tolerance)
    if expected[1] is None:
        assert actual[1] is None
    else:
        torch.testing.assert_close(actual[1], expected[1], rtol=tolerance, atol=tolerance)


def assert_rows_invariant(
    module: HyperConnection, streams: torch.Tensor, prefixes, tiles: MixTiles | None = None
) -> None:
    """Every prefix of the batch, and the batch reversed, give each row the same bits as the batch."""
    whole = fused(module, streams, tiles)
    for rows in prefixes:
        for part, full in zip(fused(module, streams[:rows], tiles), whole, strict=True):
            assert part is None or torch.equal(part, full[:rows]), rows
    for part, full in zip(fused(module, streams.flip(0), tiles), whole, strict=True):
        assert part is None or torch.equal(part, full.flip(0))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SMALL_SHAPES)
def test_matches_the_eager_mix(shape, dtype):
    module = random_mix(shape, dtype)
    streams = random_streams(module, 6, dtype)  # two token blocks, the second one partial
    out = fused(module, streams)
    assert out[0].shape == (6, shape[0]) and out[0].dtype == dtype
    assert_same_mix(out, module.mix_reference(streams), TOLERANCE[dtype])


def test_a_row_is_the_same_alone_and_anywhere_in_a_batch():
    module = random_mix(SMALL_SHAPES[0], torch.float32)
    assert_rows_invariant(module, random_streams(module, 6, torch.float32), prefixes=(1, 5))


# Tiles a tuned file may hold (ops/hc_tune.py's candidates): one row or eight a kernel-1 program, K and R
# steps wider or narrower than the shape, 2 to 8 hidden columns a kernel-2 program, 4 or 8 warps.
OTHER_TILES = [MixTiles(1, 128, 4, 2, 64, 8), MixTiles(8, 16, 8, 8, 8, 4), MixTiles(2, 64, 4, 4, 16, 4)]


@pytest.mark.parametrize("tiles", OTHER_TILES, ids=lambda tiles: "-".join(map(str, tiles)))
@pytest.mark.parametrize("shape", SMALL_SHAPES)
def test_any_tiles_give_the_eager_mix_the_same_in_every_batch(shape, tiles):
    """Another tile sums in another order, nothing else: the eager values, and a row's bits alone as in
    its batch (a tuned file must not break the batch invariance restores rely on)."""
    module = random_mix(shape, torch.float32)
    streams = random_streams(module, 6, torch.float32)
    assert_same_mix(fused(module, streams, tiles), module.mix_reference(streams), TOLERANCE[torch.float32])
    assert_rows_invariant(module, streams, prefixes=(1,), tiles=tiles)


# Pipelined tiles (MixTiles' *_stages > 1, hc_tune's other candidates): loads issued steps ahead, the
# streams' partials summed by straight-line loads; K and R in several steps (3 to 5 here) or R in one. The
# interpreter runs the loops plainly (their pipelining is compiled, tests/ops/test_hopper_compile.py), so
# it checks the variants' sums and masks: n = 3 streams leaves kernel 2's fourth unrolled load masked.
# One tile a shape: the interpreter's seconds go to the sums, which each pair checks in full.
PIPELINED_CASES = [
    (SMALL_SHAPES[0], MixTiles(4, 16, 4, 4, 8, 4, 3, 3)),
    ((80, 3, 20, False), MixTiles(2, 32, 4, 2, 32, 8, 6, 2)),
]


@pytest.mark.parametrize(("shape", "tiles"), PIPELINED_CASES, ids=lambda case: "-".join(map(str, case)))
def test_pipelined_tiles_give_the_eager_mix_the_same_in_every_batch(shape, tiles):
    module = random_mix(shape, torch.float32)
    streams = random_streams(module, 16, torch.float32)
    for tokens in (1, 4, 16):
        expected = module.mix_reference(streams[:tokens])
        assert_same_mix(fused(module, streams[:tokens], tiles), expected, TOLERANCE[torch.float32])
    assert_rows_invariant(module, streams, prefixes=(5,), tiles=tiles)


def test_no_tokens_and_the_dispatch():
    module = random_mix(SMALL_SHAPES[0], torch.float32)
    mixed, weights = fused(module, random_streams(module, 0, torch.float32))
    assert mixed.shape == (0, 64) and weights.shape == (0, 4)
    assert set(module.state_dict()) == {
        "hc_norm.weight",
        "input_mix_weight_down.weight",
        "input_mix_weight_up.weight",
        "block_inject_weight.weight",
    }
    streams = random_streams(module, 3, torch.float32)
    weights = (
        module.hc_norm.weight,
        module.input_mix_weight_down.weight,
        module.input_mix_weight_up.weight,
        module.block_inject_weight.weight,
    )
    assert hyper_connection_triton.supports(streams, *weights, 4)
    too_many = streams.new_zeros(hyper_connection_triton.MAX_TOKENS + 1, streams.shape[1])
    assert not hyper_connection_triton.supports(too_many, *weights, 4)
    assert not hyper_connection_triton.supports(streams.half(), *weights, 4)  # weights of another dtype
    assert not hyper_connection_triton.supports(streams.t().contiguous().t(), *weights, 4)  # strided width
    if DEVICE == "cpu":  # off CUDA, `mix` is the eager code itself
        for got, want in zip(module.mix(streams), module.mix_reference(streams), strict=True):
            assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [REAL_SHAPE, (2560, 4, 320, False)])
def test_real_shape_in_bf16_within_an_ulp_and_batch_invariant(shape):
    module = random_mix(shape, torch.bfloat16)
    streams = random_streams(module, hyper_connection_triton.MAX_TOKENS, torch.bfloat16)
    out = module.mix(streams)  # the dispatch: CUDA, T <= MAX_TOKENS
    reference = module.mix_reference(streams)
    assert_same_mix(out, reference, TOLERANCE[torch.bfloat16])
    for part, full in zip(fused(module, streams), out, strict=True):
        assert part is None or torch.equal(part, full)
    assert_rows_invariant(module, streams, prefixes=(1, 2, 3, 4, 5, 8, 16, 17, 31))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "tiles", [MixTiles(4, 512, 4, 4, 64, 4, 6, 6), MixTiles(2, 1024, 4, 2, 512, 4, 3, 2)], ids=str
)
def test_pipelined_tiles_at_the_real_shape_within_an_ulp_and_batch_invariant(tiles):
    """Compiled with cp.async pipelines (the interpreter runs the loops plainly): the tuner's candidates."""
    module = random_mix(REAL_SHAPE, torch.bfloat16)
    streams = random_streams(module, 16, torch.bfloat16)
    assert_same_mix(fused(module, streams, tiles), module.mix_reference(streams), TOLERANCE[torch.bfloat16])
    assert_rows_invariant(module, streams, prefixes=(1, 4, 5), tiles=tiles)


@pytest.mark.gpu
def test_a_cuda_graph_replays_the_mix_with_new_streams():
    module = random_mix(REAL_SHAPE, torch.bfloat16)
    static = random_streams(module, 8, torch.bfloat16)
    outputs: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    graph = capture_graph(lambda: outputs.append(module.mix(static)))
    for seed in (2, 3):
        streams = random_streams(module, 8, torch.bfloat16, seed)
        static.copy_(streams)
        graph.replay()
        torch.cuda.synchronize()
        for replayed, eager in zip(outputs[-1], fused(module, streams), strict=True):
            assert torch.equal(replayed, eager)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_inject_kernel_gives_the_eager_bits(dtype):
    from morion.layers.hyper_connection import inject_reference

    generator = torch.Generator().manual_seed(5)
    tokens, hidden, count = 5, 80, 4
    streams = torch.randn(tokens, count * hidden, generator=generator).to(DEVICE, dtype)
    block_out = (torch.randn(tokens, hidden, generator=generator) * 3).to(DEVICE, dtype)
    weights = (torch.rand(tokens, count, generator=generator) * 2).to(DEVICE, dtype)
    assert hyper_connection_triton.inject_supports(streams, block_out, weights)
    got = hyper_connection_triton.inject(streams, block_out, weights)
    assert torch.equal(got, inject_reference(streams, block_out, weights))
    assert not hyper_connection_triton.inject_supports(streams, block_out[:, :-1], weights)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "hidden", [80, pytest.param(REAL_SHAPE[0], marks=pytest.mark.gpu)], ids=["small", "flash_next"]
)
def test_the_inject_kernel_adds_moe_slot_partials_as_their_sum_kernel(dtype, hidden):
    """block_out as a MoE block's 11 unsummed fp32 slots (`SlotPartials`): bit for bit the inject of their
    sum by the fused MoE's own sum kernel (the launch this saves), on CPU and GPU."""
    from morion.ops.slot_partials import SlotPartials

    if hidden == REAL_SHAPE[0] and DEVICE == "cpu":
        pytest.skip("needs CUDA (the real shape, in bf16)")
    generator = torch.Generator().manual_seed(6)
    tokens, count = 3, 4
    streams = torch.randn(tokens, count * hidden, generator=generator).to(DEVICE, dtype)
    slots = SlotPartials(torch.randn(tokens, 11, hidden, generator=generator).to(DEVICE), dtype)
    weights = (torch.rand(tokens, count, generator=generator) * 2).to(DEVICE, dtype)
    assert hyper_connection_triton.inject_supports(streams, slots, weights)
    got = hyper_connection_triton.inject(streams, slots, weights)
    assert torch.equal(got, hyper_connection_triton.inject(streams, slots.summed(), weights))
    other_dtype = torch.float16 if dtype != torch.float16 else torch.float32
    assert not hyper_connection_triton.inject_supports(
        streams, SlotPartials(slots.values, other_dtype), weights
    )
    assert not hyper_connection_triton.inject_supports(
        streams, SlotPartials(slots.values[:, :, :-1], dtype), weights
    )
