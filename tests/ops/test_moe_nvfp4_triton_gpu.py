"""The NVFP4 expert kernels at Qwen3-Next shapes (E=512, top-10, H=2048, I=512) on a GPU: decode and
grouped kernels against dequantize-then-matmul in fp32 and in bf16, replayed in a CUDA graph with new
routing, batch invariance of the decode kernels, the layer's CUDA paths (never the reference), and
CUDA-graph timings against the FP8 fused kernels with the TB/s of packed weights read, printed (never
asserted). The decode kernels' tiles (this GPU's tuned file, and the defaults) in both code expansions
(`Tiles.expand`), and in the group expansion with K split over 4 programs (`Tiles.split_k`), are checked
and timed each."""

from __future__ import annotations

import statistics

import pytest
import torch

from morion.layers.moe import StackedExperts
from morion.ops.moe import moe_experts_reference
from morion.ops.moe_tiles import Tiles, device_name, tuned_tiles
from morion.ops.moe_tune import random_experts, run_experts, time_in_graph
from tests.ops.conftest import CUDA, HIDDEN, SHAPE, graph_replays_with_new_routings, make_moe_batch, rel_l2

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def nvfp4_experts() -> dict[str, torch.Tensor]:
    """Random experts of the real shapes, quantized as the loader does (gate and up rows apart)."""
    return random_experts(SHAPE._replace(dtype="nvfp4"), CUDA)


def decode(*args, **options) -> torch.Tensor:
    from morion.ops.moe_nvfp4_triton import moe_experts_nvfp4

    return moe_experts_nvfp4(*args, **options)


def grouped(*args, **options) -> torch.Tensor:
    from morion.ops.moe_nvfp4_triton import moe_experts_nvfp4

    return moe_experts_nvfp4(*args, grouped=True, **options)


KERNELS = {"decode": decode, "grouped": grouped}


def decode_tiles() -> dict[str, dict[str, Tiles]]:
    """The decode kernels' tiles: this GPU's tuned file for the shape (when it has one) and the defaults,
    each in both code expansions and split K: {"tuned group": {"gate_up_tiles": ..., "down_tiles": ...},
    ..., "tuned group split_k=4": ...}."""
    from morion.ops.moe_nvfp4_triton import DECODE_DOWN_TILES, DECODE_GATE_UP_TILES

    tiles = {"defaults": (DECODE_GATE_UP_TILES, DECODE_DOWN_TILES)}
    tuned = tuned_tiles(device_name(torch.cuda.current_device()), SHAPE._replace(dtype="nvfp4"))
    if tuned is not None:
        tiles["tuned"] = tuned
    # Each variant's (expand, split_k).
    variants = {"byte": ("byte", 1), "group": ("group", 1), "group split_k=4": ("group", 4)}
    return {
        f"{name} {variant}": {
            "gate_up_tiles": gate_up._replace(expand=expand, split_k=split_k),
            "down_tiles": down._replace(expand=expand, split_k=split_k),
        }
        for name, (gate_up, down) in tiles.items()
        for variant, (expand, split_k) in variants.items()
    }


VARIANTS = [
    "defaults byte",
    "defaults group",
    "defaults group split_k=4",
    "tuned byte",
    "tuned group",
    "tuned group split_k=4",
]


def variant_tiles(name: str) -> dict[str, Tiles]:
    tiles = decode_tiles()
    if name not in tiles:
        pytest.skip(f"no {name.split()[0]} tiles on {torch.cuda.get_device_name()}")
    return tiles[name]


@pytest.mark.parametrize(
    ("kernel", "tokens"),
    [("decode", 1), ("decode", 4), ("decode", 16), ("decode", 64), ("grouped", 16), ("grouped", 300)],
)
def test_kernels_match_dequantize_then_matmul(nvfp4_experts, kernel, tokens):
    hidden, weights, ids = make_moe_batch(tokens, seed=tokens)
    out = run_experts(KERNELS[kernel], nvfp4_experts, hidden, weights, ids)
    assert out.dtype == torch.bfloat16 and out.shape == (tokens, HIDDEN)
    exact = run_experts(moe_experts_reference, nvfp4_experts, hidden.float(), weights.float(), ids)
    bf16 = run_experts(moe_experts_reference, nvfp4_experts, hidden, weights, ids)
    # The kernels' weights are exact (code x block scale; the global scale in fp32), their only rounding
    # the bf16 SwiGLU output feeding the down projection: ~2e-3 from the fp32 reference, where the bf16
    # reference (each weight rounded to bf16, each GEMM's output too) is ~4e-3 off. A wrong nibble,
    # block scale or global scale anywhere is O(1).
    assert rel_l2(out, exact) < 6e-3
    assert rel_l2(out, exact) < rel_l2(bf16, exact) + 1e-3


@pytest.mark.parametrize("tokens", [1, 4, 16])
@pytest.mark.parametrize("variant", VARIANTS)
def test_each_expansion_matches_dequantize_then_matmul(nvfp4_experts, variant, tokens):
    """As above for each decode tile and expansion; through an MMA the group expansion gives the byte
    expansion's bits (the same weights), its GEMV the same exact products summed in another order."""
    tiles = variant_tiles(variant)
    hidden, weights, ids = make_moe_batch(tokens, seed=tokens)
    out = run_experts(decode, nvfp4_experts, hidden, weights, ids, **tiles)
    exact = run_experts(moe_experts_reference, nvfp4_experts, hidden.float(), weights.float(), ids)
    bf16 = run_experts(moe_experts_reference, nvfp4_experts, hidden, weights, ids)
    assert rel_l2(out, exact) < 6e-3
    assert rel_l2(out, exact) < rel_l2(bf16, exact) + 1e-3
    byte = {name: t._replace(expand="byte") for name, t in tiles.items()}
    if all(t.mma != "gemv" for t in tiles.values()):
        assert torch.equal(out, run_experts(decode, nvfp4_experts, hidden, weights, ids, **byte))


@pytest.mark.parametrize("kernel", KERNELS)
def test_kernels_replay_in_a_cuda_graph_with_new_routing(nvfp4_experts, kernel):
    step = KERNELS[kernel]
    replays = graph_replays_with_new_routings(lambda batch: run_experts(step, nvfp4_experts, *batch))
    for batch, replayed in replays:
        assert torch.equal(replayed, run_experts(step, nvfp4_experts, *batch))  # deterministic kernels


@pytest.mark.parametrize("variant", ["default", *VARIANTS])
def test_a_token_result_does_not_depend_on_the_batch(nvfp4_experts, variant):
    tiles = {} if variant == "default" else variant_tiles(variant)
    hidden, weights, ids = make_moe_batch(16, seed=5)
    ids[1:4, 0] = ids[0, 0]  # tokens sharing an expert share its row tile
    batched = run_experts(decode, nvfp4_experts, hidden, weights, ids, **tiles)
    for t in (0, 2, 15):
        one = (hidden[t : t + 1], weights[t : t + 1], ids[t : t + 1])
        alone = run_experts(decode, nvfp4_experts, *one, **tiles)
        assert torch.equal(alone[0], batched[t])


def test_the_layer_runs_the_nvfp4_kernels_and_never_the_reference(nvfp4_experts, monkeypatch):
    """No silent fallback: decode-sized and prefill-sized batches through StackedExperts on CUDA, with the
    reference loop (the only path that dequantizes) made to fail."""
    from morion.layers import moe

    layer = StackedExperts(SHAPE.experts, SHAPE.hidden, SHAPE.intermediate, "nvfp4").to(CUDA)
    for name, tensor in layer.state_dict().items():  # gate_up_proj_scale_2 is random_experts' gate_up_scale_2
        tensor.copy_(nvfp4_experts[name.replace("_proj", "")])
    batches = {tokens: make_moe_batch(tokens, seed=20 + tokens) for tokens in (1, 300)}
    expected = {t: run_experts(moe_experts_reference, nvfp4_experts, *b) for t, b in batches.items()}

    def refuse(*args, **kwargs):
        raise AssertionError("the reference ran on CUDA")

    monkeypatch.setattr(moe, "moe_experts_reference", refuse)
    for kernel in ("auto", "grouped", "triton"):
        layer.kernel = kernel
        for tokens, (hidden, weights, ids) in batches.items():
            assert rel_l2(layer(hidden, weights, ids), expected[tokens]) < 1e-2


def packed_bytes(experts: dict[str, torch.Tensor], batches: list) -> float:
    """Mean bytes of expert codes and scales a call must read: its distinct experts' matrices."""
    per_expert = sum(t[0].numel() * t.element_size() for t in experts.values())
    return statistics.mean(per_expert * batch[2].unique().numel() for batch in batches)


def test_timings_against_fp8(nvfp4_experts, moe_experts, capsys):
    from morion.ops.moe_decode_triton import moe_experts_triton

    lines = []
    for tokens in (1, 4, 16):
        batches = [make_moe_batch(tokens, seed=100 + i) for i in range(20)]
        fp8 = time_in_graph(moe_experts_triton, moe_experts["fp8"], batches)
        for variant, tiles in {"default": {}, **decode_tiles()}.items():
            nvfp4 = time_in_graph(decode, nvfp4_experts, batches, **tiles)
            rate = packed_bytes(nvfp4_experts, batches) / (nvfp4 * 1e-6) / 1e12
            listed = ", ".join(f"{name} {tuple(t)}" for name, t in tiles.items()) or "as the layer runs"
            lines.append(
                f"moe nvfp4 T={tokens} {variant}: decode kernels {nvfp4:.1f} us ({rate:.2f} TB/s of packed "
                f"weights), fp8 fused {fp8:.1f} us, fp8/nvfp4 {fp8 / nvfp4:.2f}x [{listed}]"
            )
    for tokens in (256, 1024):
        batches = [make_moe_batch(tokens, seed=200 + i) for i in range(3)]
        us = time_in_graph(grouped, nvfp4_experts, batches)
        lines.append(f"moe nvfp4 T={tokens}: grouped kernels {us:.1f} us ({tokens / us:.2f} tokens/us)")
    with capsys.disabled():
        print("\n" + "\n".join(lines))
