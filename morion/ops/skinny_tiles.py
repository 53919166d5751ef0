"""Which linear shapes run the skinny Triton kernel (ops/skinny_linear_triton.py), and with which tile.

`python -m morion.bench.skinny_tune` times each linear shape of a model on the device, cuBLAS against the
kernel's candidate tiles, and writes a JSON file into `morion/ops/skinny_configs/` only for the shapes
where the kernel was faster (summed over decode batch sizes). An FP8 shape without a file keeps cuBLAS.
One tile per shape for every M (batch invariance: see the kernel's module).

The model-dtype products (`product`: the MoE router, Gated DeltaNet's in_proj_ba / in_proj_b and a, QSA's
indexer projection, PLE's key and value projections) never take cuBLAS at decode sizes: untuned, they run the
kernel's GEMV mode with `INVARIANT_GEMV`. The router's and the indexer's outputs choose discretely (experts,
blocks of tokens), so one flipped last bit moves an answer, and the gates' feed a recurrent state. cuBLAS
picks its GEMM by M and may sum K in another order at M = 1 than beside other rows (the 80B's shared-expert
gate did: results/2026-12-02-h200-decode-divergence-trace.md), and the first Flash-Next qualification's hits
parted from their cold answers after 3 to 15 identical tokens
(results/2026-12-02-h200-session-notes-e5d0a5d.md). The GEMV sums each row's K in one fixed order at every M:
invariant by construction, not by a measurement of one cuBLAS version.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from morion.ops.log_once import log_once
from morion.ops.moe_tiles import Tiles, device_name, device_slug, dtype_name

logger = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).parent / "skinny_configs"
# The untuned model-dtype products' tile: one row per program, BLOCK_N outputs each (65 programs for a
# router of 512 experts and a stacked gate at M = 1), fp32 products summed in a fixed order (exact for
# bf16 operands); K in blocks of 512, so that a narrow product (Gated DeltaNet's gates, N = 48 to 64 over
# K = 2,048 to 2,560: 6 to 8 programs) waits on 4 to 5 loads in a row rather than 8 to 10.
INVARIANT_GEMV = Tiles(8, 512, 4, 3, "gemv")


class LinearShape(NamedTuple):
    outputs: int  # N
    depth: int  # K
    dtype: str  # "fp8" (e4m3 weights and rows) or the model dtype's name ("bfloat16", ...)


def linear_shape(weight: torch.Tensor) -> LinearShape:
    """The shape of a weight [N, K]."""
    return LinearShape(weight.shape[0], weight.shape[1], dtype_name(weight))


def config_path(device: str, shape: LinearShape, directory: Path | None = None) -> Path:
    name = f"{device_slug(device)}_N{shape.outputs}_K{shape.depth}_{shape.dtype}.json"
    return (directory or CONFIG_DIR) / name


@functools.cache
def tuned_tile(device: str, shape: LinearShape) -> Tiles | None:
    """The tile of this device and shape, or None (cuBLAS). Read once per process: the first call is in a
    warm-up forward, never inside a CUDA-graph capture."""
    path = config_path(device, shape)
    if not path.exists():
        return None
    return Tiles(*json.loads(path.read_text())["tiles"])


def tile_for(x: torch.Tensor, weight: torch.Tensor) -> Tiles | None:
    """The tuned tile for x @ weight.T where the kernel takes it (CUDA, at most MAX_ROWS rows); else
    None, and the caller runs cuBLAS."""
    if not x.is_cuda:
        return None
    from morion.ops import skinny_linear_triton

    if not skinny_linear_triton.supports(x, weight):
        return None
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    return tuned_tile(device_name(index), linear_shape(weight))


def product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T in x's dtype (model-dtype weights): on CUDA at decode sizes the skinny
    kernel, with the device's tuned tile or else `INVARIANT_GEMV` (a row's bits never depend on M); F.linear
    elsewhere (the CPU, long prefill chunks)."""
    tile = product_tile(x, weight)
    if tile is None:
        return F.linear(x, weight)
    from morion.ops.skinny_linear_triton import skinny_linear

    log_once(
        logger, "model-dtype products at decode sizes: skinny Triton kernel, tuned tile or invariant GEMV"
    )
    return skinny_linear(x, weight, tile)


def product_tile(x: torch.Tensor, weight: torch.Tensor) -> Tiles | None:
    """`product`'s tile for these rows: the tuned one, else (on CUDA) `untuned_product_tile`'s."""
    tile = tile_for(x, weight)
    if tile is not None or not x.is_cuda:
        return tile
    return untuned_product_tile(x, weight)


def untuned_product_tile(x: torch.Tensor, weight: torch.Tensor) -> Tiles | None:
    """INVARIANT_GEMV where the kernel takes the rows of a model-dtype product (at most MAX_ROWS), else
    None: cuBLAS (FP8 weights, long prefill chunks)."""
    from morion.ops import skinny_linear_triton

    if weight.element_size() == 1 or not skinny_linear_triton.supports(x, weight):
        return None
    return INVARIANT_GEMV


def linear_forward(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`layer(x)`, through `product` for a plain nn.Linear without bias (no module hooks on such layers in
    this code base: tensor parallelism hooks whole blocks)."""
    if type(layer) is nn.Linear and layer.bias is None:
        return product(x, layer.weight)
    return layer(x)
