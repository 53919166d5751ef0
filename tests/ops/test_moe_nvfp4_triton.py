"""The NVFP4 expert kernels (decode and grouped) against dequantize-then-matmul (`moe_experts_reference`
with NVFP4 experts), with tiny shapes in Triton's interpreter on the CPU (compiled on a GPU): every MMA
mode of the decode kernels in both code expansions (`Tiles.expand`: the same bits through an MMA) and
their batch invariance, split K (`Tiles.split_k`: its partials and their sum kernel, batch invariant
too), an expert with more pairs than one row tile on both paths, fp32 and fp16 activations (the
interpreter has no bf16: test_moe_nvfp4_triton_gpu.py covers it), the grouped path's tile table,
tiles' JSON files with and without split_k, and the shipped tiles of Flash-Next's shape. Each nibble,
block scale and global scale enters every output, so a kernel that read any of them wrong is off by
O(1), where these agree to ~1e-6 (fp32) and ~1e-3 (fp16)."""

from __future__ import annotations

import json

import pytest
import torch

from morion.ops import moe_tiles
from morion.ops.moe import moe_experts_reference
from morion.ops.moe_decode_triton import expert_tiles
from morion.ops.moe_nvfp4_triton import moe_experts_nvfp4
from morion.ops.moe_tiles import ExpertShape, Tiles
from morion.ops.nvfp4 import quantize_nvfp4_parts

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HIDDEN, INTERMEDIATE, TOP_K = 64, 32, 2


def nvfp4_experts(num_experts: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random experts quantized as the loader quantizes them: gate and up rows apart."""
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(num_experts, 2 * INTERMEDIATE, HIDDEN, generator=gen) * HIDDEN**-0.5
    down = torch.randn(num_experts, HIDDEN, INTERMEDIATE, generator=gen) * INTERMEDIATE**-0.5
    gate_up, down = quantize_nvfp4_parts(gate_up, 2), quantize_nvfp4_parts(down, 1)
    experts = {
        "gate_up_proj": gate_up.codes,
        "down_proj": down.codes,
        "gate_up_scale": gate_up.block_scales,
        "down_scale": down.block_scales,
        "gate_up_scale_2": gate_up.global_scale,
        "down_scale_2": down.global_scale,
    }
    return {name: tensor.to(DEVICE) for name, tensor in experts.items()}


def routing(tokens: int, num_experts: int, dtype: torch.dtype, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, HIDDEN, generator=gen).to(dtype)
    topk_ids = torch.rand(tokens, num_experts, generator=gen).argsort(dim=-1)[:, :TOP_K]
    topk_weights = torch.softmax(torch.randn(tokens, TOP_K, generator=gen), dim=-1).to(dtype)
    return hidden.to(DEVICE), topk_weights.to(DEVICE), topk_ids.to(DEVICE)


def run(fn, experts: dict[str, torch.Tensor], hidden, topk_weights, topk_ids, **options) -> torch.Tensor:
    codes = experts["gate_up_proj"], experts["down_proj"]
    scales = {k: v for k, v in experts.items() if k.endswith(("scale", "scale_2"))}
    return fn(hidden, *codes, topk_weights, topk_ids, **scales, **options)


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.cpu().float(), expected.cpu().float()
    return ((actual - expected).norm() / expected.norm()).item()


TILES = {
    "dot": {},  # the defaults
    "gemv": dict(gate_up_tiles=Tiles(32, 32, 4, 1, "gemv"), down_tiles=Tiles(32, 32, 4, 1, "gemv")),
    "swapped": dict(gate_up_tiles=Tiles(64, 32, 4, 1, "swapped"), down_tiles=Tiles(64, 32, 4, 1, "swapped")),
}


@pytest.mark.parametrize("mode", TILES)
def test_decode_kernels_match_dequantize_then_matmul(mode):
    experts = nvfp4_experts(8)
    batch = routing(5, 8, torch.float32)  # 10 pairs over 8 experts: some experts shared
    out = run(moe_experts_nvfp4, experts, *batch, **TILES[mode])
    assert rel_l2(out, run(moe_experts_reference, experts, *batch)) < 1e-5


# Both expansions (`Tiles.expand`) of every MMA mode: gate/up over two K tiles (H = 64), down over one
# K tile half past I = 32 (its second block-scale group masked).
EXPANSIONS = {
    (mma, expand): dict(
        gate_up_tiles=Tiles(64 if mma == "swapped" else 32, 32, 4, 1, mma, expand),
        down_tiles=Tiles(64 if mma == "swapped" else 32, 64, 4, 1, mma, expand),
    )
    for mma in ("dot", "swapped", "gemv")
    for expand in ("byte", "group")
}


@pytest.mark.parametrize("mma", ["dot", "swapped"])
@pytest.mark.parametrize("tokens", [1, 4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_group_expansion_gives_the_byte_expansion_s_bits_through_an_mma(mma, tokens, dtype):
    """Its weights are the byte expansion's bit for bit, so an MMA of them is too (decode: T = 16 puts up
    to 5 pairs on an expert)."""
    experts = nvfp4_experts(8, seed=7)
    batch = routing(tokens, 8, dtype, seed=tokens)
    byte = run(moe_experts_nvfp4, experts, *batch, **EXPANSIONS[mma, "byte"])
    group = run(moe_experts_nvfp4, experts, *batch, **EXPANSIONS[mma, "group"])
    assert torch.equal(group, byte)
    assert rel_l2(group, run(moe_experts_reference, experts, *batch)) < (
        1e-5 if dtype == torch.float32 else 3e-3
    )


@pytest.mark.parametrize("tokens", [1, 4, 16])
def test_group_expansion_gemv_matches_dequantize_then_matmul(tokens):
    """The fp32 GEMV sums the same exact products as the byte expansion's in another order: both at fp32
    rounding from the reference."""
    experts = nvfp4_experts(8, seed=8)
    batch = routing(tokens, 8, torch.float32, seed=tokens)
    reference = run(moe_experts_reference, experts, *batch)
    group = run(moe_experts_nvfp4, experts, *batch, **EXPANSIONS["gemv", "group"])
    assert rel_l2(group, reference) < 1e-5
    assert rel_l2(group, run(moe_experts_nvfp4, experts, *batch, **EXPANSIONS["gemv", "byte"])) < 1e-5


@pytest.mark.parametrize("mma", ["dot", "gemv"])
def test_grouped_kernels_with_the_group_expansion(mma):
    experts = nvfp4_experts(8, seed=9)
    batch = routing(12, 8, torch.float32, seed=10)
    options = dict(grouped=True, block_m=16, **EXPANSIONS[mma, "group"])
    out = run(moe_experts_nvfp4, experts, *batch, **options)
    assert rel_l2(out, run(moe_experts_reference, experts, *batch)) < 1e-5
    if mma == "dot":
        byte = run(moe_experts_nvfp4, experts, *batch, grouped=True, block_m=16, **EXPANSIONS[mma, "byte"])
        assert torch.equal(out, byte)


@pytest.mark.parametrize(("mma", "expand"), EXPANSIONS)
def test_a_token_result_does_not_depend_on_the_batch(mma, expand):
    """16 tokens over 4 experts (top-2: 8 pairs an expert on average, sharing row tiles), then tokens
    alone: the same bits."""
    experts = nvfp4_experts(4, seed=11)
    hidden, weights, ids = routing(16, 4, torch.float32, seed=12)
    batched = run(moe_experts_nvfp4, experts, hidden, weights, ids, **EXPANSIONS[mma, expand])
    for t in (0, 7, 15):
        one = (hidden[t : t + 1], weights[t : t + 1], ids[t : t + 1])
        alone = run(moe_experts_nvfp4, experts, *one, **EXPANSIONS[mma, expand])
        assert torch.equal(alone[0], batched[t])


# Split K over H = 64 (gate/up: 2 or 4 tiles of 32 columns, a slice each or two) and I = 32 (down: one
# 32-column tile, so slices 1 .. S-1 are empty and add zeros), in each MMA mode.
SPLITS = {
    (mma, split_k): dict(
        gate_up_tiles=Tiles(64 if mma == "swapped" else 32, 32, 4, 1, mma, "group", split_k),
        down_tiles=Tiles(64 if mma == "swapped" else 32, 32, 4, 1, mma, "byte", split_k),
    )
    for mma in ("dot", "swapped", "gemv")
    for split_k in (2, 4)
}


@pytest.mark.parametrize(("mma", "split_k"), SPLITS)
def test_split_k_matches_dequantize_then_matmul(mma, split_k):
    experts = nvfp4_experts(8, seed=13)
    batch = routing(5, 8, torch.float32, seed=14)
    out = run(moe_experts_nvfp4, experts, *batch, **SPLITS[mma, split_k])
    assert rel_l2(out, run(moe_experts_reference, experts, *batch)) < 1e-5


@pytest.mark.parametrize("mma", ["dot", "gemv"])
def test_a_token_result_under_split_k_does_not_depend_on_the_batch(mma):
    """Slices follow K, split_k and BLOCK_K only, and the sum kernel adds them in slice order: a token's
    bits alone are its bits among 6 tokens sharing 3 experts."""
    experts = nvfp4_experts(3, seed=15)
    hidden, weights, ids = routing(6, 3, torch.float32, seed=16)
    tiles = SPLITS[mma, 2]
    batched = run(moe_experts_nvfp4, experts, hidden, weights, ids, **tiles)
    for t in (0, 5):
        one = (hidden[t : t + 1], weights[t : t + 1], ids[t : t + 1])
        assert torch.equal(run(moe_experts_nvfp4, experts, *one, **tiles)[0], batched[t])


def test_tiles_files_load_with_and_without_split_k(tmp_path, monkeypatch):
    """The shipped H200 file and one written before split_k (or expand) existed load with split_k = 1;
    one with it, as written."""
    shipped = moe_tiles.tuned_tiles("NVIDIA H200", ExpertShape(512, 2048, 512, "nvfp4"))
    assert shipped is not None and all(t.split_k == 1 for t in shipped)
    monkeypatch.setattr(moe_tiles, "CONFIG_DIR", tmp_path)
    split = Tiles(16, 256, 4, 5, "gemv", "group", 4)
    for experts, gate_up, down in (
        (8, [16, 256, 4, 5, "gemv"], [64, 128, 4, 2]),
        (9, list(split), list(split)),
    ):
        shape = ExpertShape(experts, HIDDEN, INTERMEDIATE, "nvfp4")
        moe_tiles.config_path("Test GPU", shape).write_text(json.dumps({"gate_up": gate_up, "down": down}))
    old = moe_tiles.tuned_tiles("Test GPU", ExpertShape(8, HIDDEN, INTERMEDIATE, "nvfp4"))
    assert old == (Tiles(16, 256, 4, 5, "gemv"), Tiles(64, 128, 4, 2))
    assert old[0].split_k == old[1].split_k == 1 and old[1].expand == "byte"
    assert moe_tiles.tuned_tiles("Test GPU", ExpertShape(9, HIDDEN, INTERMEDIATE, "nvfp4")) == (split, split)


@pytest.mark.parametrize("weight_dtype", ["fp8", "nvfp4"])
@pytest.mark.parametrize("preset", ["preset:qwen3-next-80b-a3b", "preset:qwen3.8-flash-next"])
def test_the_presets_served_expert_shapes_have_shipped_h200_tiles(preset, weight_dtype):
    """The stacked experts as the model is built to serve them (fp8: the shared expert stacked as one
    more; nvfp4: the routed ones alone) find a tuned file for the H200: a file named for another shape is
    never read (Flash-Next's NVFP4 tiles once were, tuned with the shared expert stacked: 513 experts)."""
    from morion.layers.moe import StackedExperts
    from morion.models.presets import preset_config
    from morion.models.registry import build_model

    model = build_model(preset_config(preset), torch.bfloat16, torch.device("meta"), weight_dtype)
    experts = next(m for m in model.modules() if isinstance(m, StackedExperts))
    shape = moe_tiles.expert_shape(experts.gate_up_proj, experts.down_proj)
    assert shape.dtype == weight_dtype
    assert moe_tiles.config_path("NVIDIA H200", shape).exists(), shape


def test_flash_next_s_shared_stack_beside_the_nvfp4_experts_has_shipped_h200_tiles():
    """Under nvfp4 the shared expert is the one expert of an FP8 stack of its own: its H200 tiles (tuned
    14.75 us a call at one token against the defaults' 31.15, 48 calls a decode step) are shipped."""
    from morion.layers.moe import SparseMoE
    from morion.models.presets import preset_config
    from morion.models.registry import build_model

    model = build_model(
        preset_config("preset:qwen3.8-flash-next"), torch.bfloat16, torch.device("meta"), "nvfp4"
    )
    block = next(m for m in model.modules() if isinstance(m, SparseMoE))
    shared = block.shared_experts
    shape = moe_tiles.expert_shape(shared.gate_up_proj, shared.down_proj)
    assert shape == ExpertShape(1, 2560, 640, "fp8")
    assert moe_tiles.config_path("NVIDIA H200", shape).exists(), shape


def test_the_shipped_flash_next_tiles_split_k_and_match_dequantize_then_matmul():
    """Flash-Next's tuned H200 file (512 routed experts: under nvfp4 the shared one is a dense layer,
    hidden 2560, intermediate 640): gate_up splits K over 4 programs, down runs K in one; the same tiles on
    the test's shapes (BLOCK_K past K: slices without a tile add nothing) give dequantize-then-matmul's
    result."""
    shipped = moe_tiles.tuned_tiles("NVIDIA H200", ExpertShape(512, 2560, 640, "nvfp4"))
    assert shipped is not None
    gate_up, down = shipped
    assert (gate_up.mma, gate_up.expand, gate_up.split_k) == ("gemv", "group", 4) and down.split_k == 1
    experts = nvfp4_experts(4, seed=21)
    batch = routing(3, 4, torch.float32, seed=22)
    out = run(moe_experts_nvfp4, experts, *batch, gate_up_tiles=gate_up, down_tiles=down)
    assert rel_l2(out, run(moe_experts_reference, experts, *batch)) < 1e-5


def test_an_expert_with_more_pairs_than_a_tile_fp16():
    """Two experts and top-2: all 17 tokens route to both, 17 pairs per expert, past the decode kernels'
    16-row tile and the 16-row grouped tiles asked for here (two tiles per expert, the second partial)."""
    experts = nvfp4_experts(2, seed=3)
    batch = routing(17, 2, torch.float16, seed=4)
    reference = run(moe_experts_reference, experts, *batch)
    assert reference.dtype == torch.float16
    decode = run(moe_experts_nvfp4, experts, *batch)
    grouped = run(moe_experts_nvfp4, experts, *batch, grouped=True, block_m=16)
    assert decode.dtype == grouped.dtype == torch.float16
    # fp16 inputs on both sides, rounded in different places (the reference rounds each weight, the
    # kernels only code x block scale, which is exact).
    assert rel_l2(decode, reference) < 3e-3 and rel_l2(grouped, reference) < 3e-3


def test_grouped_kernels_match_dequantize_then_matmul():
    experts = nvfp4_experts(8, seed=5)
    batch = routing(12, 8, torch.float32, seed=6)
    out = run(moe_experts_nvfp4, experts, *batch, grouped=True, block_m=16)
    assert rel_l2(out, run(moe_experts_reference, experts, *batch)) < 1e-5


def test_expert_tiles_cover_every_pair_once_in_tiles_of_one_expert():
    topk_ids = torch.tensor([[3, 0], [3, 1], [3, 0], [1, 3], [0, 3]])  # expert 3: 5 pairs, 2: none
    tiles, order = expert_tiles(topk_ids, num_experts=4, block_m=2)
    flat = topk_ids.reshape(-1)
    assert torch.equal(flat[order.long()], flat.sort(stable=True).values)
    # cdiv(10, 2) + min(4, 10) tiles at most; experts 0 (3 pairs), 1 (2), 3 (5) need 2 + 1 + 3.
    assert tiles.shape == (9, 3)
    covered = []
    for expert, start, end in tiles.tolist():
        assert end - start <= 2
        covered += order[start:end].tolist()
        assert all(flat[p] == expert for p in order[start:end].tolist())
    assert sorted(covered) == list(range(10))
    assert (tiles[6:, 1] == tiles[6:, 2]).all()  # the unused tiles are empty


def test_inputs_the_kernels_cannot_take_are_refused():
    experts = nvfp4_experts(2)
    batch = routing(1, 2, torch.float32)
    with pytest.raises(ValueError, match="BLOCK_K a power of two of at least 32"):
        run(moe_experts_nvfp4, experts, *batch, gate_up_tiles=Tiles(32, 16, 4, 1))
    with pytest.raises(ValueError, match="unknown NVFP4 tile expand"):
        run(moe_experts_nvfp4, experts, *batch, gate_up_tiles=Tiles(32, 32, 4, 1, "dot", "nibble"))
    with pytest.raises(ValueError, match="split_k of at least 1"):
        run(moe_experts_nvfp4, experts, *batch, down_tiles=Tiles(32, 32, 4, 1, "gemv", "byte", 0))
    with pytest.raises(ValueError, match="the grouped kernels take split_k = 1"):
        run(moe_experts_nvfp4, experts, *batch, grouped=True, gate_up_tiles=Tiles(32, 32, 4, 1, split_k=2))
    with pytest.raises(ValueError, match="all four scales"):
        run(moe_experts_nvfp4, {**experts, "down_scale_2": None}, *batch)


def test_the_grouped_kernels_run_a_tuned_entry_s_rows_and_tiles(monkeypatch):
    """A device's grouped entry for NVFP4 experts (ops/moe_tune_grouped.py --dtype nvfp4): the grouped
    kernels take its rows and tiles (arguments still override them), and give the result those rows and
    tiles give when asked for directly; without an entry, the defaults."""
    from morion.ops import moe_nvfp4_triton
    from morion.ops.moe_tiles import GroupedTiles

    experts = nvfp4_experts(8, seed=9)
    batch = routing(40, 8, torch.float32, seed=10)
    entry = GroupedTiles(16, 0, Tiles(32, 64, 4, 2, "dot", "group"), Tiles(32, 64, 4, 2))
    runs = []
    real_run = moe_nvfp4_triton._run

    def spy(*args):
        runs.append(args[6:9])  # block_m, gate_up tiles, down tiles
        return real_run(*args)

    monkeypatch.setattr(moe_nvfp4_triton, "_run", spy)
    monkeypatch.setattr(moe_nvfp4_triton, "tuned_grouped_on", lambda device, gate_up, down: entry)
    tuned = run(moe_experts_nvfp4, experts, *batch, grouped=True)
    assert runs[-1] == (16, entry.gate_up, entry.down)
    asked = run(
        moe_experts_nvfp4, experts, *batch, grouped=True, block_m=16, gate_up_tiles=entry.gate_up,
        down_tiles=entry.down,
    )  # fmt: skip
    assert torch.equal(tuned, asked)
    run(moe_experts_nvfp4, experts, *batch, grouped=True, block_m=32)
    assert runs[-1] == (32, entry.gate_up, entry.down)
    monkeypatch.setattr(moe_nvfp4_triton, "tuned_grouped_on", lambda device, gate_up, down: None)
    run(moe_experts_nvfp4, experts, *batch, grouped=True)
    assert runs[-1] == (
        moe_nvfp4_triton.GROUPED_BLOCK_M,
        moe_nvfp4_triton.GROUPED_TILES,
        moe_nvfp4_triton.GROUPED_TILES,
    )
