"""Which linear shapes run the skinny Triton kernel (ops/skinny_linear_triton.py), and with which tile.

`python -m morion.bench.skinny_tune` times each linear shape of a model on the device, cuBLAS against the
kernel's candidate tiles, and writes a JSON file into `morion/ops/skinny_configs/` only for the shapes
where the kernel was faster (summed over decode batch sizes). A shape without a file keeps cuBLAS, so a
device or model that was never tuned runs as before. One tile per shape for every M (batch invariance:
see the kernel's module).
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
    """x [M, K] @ weight [N, K].T in x's dtype: the skinny kernel where this device tuned the shape, else
    F.linear (cuBLAS)."""
    tile = tile_for(x, weight)
    if tile is None:
        return F.linear(x, weight)
    from morion.ops.skinny_linear_triton import skinny_linear

    log_once(logger, f"linear {tuple(weight.shape)} ({weight.dtype}): skinny Triton kernel, tuned tile")
    return skinny_linear(x, weight, tile)


def linear_forward(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`layer(x)`, through `product` for a plain nn.Linear without bias (no module hooks on such layers in
    this code base: tensor parallelism hooks whole blocks)."""
    if type(layer) is nn.Linear and layer.bias is None:
        return product(x, layer.weight)
    return layer(x)
