"""NVFP4 (NVIDIA's 4-bit float weight format, as ModelOpt exports it): the one definition of its numbers.

A weight W [N, K] is three tensors:

    codes          uint8 [N, K/2]            two E2M1 codes a byte, column 2j in the low nibble, 2j+1 high
    block_scales   float8_e4m3fn [N, K/16]   one scale per 16 consecutive input columns
    global_scale   float32 scalar            ModelOpt's `weight_scale_2`: amax(W) / (6 * 448)

    W[n, k] = e2m1(code[n, k]) * block_scales[n, k // 16] * global_scale

An E2M1 value has 2 significant bits and an e4m3 scale 4, so their product is exact in bf16, fp16 and
fp32: the kernels (ops/moe_nvfp4_triton.py) expand code x block scale in registers exactly and apply the
global scale once per output. 4.5 bits per weight (codes plus scales), 0.28x BF16.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

GROUP_SIZE = 16  # input columns per e4m3 block scale; NVFP4 fixes it
E2M1_MAX = 6.0
E4M3_MAX = 448.0

# Value of each 4-bit E2M1 code: bit 3 is the sign, codes 0-7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6.
E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
)
# Byte b -> (value of its low nibble, value of its high nibble): one gather unpacks both columns.
_BYTE_VALUES = torch.stack((E2M1_VALUES[torch.arange(256) & 0xF], E2M1_VALUES[torch.arange(256) >> 4]), -1)


class Nvfp4Weight(NamedTuple):
    """Quantized matrices: codes [..., N, K/2], block scales [..., N, K/16] and global scales [..., P],
    the N rows of each matrix in P equal parts quantized apart (P = 1 for a checkpoint's matrix; 2 for an
    expert's gate and up rows)."""

    codes: torch.Tensor
    block_scales: torch.Tensor
    global_scale: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical [..., N, K] of the matrices the codes encode."""
        return (*self.codes.shape[:-1], self.codes.shape[-1] * 2)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_parts(self.codes, self.block_scales, self.global_scale, dtype)


def dequantize_nvfp4(
    codes: torch.Tensor,
    block_scales: torch.Tensor,
    global_scale: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """codes [..., N, K/2], block_scales [..., N, K/16] and a global scale broadcastable to [..., N, 1]
    (a scalar, or one per row) -> [..., N, K] in `dtype`.

    code x block scale is exact in fp32, so the only rounding is the product with the global scale, taken
    in fp32, then the cast to `dtype`. Shapes are the caller's to check (loader/nvfp4.py does for
    checkpoint tensors)."""
    *lead, rows, packed = codes.shape
    values = _BYTE_VALUES.to(codes.device)[codes.long()].view(*lead, rows, -1, GROUP_SIZE)
    values = values * block_scales.float().unsqueeze(-1)
    values = values.view(*lead, rows, packed * 2) * global_scale.float()
    return values.to(dtype)


def _rounding_boundaries() -> torch.Tensor:
    """Midpoints between neighbouring E2M1 magnitudes; a tie belongs to the even code, so a midpoint
    above an odd code is moved down by one fp32 step (bucketize puts a value equal to a boundary below)."""
    magnitudes = E2M1_VALUES[:8]
    midpoints = (magnitudes[:-1] + magnitudes[1:]) / 2
    odd_below = torch.arange(7) % 2 == 1
    return torch.where(odd_below, torch.nextafter(midpoints, torch.zeros(())), midpoints)


_BOUNDARIES = _rounding_boundaries()


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """x (already divided by its scale) -> 4-bit E2M1 codes as uint8: round to nearest, ties to the even
    code, beyond +-6 saturated; a value that rounds to zero gets code 0 whatever its sign."""
    code = torch.bucketize(x.abs().float(), _BOUNDARIES.to(x.device), out_int32=True).to(torch.uint8)
    return code | ((x < 0) & (code > 0)).to(torch.uint8) << 3


def quantize_nvfp4(weight: torch.Tensor) -> Nvfp4Weight:
    """ModelOpt's recipe for W [..., N, K] (K a multiple of 16; one global scale per [N, K] matrix, [..., 1]):
    global scale amax(W) / (6 * 448), block scale e4m3(amax(block) / (6 * global)), codes
    E2M1(W / (block scale * global)) packed two a byte. A block whose scale is 0 (all zero, or below
    e4m3's smallest step) gets codes 0."""
    *lead, rows, columns = weight.shape
    if columns % GROUP_SIZE:
        raise ValueError(f"NVFP4 needs K a multiple of {GROUP_SIZE}, got a [{rows}, {columns}] weight")
    w = weight.float()
    amax = w.abs().amax(dim=(-2, -1))
    global_scale = (amax / (E2M1_MAX * E4M3_MAX)).clamp_(min=torch.finfo(torch.float32).tiny)
    blocks = w.view(*lead, rows, columns // GROUP_SIZE, GROUP_SIZE)
    per_matrix = global_scale[..., None, None]
    block_scales = (blocks.abs().amax(-1) / (E2M1_MAX * per_matrix)).to(torch.float8_e4m3fn)
    divisor = block_scales.float() * per_matrix
    scaled = blocks / torch.where(divisor == 0, 1.0, divisor).unsqueeze(-1)
    codes = e2m1_codes(scaled).view(*lead, rows, columns)
    return Nvfp4Weight(codes[..., 0::2] | codes[..., 1::2] << 4, block_scales, global_scale[..., None])


def quantize_nvfp4_parts(weight: torch.Tensor, parts: int) -> Nvfp4Weight:
    """Stacked matrices W [..., N, K] whose N rows are `parts` equal parts quantized apart (an expert's
    gate and up rows, as ModelOpt exports them) -> codes [..., N, K/2], block scales [..., N, K/16] and
    global scales [..., parts]."""
    *lead, rows, columns = weight.shape
    quantized = quantize_nvfp4(weight.reshape(*lead, parts, rows // parts, columns))
    return Nvfp4Weight(
        quantized.codes.view(*lead, rows, columns // 2),
        quantized.block_scales.view(*lead, rows, columns // GROUP_SIZE),
        quantized.global_scale.view(*lead, parts),
    )


def dequantize_parts(
    codes: torch.Tensor, block_scales: torch.Tensor, part_scales: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """A stacked expert matrix codes [..., N, K/2] whose N rows are P equal parts quantized apart (gate
    and up rows), each with its global scale part_scales [..., P] -> [..., N, K] in `dtype`."""
    rows, parts = codes.shape[-2], part_scales.shape[-1]
    per_row = part_scales.float().repeat_interleave(rows // parts, dim=-1).unsqueeze(-1)
    return dequantize_nvfp4(codes, block_scales, per_row, dtype)
