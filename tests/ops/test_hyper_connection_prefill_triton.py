"""The hyper-connection mix's prefill path (`HyperConnection.mix_tiled`, its up half in
ops/hyper_connection_prefill_triton.py) against the eager `mix_reference`: the same values up to the
GEMMs' summation order, and the kernel's result for a token row the same bits alone as in any batch. On
the CPU the kernel runs in Triton's interpreter (fp32 and fp16, small shapes), on a GPU at the real shape
in bf16, where `mix` dispatches to it past the decode kernels' MAX_TOKENS."""

from __future__ import annotations

import pytest
import torch

from morion.layers.hyper_connection import HyperConnection
from morion.ops import hyper_connection_prefill_triton as tiled
from morion.ops import hyper_connection_triton
from morion.ops.moe_tune import capture_graph
from tests.ops.test_hyper_connection_triton import (
    DEVICE,
    DTYPES,
    REAL_SHAPE,
    SMALL_SHAPES,
    TOLERANCE,
    assert_same_mix,
    random_mix,
    random_streams,
)


def up_mix_inputs(module: HyperConnection, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernel takes: act = silu(W_down(normed) / n), normed."""
    normed = module.hc_norm(streams)
    return torch.nn.functional.silu(module.input_mix_weight_down(normed) / module.hc_count), normed


def assert_kernel_rows_invariant(module: HyperConnection, streams: torch.Tensor, prefixes) -> None:
    """The kernel gives every row of a prefix, and of the batch reversed, the bits it gives in the batch."""
    act, normed = up_mix_inputs(module, streams)
    up = module.input_mix_weight_up.weight
    whole = tiled.up_mix(act, up, normed, module.hc_count)
    for rows in prefixes:
        assert torch.equal(tiled.up_mix(act[:rows], up, normed[:rows], module.hc_count), whole[:rows]), rows
    flipped = tiled.up_mix(act.flip(0), up, normed.flip(0), module.hc_count)
    assert torch.equal(flipped, whole.flip(0))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SMALL_SHAPES)
def test_matches_the_eager_mix(shape, dtype):
    module = random_mix(shape, dtype)
    streams = random_streams(module, 70, dtype)  # two token blocks, the second one partial
    out = module.mix_tiled(streams)
    assert out[0].shape == (70, shape[0]) and out[0].dtype == dtype
    assert_same_mix(out, module.mix_reference(streams), TOLERANCE[dtype])


def test_a_row_is_the_same_alone_and_anywhere_in_a_batch():
    module = random_mix(SMALL_SHAPES[1], torch.float32)
    assert_kernel_rows_invariant(module, random_streams(module, 80, torch.float32), prefixes=(1, 65))


def test_no_tokens_and_what_falls_back():
    module = random_mix(SMALL_SHAPES[0], torch.float32)
    mixed, weights = module.mix_tiled(random_streams(module, 0, torch.float32))
    assert mixed.shape == (0, 64) and weights.shape == (0, 4)
    streams = random_streams(module, 3, torch.float32)
    act, normed = up_mix_inputs(module, streams)
    up = module.input_mix_weight_up.weight
    assert tiled.supports(act, up, normed, 4)
    assert not tiled.supports(act.half(), up, normed, 4)  # operands of different dtypes
    assert not tiled.supports(act, up, normed.t().contiguous().t(), 4)  # strided width
    assert not tiled.supports(act[:, :-1], up, normed, 4)  # not W_up's R
    # What the kernel refuses, the eager code computes (the same bits as mix_reference).
    module.input_mix_weight_up.weight.data = up.t().contiguous().t()
    for got, want in zip(module.mix_tiled(streams), module.mix_reference(streams), strict=True):
        assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [REAL_SHAPE, (2560, 4, 320, False)])
def test_real_shape_in_bf16_within_an_ulp_and_batch_invariant(shape):
    module = random_mix(shape, torch.bfloat16)
    streams = random_streams(module, 1000, torch.bfloat16)
    out = module.mix(streams)  # the dispatch: CUDA, T > MAX_TOKENS
    assert streams.shape[0] > hyper_connection_triton.MAX_TOKENS
    assert_same_mix(out, module.mix_reference(streams), TOLERANCE[torch.bfloat16])
    for part, full in zip(module.mix_tiled(streams), out, strict=True):
        assert part is None or torch.equal(part, full)
    assert_kernel_rows_invariant(module, streams, prefixes=(65, 128, 129, 999))


@pytest.mark.gpu
def test_a_cuda_graph_replays_the_prefill_mix_with_new_streams():
    module = random_mix(REAL_SHAPE, torch.bfloat16)
    static = random_streams(module, 300, torch.bfloat16)
    outputs: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    graph = capture_graph(lambda: outputs.append(module.mix(static)))
    for seed in (2, 3):
        streams = random_streams(module, 300, torch.bfloat16, seed)
        static.copy_(streams)
        graph.replay()
        torch.cuda.synchronize()
        for replayed, eager in zip(outputs[-1], module.mix_tiled(streams), strict=True):
            assert torch.equal(replayed, eager)


def test_the_dispatch_off_cuda_is_the_eager_code():
    if DEVICE != "cpu":
        pytest.skip("off CUDA only")
    module = random_mix(SMALL_SHAPES[0], torch.float32)
    streams = random_streams(module, 70, torch.float32)
    for got, want in zip(module.mix(streams), module.mix_reference(streams), strict=True):
        assert torch.equal(got, want)
