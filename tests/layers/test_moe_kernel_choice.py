"""`--moe-kernel auto|grouped|triton`: the flag reaches EngineConfig, `set_moe_kernel` reaches every
routed-experts module, and (on a GPU) the layer runs the fused kernels up to AUTO_TRITON_MAX_TOKENS under
auto, and under triton as far as their pair limit goes, their grouped mode past it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from morion import cli
from morion.config import EngineConfig
from morion.engine_flags import engine_options
from morion.errors import MorionError
from morion.layers import moe as moe_layer
from morion.layers.moe import (
    AUTO_TRITON_MAX_TOKENS,
    SparseMoE,
    StackedExperts,
    set_moe_kernel,
)
from morion.ops.moe_decode_triton import MAX_PAIRS
from morion.ops.moe_tiles import GroupedTiles, Tiles, expert_shape


def small_moe() -> SparseMoE:
    torch.manual_seed(0)
    moe = SparseMoE(64, num_experts=8, top_k=2, intermediate_size=32, shared_expert_intermediate_size=32,
                    norm_topk_prob=True)  # fmt: skip
    for weight in (moe.experts.gate_up_proj, moe.experts.down_proj):
        nn.init.normal_(weight, std=0.1)
    return moe


def test_the_flag_reaches_the_engine_config():
    args = cli._build_parser().parse_args(["generate", "--prompt", "hi", "--moe-kernel", "triton"])
    options = engine_options(args)
    assert options["moe_kernel"] == "triton"
    assert EngineConfig(**options).moe_kernel == "triton"
    assert EngineConfig().moe_kernel == "auto"
    with pytest.raises(MorionError, match="moe_kernel must be one of auto, grouped, triton"):
        EngineConfig(moe_kernel="cutlass")


def test_set_moe_kernel_reaches_every_experts_module():
    model = nn.ModuleList([small_moe(), nn.Sequential(small_moe())])
    set_moe_kernel(model, "triton")
    experts = [m for m in model.modules() if isinstance(m, StackedExperts)]
    assert len(experts) == 2 and all(m.kernel == "triton" for m in experts)
    with pytest.raises(ValueError, match="moe kernel"):
        set_moe_kernel(model, "fast")


def test_the_choice_does_not_change_the_cpu_path():
    moe = small_moe()
    x = torch.randn(3, 64)
    expected = moe(x)
    set_moe_kernel(moe, "triton")
    assert moe.experts._path(x, 6) == "reference"
    assert torch.equal(moe(x), expected)


@pytest.mark.gpu
def test_triton_runs_up_to_the_threshold_on_cuda():
    from morion.ops.moe_decode_triton import moe_experts_triton

    moe = small_moe().to("cuda", torch.bfloat16)
    experts = moe.experts
    set_moe_kernel(moe, "triton")
    large = torch.randn(AUTO_TRITON_MAX_TOKENS * 2, 64, device="cuda")
    assert experts._path(large, large.shape[0] * 2) == "triton"
    assert experts._path(large, MAX_PAIRS + 1) == "triton-grouped"  # past what the fused kernels hold
    set_moe_kernel(moe, "auto")
    small = large[:AUTO_TRITON_MAX_TOKENS]
    assert experts._path(small, AUTO_TRITON_MAX_TOKENS * 2) == "triton"
    assert experts._path(large[: AUTO_TRITON_MAX_TOKENS + 1], AUTO_TRITON_MAX_TOKENS * 2 + 2) == "grouped"
    set_moe_kernel(moe, "grouped")
    assert experts._path(small[:1], 2) == "grouped"
    set_moe_kernel(moe, "triton")
    x = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16)
    weights, ids = moe.route(x)
    direct = moe_experts_triton(x, experts.gate_up_proj, experts.down_proj, weights, ids)
    assert torch.equal(experts(x, weights, ids), direct)


class _CudaRows:
    """What `StackedExperts._path` reads of its input, as a CUDA tensor of `tokens` rows would say it."""

    is_cuda = True
    device = torch.device("cuda", 0)

    def __init__(self, tokens: int) -> None:
        self.shape = (tokens, 48)


@pytest.mark.parametrize("kernel", ("auto", "grouped", "triton"))
def test_nvfp4_experts_never_take_a_dequantizing_path_on_cuda(kernel):
    """NVFP4 experts on CUDA run the NVFP4 kernels (the decode ones where the fused kernels would run,
    else the grouped ones) whatever the kernel choice and shape (H = 48 is not a multiple of 32); the
    reference (which dequantizes) only on the CPU."""
    experts = StackedExperts(8, 48, 32, "nvfp4")
    experts.kernel = kernel
    for tokens, pairs in ((1, 2), (AUTO_TRITON_MAX_TOKENS + 1, 2 * AUTO_TRITON_MAX_TOKENS + 2), (600, 1200)):
        fused = {"auto": tokens <= AUTO_TRITON_MAX_TOKENS, "triton": True, "grouped": False}[kernel]
        expected = "triton" if fused and pairs <= MAX_PAIRS else "grouped"
        assert experts._path(_CudaRows(tokens), pairs) == expected
    assert experts._path(torch.zeros(1, 48), 2) == "reference"


@pytest.mark.parametrize("weights", ("model", "fp8"))
def test_triton_takes_the_fused_kernels_grouped_mode_past_their_pairs_on_cuda(weights, monkeypatch):
    """Under triton, FP8 and unquantized experts past MAX_PAIRS run the fused kernels' grouped mode
    (prefill), not torch's grouped GEMMs, whatever their shape; auto keeps torch's there unless the
    device's tuned file holds grouped tiles measured faster at this shape (ops/moe_tune_grouped.py)."""
    tuned: dict[tuple, GroupedTiles] = {}

    def tuned_grouped_on(device, gate_up, down):
        return tuned.get((str(device), expert_shape(gate_up, down)))

    monkeypatch.setattr(moe_layer, "tuned_grouped_on", tuned_grouped_on)
    experts = StackedExperts(8, 48, 32, weights)
    experts.kernel = "triton"
    assert experts._path(_CudaRows(600), 1200) == "triton-grouped"
    assert experts._path(_CudaRows(4), 8) == "triton"
    experts.kernel = "auto"
    assert experts._path(_CudaRows(600), 1200) != "triton-grouped"
    shape = expert_shape(experts.gate_up_proj, experts.down_proj)
    tiles = GroupedTiles(32, 128, Tiles(64, 128, 4, 3), Tiles(128, 128, 4, 3))
    tuned[("cuda:0", shape)] = tiles  # measured, not faster
    assert experts._path(_CudaRows(600), 1200) != "triton-grouped"
    tuned[("cuda:0", shape)] = tiles._replace(faster=True)
    assert experts._path(_CudaRows(600), 1200) == "triton-grouped"
    assert experts._path(_CudaRows(4), 8) == "triton"  # decode sizes keep the fused kernels


def test_the_prefill_identity_names_grouped_kernels_with_their_tiles(monkeypatch):
    """What a module runs for prefill chunks where the disk tier's namespace must name it: the fused
    kernels' grouped mode with its rows, promotion and tiles, and NVFP4's grouped kernels under a tuned
    entry; nothing where prefill runs what it always has (the CPU's reference, torch's grouped GEMMs,
    NVFP4's default tiles)."""
    from morion.ops.moe_decode_triton import GROUPED_BLOCK_M, GROUPED_PROMOTE_K, GROUPED_TILES

    experts = StackedExperts(8, 48, 32, "fp8")
    assert experts.prefill_identity() is None  # the CPU
    seen = []
    path = "triton-grouped"

    def chosen_path(self, x, num_pairs):
        seen.append((x.shape[0], num_pairs))
        return path

    monkeypatch.setattr(StackedExperts, "_path", chosen_path)
    gate_up, down = GROUPED_TILES[1]
    assert experts.prefill_identity() == (
        f"triton-grouped block_m={GROUPED_BLOCK_M} promote_k={GROUPED_PROMOTE_K} "
        f"gate_up={tuple(gate_up)} down={tuple(down)}"
    )
    assert seen[-1] == (AUTO_TRITON_MAX_TOKENS + 1, MAX_PAIRS + 1)  # past the fused kernels' rows and pairs
    path = "grouped"
    assert experts.prefill_identity() is None  # torch's grouped GEMMs
    nvfp4 = StackedExperts(8, 48, 32, "nvfp4")
    assert nvfp4.prefill_identity() is None  # no tuned entry: the default tiles
    entry = GroupedTiles(32, 0, Tiles(64, 128, 4, 3, "dot", "group"), Tiles(128, 128, 8, 3))
    monkeypatch.setattr(moe_layer, "tuned_grouped_on", lambda device, gate_up, down: entry)
    assert nvfp4.prefill_identity() == (
        f"nvfp4-grouped block_m=32 promote_k=0 gate_up={tuple(entry.gate_up)} down={tuple(entry.down)}"
    )
