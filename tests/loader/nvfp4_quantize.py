"""A reference NVFP4 quantizer for tests: a float weight -> the exact ModelOpt tensors (model-architecture.md
§6.1), written independently of morion's dequantizer so the two check each other."""

from __future__ import annotations

from typing import NamedTuple

import torch

E4M3_MAX = 448.0
E2M1_MAX = 6.0
# Magnitudes of E2M1 codes 0-7, and the midpoints between neighbours (ModelOpt's rounding boundaries).
E2M1_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
_MIDPOINTS = (E2M1_MAGNITUDES[:-1] + E2M1_MAGNITUDES[1:]) / 2


class NVFP4Weight(NamedTuple):
    weight: torch.Tensor  # uint8 [N, K/2]: code of column 2j in the low nibble, of 2j+1 in the high one
    weight_scale: torch.Tensor  # float8_e4m3fn [N, K/16]
    weight_scale_2: torch.Tensor  # float32 []
    input_scale: torch.Tensor  # float32 []: unused by weight-only loading, present in real checkpoints
    dequantized: torch.Tensor  # float32 [N, K]: code value x block scale x weight_scale_2, from the codes


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest E2M1 codes (ties to the even code, as ModelOpt does), sign in bit 3; beyond ±6
    saturates. A value that rounds to zero gets code 0 whatever its sign."""
    magnitude = torch.searchsorted(_MIDPOINTS, x.abs().contiguous())  # a tie lands on the lower code
    tie = (x.abs().unsqueeze(-1) == _MIDPOINTS).any(-1) & (magnitude % 2 == 1)
    magnitude = magnitude + tie.long()
    return (magnitude | ((x < 0) & (magnitude > 0)).long() << 3).to(torch.uint8)


def quantize_nvfp4(weight: torch.Tensor, group_size: int = 16) -> NVFP4Weight:
    """ModelOpt's recipe: weight_scale_2 = amax(W)/(6·448), block scale =
    e4m3(amax(block)/(6·weight_scale_2)), codes = E2M1(W / (block scale · weight_scale_2)) packed two per
    byte. An all-zero block (scale 0) gets codes 0."""
    rows, columns = weight.shape
    w = weight.float()
    scale_2 = w.abs().max() / (E2M1_MAX * E4M3_MAX)
    blocks = w.view(rows, columns // group_size, group_size)
    block_scale = (blocks.abs().amax(-1) / (E2M1_MAX * scale_2)).to(torch.float8_e4m3fn)
    divisor = block_scale.float() * scale_2
    codes = e2m1_codes(blocks / torch.where(divisor == 0, 1.0, divisor).unsqueeze(-1)).view(rows, columns)
    signs = torch.where(codes >= 8, -1.0, 1.0)
    values = (signs * E2M1_MAGNITUDES[(codes & 7).long()]).view(rows, columns // group_size, group_size)
    dequantized = (values * block_scale.float().unsqueeze(-1) * scale_2).view(rows, columns)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    input_scale = torch.tensor(1.0 / (E2M1_MAX * E4M3_MAX))
    return NVFP4Weight(packed, block_scale, scale_2, input_scale, dequantized)
