"""ops/nvfp4.py, the one definition of NVFP4's numbers: its quantizer equals a ModelOpt-recipe quantizer
written independently for the tests (tests/loader/nvfp4_quantize.py) bit for bit, round-to-nearest ties
go to the even code, and stacked experts quantize each part (gate rows, up rows) with its own global
scale, which `dequantize_parts` applies."""

from __future__ import annotations

import torch

from morion.ops.nvfp4 import (
    dequantize_nvfp4,
    dequantize_parts,
    e2m1_codes,
    quantize_nvfp4,
    quantize_nvfp4_parts,
)
from tests.loader.nvfp4_quantize import e2m1_codes as independent_codes
from tests.loader.nvfp4_quantize import quantize_nvfp4 as independent_quantize


def test_codes_round_to_nearest_with_ties_to_even():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])  # every midpoint of the grid
    assert e2m1_codes(ties).tolist() == [0, 2, 2, 4, 4, 6, 6]
    assert e2m1_codes(-ties).tolist() == [0, 10, 10, 12, 12, 14, 14]  # sign bit 3; -0.25 rounds to 0
    assert e2m1_codes(torch.tensor([6.4, 100.0, -7.0, 0.26, 1e-9])).tolist() == [7, 7, 15, 1, 0]
    x = torch.randn(50_000, generator=torch.Generator().manual_seed(0)) * 3
    assert torch.equal(e2m1_codes(x), independent_codes(x))


def test_quantizer_is_modelopts_recipe_bit_for_bit():
    weight = torch.randn(96, 160, generator=torch.Generator().manual_seed(1)) * 0.02
    weight[5, 7] = 0.9  # an outlier: most blocks get small, sub-448 scales
    weight[9, 16:32] = 0  # an all-zero block: scale 0, codes 0
    ours, theirs = quantize_nvfp4(weight), independent_quantize(weight)
    assert torch.equal(ours.codes, theirs.weight)
    assert torch.equal(ours.block_scales.view(torch.uint8), theirs.weight_scale.view(torch.uint8))
    assert ours.global_scale.item() == theirs.weight_scale_2.item()
    assert torch.equal(ours.dequantize(), theirs.dequantized)


def test_parts_of_stacked_experts_have_their_own_global_scale():
    generator = torch.Generator().manual_seed(2)
    gate_up = torch.randn(3, 2 * 32, 48, generator=generator)
    gate_up[:, 32:] *= 10  # the up rows 10x larger: a shared global scale would crush the gate rows
    stacked = quantize_nvfp4_parts(gate_up, 2)
    assert stacked.codes.shape == (3, 64, 24) and stacked.block_scales.shape == (3, 64, 3)
    assert stacked.global_scale.shape == (3, 2)
    for expert in range(3):
        for part, rows in enumerate((slice(0, 32), slice(32, 64))):
            alone = quantize_nvfp4(gate_up[expert, rows])
            assert torch.equal(stacked.codes[expert, rows], alone.codes)
            assert stacked.global_scale[expert, part] == alone.global_scale
    restored = dequantize_parts(stacked.codes, stacked.block_scales, stacked.global_scale, torch.float32)
    rows_of_expert_1_up = dequantize_nvfp4(
        stacked.codes[1, 32:], stacked.block_scales[1, 32:], stacked.global_scale[1, 1]
    )
    assert torch.equal(restored[1, 32:], rows_of_expert_1_up)
    assert ((restored - gate_up).norm() / gate_up.norm()) < 0.11
