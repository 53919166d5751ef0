"""The fused Triton MoE kernels for small token counts against the per-expert reference loop, with tiny
shapes: fp32 and fp16 experts (the interpreter has no bf16: the GPU test covers it), FP8 experts with
per-(expert, row) scales, tokens sharing experts, an expert with more pairs than one row tile. On the CPU
they run in Triton's interpreter, compiled on a GPU. Real shapes and timings: test_moe_decode_triton_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

from morion.ops.fp8 import QuantizedRows, quantize_fp8
from morion.ops.moe import moe_experts_reference
from morion.ops.moe_decode_triton import MAX_PAIRS, moe_expert_partials, moe_experts_triton
from morion.ops.moe_tiles import Tiles

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = 8, 64, 64, 2


pytestmark = pytest.mark.usefixtures("exact_e4m3_casts_in_the_interpreter")


def make_case(tokens: int, dtype: torch.dtype, seed: int = 0):
    """Random experts and a top-k routing: k distinct experts per token, in random order. With 8 experts
    and top-2, three or more tokens always share some expert."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, HIDDEN, generator=gen).to(dtype)
    gate_up = (torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=gen) * HIDDEN**-0.5).to(dtype)
    down = (torch.randn(EXPERTS, HIDDEN, INTERMEDIATE, generator=gen) * INTERMEDIATE**-0.5).to(dtype)
    topk_ids = torch.rand(tokens, EXPERTS, generator=gen).argsort(dim=-1)[:, :TOP_K]
    topk_weights = torch.softmax(torch.randn(tokens, TOP_K, generator=gen), dim=-1).to(dtype)
    return hidden, gate_up, down, topk_weights, topk_ids


def fp8_experts(gate_up: torch.Tensor, down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    gate_up_q, gate_up_scale = quantize_fp8(gate_up, per_row=True)
    down_q, down_scale = quantize_fp8(down, per_row=True)
    return gate_up_q, down_q, dict(gate_up_scale=gate_up_scale, down_scale=down_scale)


def on_device(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(DEVICE) for t in tensors]


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.cpu().float(), expected.cpu().float()
    return ((actual - expected).norm() / expected.norm()).item()


# (gate_up, down) tiles: the down kernel in one pass and in two (FP8 tl.dot needs K >= 32 on the GPU: a
# 32-column BLOCK_K takes two passes over I = 64), and both kernels with swapped MMA operands (unquantized
# weights only: `exact_mma`) and as GEMVs.
TILE_CASES = {
    "one-pass": (None, Tiles(32, 64, 4, 1)),
    "two-pass": (None, Tiles(32, 32, 4, 2)),
    "swapped": (Tiles(64, 32, 4, 3, "swapped"), Tiles(64, 32, 4, 2, "swapped")),
    "swapped-one-pass": (Tiles(64, 32, 4, 3, "swapped"), Tiles(64, 64, 4, 1, "swapped")),
    "gemv": (Tiles(32, 32, 4, 3, "gemv"), Tiles(32, 32, 4, 2, "gemv")),
    "gemv-one-pass": (Tiles(32, 32, 4, 3, "gemv"), Tiles(32, 64, 4, 1, "gemv")),
    "gemv-one-pass-narrow": (Tiles(16, 32, 4, 3, "gemv"), Tiles(16, 64, 4, 1, "gemv")),
}


FP8_TILE_CASES = {name: tiles for name, tiles in TILE_CASES.items() if not name.startswith("swapped")}


@pytest.mark.parametrize("tokens", (1, 3, 8))
@pytest.mark.parametrize("tiles", ("default", "swapped-one-pass", "gemv"))
def test_fp32_equals_reference(tokens, tiles):
    case = make_case(tokens, torch.float32, seed=tokens)
    options = (
        {}
        if tiles == "default"
        else dict(zip(("gate_up_tiles", "down_tiles"), TILE_CASES[tiles], strict=True))
    )
    out = moe_experts_triton(*on_device(*case), **options)
    assert out.dtype == torch.float32 and out.shape == (tokens, HIDDEN)
    # Only the summation order differs (measured <= 6e-7 on outputs of magnitude ~1).
    torch.testing.assert_close(out.cpu(), moe_experts_reference(*case), atol=1e-5, rtol=0)


@pytest.mark.parametrize("tokens", (1, 3, 8))
def test_fp16_close_to_reference(tokens):
    case = make_case(tokens, torch.float16, seed=tokens)
    out = moe_experts_triton(*on_device(*case))
    exact = moe_experts_reference(*(t.float() if t.is_floating_point() else t for t in case))
    assert out.dtype == torch.float16
    # The reference rounds to fp16 after each op and adds the k outputs in fp16; the kernels round the
    # SwiGLU output once and add in fp32. Both are a few fp16 roundings (2^-11) from the fp32 result
    # (measured: kernels 2.4e-4 to 2.9e-4, reference 5e-4 to 6e-4, one from the other up to 7e-4).
    assert rel_l2(out, exact) < 3e-3
    assert rel_l2(out, moe_experts_reference(*case)) < 3e-3


@pytest.mark.parametrize("tokens", (1, 3, 8))
@pytest.mark.parametrize(("gate_up_tiles", "down_tiles"), FP8_TILE_CASES.values(), ids=FP8_TILE_CASES.keys())
def test_fp8_equals_fp8_reference(tokens, gate_up_tiles, down_tiles):
    hidden, gate_up, down, weights, ids = make_case(tokens, torch.float32, seed=10 + tokens)
    gate_up_q, down_q, scales = fp8_experts(gate_up, down)
    args = on_device(hidden, gate_up_q, down_q, weights, ids)
    device_scales = {k: v.to(DEVICE) for k, v in scales.items()}
    out = moe_experts_triton(*args, **device_scales, gate_up_tiles=gate_up_tiles, down_tiles=down_tiles).cpu()
    expected = moe_experts_reference(hidden, gate_up_q, down_q, weights, ids, **scales)
    # The same quantized math in fp32 (both quantize the token rows and the SwiGLU rows per row, and
    # weight the expert outputs after the down projection); only summation orders differ, which can
    # move a SwiGLU value across an e4m3 rounding boundary: hence 1e-3 (measured <= 2.5e-7 here).
    assert rel_l2(out, expected) < 1e-3
    # Against the unquantized experts: four e4m3-rounded operands (measured 5.5% to 9.4% at these few
    # values; 4-6% on larger cases).
    assert rel_l2(out, moe_experts_reference(hidden, gate_up, down, weights, ids)) < 0.15


def test_fp8_token_rows_given_quantized_are_read_as_they_are():
    """`quantized` (the token rows quantized by the norm before, Qwen3-Next's decoder layer) replaces the
    kernels' own quantization of them: the same bits."""
    hidden, gate_up, down, weights, ids = make_case(3, torch.float32, seed=13)
    gate_up_q, down_q, scales = fp8_experts(gate_up, down)
    args = on_device(hidden, gate_up_q, down_q, weights, ids)
    device_scales = {k: v.to(DEVICE) for k, v in scales.items()}
    quantized = QuantizedRows(*quantize_fp8(args[0], per_row=True))
    expected = moe_experts_triton(*args, **device_scales)
    assert torch.equal(moe_experts_triton(*args, **device_scales, quantized=quantized), expected)


def test_swapped_operands_are_refused_with_fp8_weights():
    """FP8 wgmma with swapped operands sums K in a reduced-precision accumulator on Hopper (1e-2 from the
    reference on the H200, where the other modes are at 4e-7): such a tile is an error, not a slow path."""
    hidden, gate_up, down, weights, ids = make_case(2, torch.float32, seed=3)
    gate_up_q, down_q, scales = fp8_experts(gate_up, down)
    args = on_device(hidden, gate_up_q, down_q, weights, ids)
    scales = {k: v.to(DEVICE) for k, v in scales.items()}
    for gate_up_tiles, down_tiles in (TILE_CASES["swapped"], (None, TILE_CASES["swapped"][1])):
        with pytest.raises(ValueError, match="swapped operands lose precision with FP8"):
            moe_experts_triton(*args, **scales, gate_up_tiles=gate_up_tiles, down_tiles=down_tiles)


def test_an_expert_with_more_pairs_than_a_row_tile():
    """20 tokens all route their first slot to expert 3: its leader runs two 16-row tiles."""
    hidden, gate_up, down, weights, ids = make_case(20, torch.float32, seed=4)
    ids[:, 0] = 3
    ids[:, 1] = torch.where(ids[:, 1] == 3, 5, ids[:, 1])  # still k distinct experts per token
    out = moe_experts_triton(*on_device(hidden, gate_up, down, weights, ids))
    expected = moe_experts_reference(hidden, gate_up, down, weights, ids)
    torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ("fp32", "fp8"))
def test_gemv_tiles_compute_an_expert_every_token_chose_one_pair_a_program(kind):
    """The last slot of all 12 tokens is expert 7, as a shared expert stacked after the routed ones: GEMV
    tiles compute its rows in programs of their own, each row as the token alone computes it (bit for
    bit), all within rounding of the reference."""
    hidden, gate_up, down, weights, ids = make_case(12, torch.float32, seed=11)
    ids[:, 0] = torch.arange(12) % 7  # routed: experts 0..6, some chosen twice
    ids[:, 1] = 7
    options = {}
    if kind == "fp8":
        gate_up, down, options = fp8_experts(gate_up, down)
        tiles = FP8_TILE_CASES["gemv"]
    else:
        tiles = TILE_CASES["gemv"]
    expected = moe_experts_reference(hidden, gate_up, down, weights, ids, **options)
    hidden, gate_up, down, weights, ids = on_device(hidden, gate_up, down, weights, ids)
    options = {k: v.to(DEVICE) for k, v in options.items()}
    options.update(gate_up_tiles=tiles[0], down_tiles=tiles[1])
    batched = moe_experts_triton(hidden, gate_up, down, weights, ids, **options)
    assert rel_l2(batched, expected) < (1e-3 if kind == "fp8" else 1e-5)
    for t in (0, 11):
        alone = moe_experts_triton(
            hidden[t : t + 1], gate_up, down, weights[t : t + 1], ids[t : t + 1], **options
        )
        assert torch.equal(alone[0], batched[t])


@pytest.mark.parametrize("tiles", ("default", "swapped", "gemv"))
@pytest.mark.parametrize("kind", ("fp32", "fp8"))
def test_a_token_result_does_not_depend_on_the_batch(kind, tiles):
    """Each token alone gives bit for bit its row of the batched call (shared experts included)."""
    hidden, gate_up, down, weights, ids = make_case(8, torch.float32, seed=7)
    options = {}
    if kind == "fp8":
        gate_up, down, options = fp8_experts(gate_up, down)
    hidden, gate_up, down, weights, ids = on_device(hidden, gate_up, down, weights, ids)
    options = {k: v.to(DEVICE) for k, v in options.items()}
    if tiles != "default":
        cases = FP8_TILE_CASES if kind == "fp8" else TILE_CASES
        if tiles not in cases:
            pytest.skip(f"{tiles} tiles are refused with FP8 weights")
        options.update(zip(("gate_up_tiles", "down_tiles"), cases[tiles], strict=True))
    batched = moe_experts_triton(hidden, gate_up, down, weights, ids, **options)
    for t in (0, 5):
        alone = moe_experts_triton(
            hidden[t : t + 1], gate_up, down, weights[t : t + 1], ids[t : t + 1], **options
        )
        assert torch.equal(alone[0], batched[t])


# "gemv_acc" (products kept per (K position, column) across K tiles, summed over K once): the down kernel
# in two passes and in one.
GEMV_ACC_TILES = {
    "gemv_acc-two-pass": (Tiles(32, 32, 4, 3, "gemv_acc"), Tiles(32, 32, 4, 2, "gemv_acc")),
    "gemv_acc-one-pass": (Tiles(32, 32, 4, 3, "gemv_acc"), Tiles(32, 64, 4, 1, "gemv_acc")),
}
# Split K (ops/moe_split_k.py): K in slices of whole BLOCK_K tiles, a program each, their fp32 partials
# added in slice order by a sum kernel that applies the epilogue (the FP8 act rows' scales from that
# kernel's column blocks). H = I = 64: gate_up's two 32-column K tiles in 2 slices, or 3 (the third past
# K: empty); down's four 16-column ones in 2 or 4.
SPLIT_K_TILES = {
    "split-dot-2-gemv-4": (Tiles(32, 32, 4, 3, "dot", split_k=2), Tiles(32, 16, 4, 2, "gemv", split_k=4)),
    "split-gemv_acc-3-dot-2": (
        Tiles(16, 32, 4, 3, "gemv_acc", split_k=3),
        Tiles(32, 32, 4, 2, "dot", split_k=2),
    ),
    "split-gate_up-only": (Tiles(32, 16, 4, 3, "gemv", split_k=4), Tiles(32, 64, 4, 1, "gemv")),
    "split-down-only": (Tiles(32, 32, 4, 3, "gemv"), Tiles(64, 16, 4, 2, "gemv_acc", split_k=2)),
}
# (tokens, tiles): shared experts from T = 4 on (8 experts, top-2).
REFERENCE_CASES = {
    "gemv_acc-one-pass-1": (1, GEMV_ACC_TILES["gemv_acc-one-pass"]),
    "gemv_acc-two-pass-4": (4, GEMV_ACC_TILES["gemv_acc-two-pass"]),
    "gemv_acc-one-pass-16": (16, GEMV_ACC_TILES["gemv_acc-one-pass"]),
    **{f"{name}-{tokens}": (tokens, tiles) for name, tiles in SPLIT_K_TILES.items() for tokens in (1, 5)},
}


@pytest.mark.parametrize(("tokens", "tiles"), REFERENCE_CASES.values(), ids=REFERENCE_CASES.keys())
def test_gemv_acc_and_split_k_tiles_equal_the_reference_and_are_batch_invariant(tokens, tiles):
    """FP8 and unquantized (fp32: the interpreter has no bf16) experts against the reference, as the
    other tiles are (only the fp32 summation order differs), and the last token alone its batched row's
    bits (tiles and K slices never depend on the batch)."""
    hidden, gate_up, down, weights, ids = make_case(tokens, torch.float32, seed=20 + tokens)
    gate_up_q, down_q, scales = fp8_experts(gate_up, down)
    options = dict(zip(("gate_up_tiles", "down_tiles"), tiles, strict=True))
    device_scales = {k: v.to(DEVICE) for k, v in scales.items()}
    fp8_args = on_device(hidden, gate_up_q, down_q, weights, ids)
    fp8_out = moe_experts_triton(*fp8_args, **device_scales, **options)
    expected = moe_experts_reference(hidden, gate_up_q, down_q, weights, ids, **scales)
    assert rel_l2(fp8_out, expected) < 1e-3  # as test_fp8_equals_fp8_reference
    out = moe_experts_triton(*on_device(hidden, gate_up, down, weights, ids), **options)
    torch.testing.assert_close(
        out.cpu(), moe_experts_reference(hidden, gate_up, down, weights, ids), atol=1e-5, rtol=0
    )
    t = tokens - 1
    alone_args = on_device(hidden[t:], gate_up_q, down_q, weights[t:], ids[t:])
    assert torch.equal(moe_experts_triton(*alone_args, **device_scales, **options)[0], fp8_out[t])


def test_split_k_is_refused_where_there_is_nothing_to_split_or_no_decode_kernel():
    case = on_device(*make_case(2, torch.float32))
    with pytest.raises(ValueError, match="one-pass tile"):
        moe_experts_triton(*case, down_tiles=Tiles(32, 64, 4, 1, "gemv", split_k=2))
    with pytest.raises(ValueError, match="grouped kernels take split_k = 1"):
        moe_experts_triton(*case, grouped=True, gate_up_tiles=Tiles(32, 32, 4, 2, split_k=2))
    with pytest.raises(ValueError, match="split_k must be at least 1"):
        moe_experts_triton(*case, gate_up_tiles=Tiles(32, 32, 4, 2, split_k=0))


def test_gemv_acc_is_the_moe_decode_kernels_own():
    """The skinny linear and NVFP4 kernels share the MMA helpers but not this mode."""
    from morion.ops.moe_decode_triton import _mma_options

    with pytest.raises(ValueError, match="unknown MoE tile mma 'gemv_acc'"):
        _mma_options(Tiles(32, 32, 4, 2, "gemv_acc"), fp8=True)


def test_no_tokens_and_too_many_pairs():
    hidden, gate_up, down, weights, ids = make_case(0, torch.float32)
    assert moe_experts_triton(hidden, gate_up, down, weights, ids).shape == (0, HIDDEN)
    many = MAX_PAIRS // TOP_K + 1
    with pytest.raises(ValueError, match="pairs"):
        moe_experts_triton(
            torch.zeros(many, HIDDEN), gate_up, down, torch.zeros(many, TOP_K), torch.zeros(many, TOP_K)
        )


def test_an_unknown_mma_mode_is_refused():
    case = on_device(*make_case(2, torch.float32))
    with pytest.raises(ValueError, match="unknown MoE tile mma 'wgmma'"):
        moe_experts_triton(*case, gate_up_tiles=Tiles(32, 32, 4, 2, "wgmma"))


# Past MAX_PAIRS (prefill): 600 tokens x top-2, tiles of 64 rows of one expert (~150 pairs an expert).
GROUPED_TOKENS = (5, 600)


@pytest.mark.parametrize("tokens", GROUPED_TOKENS)
def test_the_grouped_mode_equals_the_reference_past_the_fused_kernels_pairs(tokens):
    """The fused kernels' grouped mode (`--moe-kernel triton` past MAX_PAIRS): fp32 experts against the
    reference loop (only summation orders differ), and FP8 experts against the FP8 reference."""
    case = make_case(tokens, torch.float32, seed=30 + tokens)
    out = moe_experts_triton(*on_device(*case), grouped=True)
    torch.testing.assert_close(out.cpu(), moe_experts_reference(*case), atol=1e-5, rtol=0)
    hidden, gate_up, down, weights, ids = case
    gate_up_q, down_q, scales = fp8_experts(gate_up, down)
    device_scales = {k: v.to(DEVICE) for k, v in scales.items()}
    out = moe_experts_triton(
        *on_device(hidden, gate_up_q, down_q, weights, ids), **device_scales, grouped=True
    )
    expected = moe_experts_reference(hidden, gate_up_q, down_q, weights, ids, **scales)
    assert rel_l2(out, expected) < 1e-3


def test_a_token_result_in_the_grouped_mode_does_not_depend_on_the_batch():
    """A token's slots, bit for bit, alone, in a small batch and among 600 tokens: a tile's rows never mix
    and its shape is fixed, whichever other pairs share the expert's tiles."""
    hidden, gate_up, down, weights, ids = on_device(*make_case(600, torch.float32, seed=41))
    gate_up_q, down_q, scales = fp8_experts(gate_up.cpu(), down.cpu())
    experts = on_device(gate_up_q, down_q)
    options = {k: v.to(DEVICE) for k, v in scales.items()}

    def partials(rows: slice) -> torch.Tensor:
        return moe_expert_partials(
            hidden[rows], *experts, weights[rows], ids[rows], **options, grouped=True
        ).values

    whole = partials(slice(0, 600))
    assert torch.equal(partials(slice(7, 8))[0], whole[7])
    assert torch.equal(partials(slice(0, 9))[7], whole[7])


def test_the_grouped_mode_takes_dot_tiles_only():
    case = on_device(*make_case(3, torch.float32))
    with pytest.raises(ValueError, match=r"tl\.dot tiles"):
        moe_experts_triton(*case, grouped=True, gate_up_tiles=Tiles(32, 32, 4, 2, "gemv"))


@pytest.mark.parametrize("block_m, promote_k", [(16, 128), (32, 0)])
def test_the_grouped_mode_s_rows_and_promotion_keep_the_fp8_reference(block_m, promote_k):
    """Rows a tile and the FP8 promotion interval (the grouped tuner's choices, ops/moe_tune_grouped.py):
    an expert's ~30 pairs spread over tiles of 16 or 32 rows and still equal the FP8 reference (the
    interpreter sums in fp32 whatever the interval; the GPU test measures the tensor core's)."""
    hidden, gate_up, down, weights, ids = make_case(120, torch.float32, seed=50 + block_m)
    gate_up_q, down_q, scales = fp8_experts(gate_up, down)
    out = moe_experts_triton(
        *on_device(hidden, gate_up_q, down_q, weights, ids),
        **{k: v.to(DEVICE) for k, v in scales.items()},
        grouped=True,
        block_m=block_m,
        promote_k=promote_k,
    )
    expected = moe_experts_reference(hidden, gate_up_q, down_q, weights, ids, **scales)
    assert rel_l2(out, expected) < 1e-3


@pytest.mark.parametrize("options", [{"block_m": 24}, {"block_m": 8}, {"promote_k": -1}])
def test_the_grouped_mode_refuses_rows_and_promotions_it_cannot_run(options):
    case = on_device(*make_case(3, torch.float32))
    with pytest.raises(ValueError, match="block_m a power of two"):
        moe_experts_triton(*case, grouped=True, **options)
