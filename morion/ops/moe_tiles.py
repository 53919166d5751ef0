"""The fused MoE kernels' tiles per device and expert shape (ops/moe_decode_triton.py).

Tiles are tuned on the device by `python -m morion.ops.moe_tune` and kept as JSON files in
`morion/ops/moe_configs/`, one per (device name, E, H, I, weight dtype), as SGLang and vLLM keep their
fused-MoE configs. A shape without a file runs the kernels' default tiles. One file holds one tile per
kernel for every token count: tiles never depend on T, so a token's result does not depend on its batch.
A file may also hold a "grouped" entry (ops/moe_tune_grouped.py): the grouped kernels' rows and tiles for
prefill chunks, where batch invariance is not asked for (`tuned_grouped_tiles`).
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import NamedTuple

import torch

CONFIG_DIR = Path(__file__).parent / "moe_configs"


class Tiles(NamedTuple):
    """One kernel's tile: BLOCK_N output columns, BLOCK_K reduction columns, launch options, and how the
    rows meet the weights (`mma`): "dot" (tl.dot, 16 token rows on the MMA's M side), "swapped" (tl.dot
    with the operands swapped: the tile's weight columns on the M side, big enough for Hopper's wgmma,
    the few token rows on its N side), "gemv" (no MMA: one row at a time, fp32 products summed on the
    CUDA cores) or "gemv_acc" (the FP8 and bf16 MoE decode kernels only: as "gemv", each product kept
    per (K position, column) across the K tiles and summed over K once at the end). `expand`, read by
    the NVFP4 kernels only (ops/moe_nvfp4_triton.py): how 4-bit codes become weights, "byte" (each code
    byte gathers its block scale) or "group" (a tile's block scales loaded once each and broadcast over
    their 16 columns). `split_k`, read by the decode kernels (FP8, bf16 and NVFP4; the grouped ones
    refuse it): how many programs share a column block's K (each sums a fixed slice of whole BLOCK_K
    tiles into an fp32 partial, a small kernel adds the partials in slice order: ops/moe_split_k.py), so
    one token still fills the GPU; 1 runs K in one program. Files written before a field existed list
    fewer values: the defaults apply."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    mma: str = "dot"
    expand: str = "byte"
    split_k: int = 1


class ExpertShape(NamedTuple):
    experts: int
    hidden: int
    intermediate: int
    dtype: str  # "fp8", "nvfp4", "bfloat16", ...


def expert_shape(gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> ExpertShape:
    """The shape of stacked experts gate_up_proj [E, 2I, H], down_proj [E, H, I] (NVFP4: uint8 codes, two
    a byte: down_proj [E, H, I/2])."""
    if gate_up_proj.dtype == torch.uint8:
        return ExpertShape(down_proj.shape[0], down_proj.shape[1], down_proj.shape[2] * 2, "nvfp4")
    return ExpertShape(down_proj.shape[0], down_proj.shape[1], down_proj.shape[2], dtype_name(gate_up_proj))


def dtype_name(weight: torch.Tensor) -> str:
    """How tuned files name a weight's dtype: "fp8" for e4m3, else torch's name ("bfloat16", ...)."""
    return "fp8" if weight.element_size() == 1 else str(weight.dtype).removeprefix("torch.")


def config_path(device_name: str, shape: ExpertShape, directory: Path | None = None) -> Path:
    """The file of this device and shape in `directory` (default CONFIG_DIR)."""
    name = f"{device_slug(device_name)}_E{shape.experts}_H{shape.hidden}_I{shape.intermediate}_{shape.dtype}"
    return (directory or CONFIG_DIR) / f"{name}.json"


def device_slug(device_name: str) -> str:
    """The device's name as tuned files spell it ("NVIDIA H200" -> "NVIDIA_H200")."""
    return re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_")


@functools.cache
def device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


class GroupedTiles(NamedTuple):
    """The grouped kernels' choice (prefill: ops/moe_decode_triton.py's grouped mode): rows of one expert
    a tile, how many FP8 products the tensor core sums before they join the fp32 sum (`promote_k`), and
    each kernel's tile. `faster` (tuned files only): whether the tuner measured them ahead of torch's
    grouped GEMMs at every token count it timed, which is when `--moe-kernel auto` runs them
    (layers/moe.py)."""

    block_m: int
    promote_k: int
    gate_up: Tiles
    down: Tiles
    faster: bool = False


def _tuned_config(device: str, shape: ExpertShape) -> dict | None:
    path = config_path(device, shape)
    return json.loads(path.read_text()) if path.exists() else None


@functools.cache
def tuned_tiles(device: str, shape: ExpertShape) -> tuple[Tiles, Tiles] | None:
    """(gate_up, down) decode tiles from the tuned file of this device and shape; None without one (or a
    file holding grouped tiles only). Read once per process (the first call is in a warm-up forward,
    never inside a CUDA-graph capture)."""
    config = _tuned_config(device, shape)
    if config is None or "gate_up" not in config:
        return None
    return Tiles(*config["gate_up"]), Tiles(*config["down"])


@functools.cache
def tuned_grouped_tiles(device: str, shape: ExpertShape) -> GroupedTiles | None:
    """The grouped kernels' tiles from the tuned file's "grouped" entry (ops/moe_tune_grouped.py); None
    without one. Read once per process, as `tuned_tiles`."""
    config = _tuned_config(device, shape)
    grouped = (config or {}).get("grouped")
    if grouped is None:
        return None
    return GroupedTiles(
        grouped["block_m"],
        grouped["promote_k"],
        Tiles(*grouped["gate_up"]),
        Tiles(*grouped["down"]),
        # NVFP4 experts have no torch path to beat: their entry has no torch times, and is never "faster".
        faster=all(
            us < grouped.get("torch_us_per_call", {}).get(t, 0.0) for t, us in grouped["us_per_call"].items()
        ),
    )


def tuned_tiles_on(
    device: torch.device, gate_up_proj: torch.Tensor, down_proj: torch.Tensor
) -> tuple[Tiles, Tiles] | None:
    """The tuned decode tiles for these stacked experts on `device`: its file's, on CUDA; else None."""
    name = _cuda_device_name(device)
    return None if name is None else tuned_tiles(name, expert_shape(gate_up_proj, down_proj))


def tuned_grouped_on(
    device: torch.device, gate_up_proj: torch.Tensor, down_proj: torch.Tensor
) -> GroupedTiles | None:
    """The tuned grouped entry for these stacked experts on `device`: its file's, on CUDA; else None."""
    name = _cuda_device_name(device)
    return None if name is None else tuned_grouped_tiles(name, expert_shape(gate_up_proj, down_proj))


def _cuda_device_name(device: torch.device) -> str | None:
    if device.type != "cuda":
        return None
    return device_name(device.index if device.index is not None else torch.cuda.current_device())
