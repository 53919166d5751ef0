"""The hyper-connection mix kernels' tiles per device and mix shape (ops/hyper_connection_triton.py).

Qwen3.8-Flash-Next runs two mixes a layer, 96 a decode step, and on the H200 each took about 28 us
(`results/2026-12-03-h200-profile-flash-next-main.md`, C1: `_up_mix_kernel` 1.51 ms, and about 1.2 of the
2.02 ms listed as `_down_kernel`, a name the MoE's down kernel shares: ~2.7 ms of a 9.4 ms step) where its
~13 MB of weights take ~3 us at the card's bandwidth: the default tiles walk K in short steps, each
waiting for its loads. Tiles are tuned on the device by `python -m morion.ops.hc_tune` and
kept as JSON files in `morion/ops/hc_configs/`, one per (device name, H, R, n, dtype), as ops/moe_tiles.py
keeps the fused MoE kernels'; a shape without a file runs `DEFAULT_MIX_TILES`. Tiles never depend on the
token count, so a token's mix does not depend on its batch; another tile sums in another order, so a
tuned file changes the mix's last bits (within an ulp of the eager mix), the same in every batch.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import NamedTuple

import torch

from morion.ops.moe_tiles import device_slug

CONFIG_DIR = Path(__file__).parent / "hc_configs"


class MixTiles(NamedTuple):
    """Kernel 1 (`_down_kernel`): down_block_n rows of [W_down; W_inject] per program, its stream's H
    columns in down_block_k steps, down_warps warps. Kernel 2 (`_up_mix_kernel`): up_block_c hidden
    columns per program (n * up_block_c rows of W_up), R in up_block_r steps, up_warps warps.

    *_stages: the software pipelining of those loops (Triton's `tl.range(num_stages=...)`): with S > 1 a
    program copies the loads of S - 1 steps ahead into shared memory (cp.async) while it multiplies the
    current one, so up to S - 1 steps' bytes are in flight at once instead of one step's; 1 is the plain
    loop, each step waiting for its loads. The sums are the same at any depth."""

    down_block_n: int = 4
    down_block_k: int = 512
    down_warps: int = 4
    up_block_c: int = 16
    up_block_r: int = 32
    up_warps: int = 4
    down_stages: int = 1
    up_stages: int = 1


DEFAULT_MIX_TILES = MixTiles()


class MixShape(NamedTuple):
    hidden: int  # H, one stream's width
    lowrank: int  # R, W_down's rows
    streams: int  # n
    dtype: str  # the weights' torch dtype name ("bfloat16", ...)


def mix_shape(down: torch.Tensor, hc_count: int) -> MixShape:
    """The shape of a mix with W_down [R, n * H] over n streams."""
    lowrank, width = down.shape
    return MixShape(width // hc_count, lowrank, hc_count, str(down.dtype).removeprefix("torch."))


def config_path(device_name: str, shape: MixShape, directory: Path | None = None) -> Path:
    """The file of this device and shape in `directory` (default CONFIG_DIR)."""
    name = f"{device_slug(device_name)}_H{shape.hidden}_R{shape.lowrank}_N{shape.streams}_{shape.dtype}"
    return (directory or CONFIG_DIR) / f"{name}.json"


@functools.cache
def tuned_mix_tiles(device_name: str, shape: MixShape) -> MixTiles:
    """The tiles of the tuned file of this device and shape, `DEFAULT_MIX_TILES` without one. Read once per
    process, by the eager warm-up that compiles a decode shape's kernels before its graph is captured."""
    path = config_path(device_name, shape)
    if not path.exists():
        return DEFAULT_MIX_TILES
    return MixTiles(**json.loads(path.read_text())["tiles"])
