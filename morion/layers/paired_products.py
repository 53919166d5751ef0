"""Two linear layers of one input in one launch at decode sizes: an FP8 layer and a model-dtype product.

Qwen3-Next's Gated DeltaNet reads its normed input twice: in_proj_qkvz (FP8 under `--weight-dtype fp8`,
e4m3 rows) and in_proj_ba (kept in the model dtype: `fp8_keep`). On CUDA at decode sizes each is a
skinny kernel launch (ops/skinny_linear_triton.py), and a launch costs about 2 us of a decode step on the
H200 whatever it computes (results/2026-12-04-h200-session-notes-6e90dd3.md, section 4): in_proj_ba's 64
outputs are 8 programs beside in_proj_qkvz's 384. Where both products run the skinny kernel with tiles of
one warp count (`skinny_linear_triton.pairable`), `skinny_linear_pair` runs them as one launch, each
output the bits of its own launch; elsewhere (the CPU, long prefill chunks, an untuned FP8 shape, tiles
of different warp counts) the two calls as before.
"""

from __future__ import annotations

import logging

import torch

from morion.layers.linear_fp8 import Fp8Linear
from morion.ops.log_once import log_once
from morion.ops.skinny_tiles import product, product_tile, tile_for

logger = logging.getLogger(__name__)


def fp8_linear_and_product(
    layer: Fp8Linear,
    q: torch.Tensor,
    row_scale: torch.Tensor,
    out_dtype: torch.dtype,
    x: torch.Tensor,
    weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(`layer.forward_quantized(q, row_scale, out_dtype)`, `skinny_tiles.product(x, weight)`): q [M, K]
    the e4m3 rows of x [M, K] (M > 0) with their scales, weight [N, K] in x's dtype. One launch where
    both run the skinny kernel with pairable tiles, the same bits as the two calls."""
    from morion.ops import skinny_linear_triton as skinny

    fp8_tile = tile_for(q, layer.weight) if layer.kernel_shapes else None
    tile = product_tile(x, weight)
    if fp8_tile is None or tile is None or not skinny.pairable(fp8_tile, tile):
        return layer.forward_quantized(q, row_scale, out_dtype), product(x, weight)
    log_once(logger, "an FP8 linear and a model-dtype product of one input: one skinny launch")
    first = skinny.SkinnyProduct(
        q, layer.weight, fp8_tile, row_scale, layer.weight_scale, layer.bias, out_dtype
    )
    return skinny.skinny_linear_pair(first, skinny.SkinnyProduct(x, weight, tile))
