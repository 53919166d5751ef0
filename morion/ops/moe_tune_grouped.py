"""Tunes the MoE grouped kernels (prefill chunks) for this GPU and one expert shape and records them in the
device's tuned file (ops/moe_tiles.py): the fused kernels' grouped mode (ops/moe_decode_triton.py) for FP8
and bf16 experts, against torch's grouped GEMMs; NVFP4's grouped kernels (ops/moe_nvfp4_triton.py).

    python -m morion.ops.moe_tune_grouped --experts 513 --hidden 2048 --intermediate 512 --top-k 11 \\
        --shared-expert --tokens 1024,4096

Random experts and routings as ops/moe_tune.py makes them, GROUPED_ROUTINGS per token count (one call of
a prefill chunk reads about every expert already). The sweep: rows of one expert per tile (`block_m`)
with each FP8 promotion interval (`promote_k`: FP8 weights only) on the default tiles (at 8 warps for
128 rows); then the gate/up tiles (NVFP4: in both code expansions), the down tiles with the chosen gate/up
one, and each kernel's warp counts and pipeline depths around its choice. A candidate's cost is its
microseconds per call summed over the token counts (CUDA-graph replays); its output must agree with the
default tiles' with exact fp32 sums (`promote_k` 0) within moe_tune's AGREEMENT, or it is refused.
torch's grouped GEMMs (`moe_experts_grouped`, what `--moe-kernel auto` runs otherwise for FP8 and bf16
experts) are timed on the same batches: the entry records both, and `auto` runs the grouped mode only
where it was faster at every token count (`GroupedTiles.faster`). NVFP4 experts always run their own
grouped kernels, with the entry's rows and tiles where there is one. The entry ("grouped") joins the
file's decode tiles, which stay as they were; prints one line per candidate and the file's path.
"""

from __future__ import annotations

import functools
import json
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import torch
import triton

from morion.ops.moe import moe_experts_grouped
from morion.ops.moe_decode_triton import (
    GROUPED_BLOCK_M,
    GROUPED_PROMOTE_K,
    GROUPED_TILES,
    moe_experts_triton,
)
from morion.ops.moe_nvfp4_triton import GROUPED_TILES as NVFP4_GROUPED_TILES
from morion.ops.moe_nvfp4_triton import moe_experts_nvfp4
from morion.ops.moe_tiles import ExpertShape, Tiles, config_path
from morion.ops.moe_tune import (
    best_tiles,
    disagreement,
    random_batch,
    random_experts,
    run_experts,
    sweep_kernel,
    time_in_graph,
    tuner_arguments,
)

GROUPED_ROUTINGS = 4
# At 4K tokens an expert of the 80B has ~80 rows: 64-row tiles read its weights twice, 128-row ones once.
BLOCK_M_CANDIDATES = (16, 32, 64, 128)
# FP8 products the tensor core sums before they join the fp32 sum: after every MMA instruction (exact),
# or every 128 (CUTLASS's interval), capped at the tile's BLOCK_K by the kernels.
PROMOTE_K_CANDIDATES = (0, 128)
GATE_UP_CANDIDATES = [Tiles(n, k, 4, s) for n in (64, 128) for k in (64, 128) for s in (3, 4)]
DOWN_CANDIDATES = [Tiles(n, k, 4, s) for n in (64, 128, 256) for k in (64, 128) for s in (3, 4)]


class RowTiles(NamedTuple):
    block_m: int
    promote_k: int


def with_warps_for(tiles: Tiles, block_m: int) -> Tiles:
    """`tiles` at 8 warps for 128-row tiles, whose two [128, BLOCK_N] fp32 accumulators (gate and up)
    would spill at 4: the candidates' first rounds then compare such rows at their best warp count."""
    return tiles._replace(num_warps=8) if block_m >= 128 else tiles


def launch_variants(tiles: Tiles) -> list[Tiles]:
    """`tiles` with 4 and 8 warps and 2 to 5 pipeline stages (the chosen tile first): wide prefill tiles
    keep a [block_m, BLOCK_N] accumulator a program, which 2 warps would spill."""
    variants = [tiles._replace(num_warps=w, num_stages=s) for w in (4, 8) for s in (2, 3, 4, 5)]
    return [tiles, *(v for v in variants if v != tiles)]


class Kernels(NamedTuple):
    """What a sweep runs for one weight format: the op, its default tiles and rows, the promotion
    intervals and code expansions to try."""

    fn: Callable[..., torch.Tensor]
    tiles: tuple[Tiles, Tiles]
    rows: RowTiles
    promotions: tuple[int, ...]
    expansions: tuple[str, ...]


def kernels_for(shape: ExpertShape, width: int) -> Kernels:
    """The fused kernels' grouped mode for FP8 and bf16 experts (`width`: bytes a weight element);
    NVFP4's grouped kernels (no promotion: they multiply in BF16; both code expansions, `Tiles.expand`)
    for NVFP4 ones."""
    if shape.dtype == "nvfp4":
        tiles = (NVFP4_GROUPED_TILES, NVFP4_GROUPED_TILES)
        return Kernels(moe_experts_nvfp4, tiles, RowTiles(GROUPED_BLOCK_M, 0), (0,), ("byte", "group"))
    promotions = PROMOTE_K_CANDIDATES if shape.dtype == "fp8" else (0,)
    rows = RowTiles(GROUPED_BLOCK_M, GROUPED_PROMOTE_K)
    return Kernels(moe_experts_triton, GROUPED_TILES[width], rows, promotions, ("byte",))


def tune_grouped(
    shape: ExpertShape, top_k: int, tokens: Sequence[int], device: torch.device, shared: bool
) -> dict:
    """The "grouped" entry of the tuned file: the chosen rows, promotion and tiles, with their times, the
    defaults' and (FP8 and bf16 experts) torch's grouped GEMMs' per token count."""
    experts = random_experts(shape, device)
    batches = {
        t: [
            random_batch(shape, t, top_k, device, 7000 + 1000 * t + i, shared)
            for i in range(GROUPED_ROUTINGS)
        ]
        for t in tokens
    }
    kernels = kernels_for(shape, experts["gate_up"].element_size())
    nvfp4 = shape.dtype == "nvfp4"
    gate_up, down = kernels.tiles

    def row_options(rows: RowTiles) -> dict:
        return {"grouped": True, "block_m": rows.block_m, **({} if nvfp4 else {"promote_k": rows.promote_k})}

    def times(**options) -> dict[int, float]:
        return {t: time_in_graph(kernels.fn, experts, b, **options) for t, b in batches.items()}

    # The reference: the default tiles with exact sums (no FP8 product summed in the tensor core).
    exact_rows = kernels.rows._replace(promote_k=0)
    base = {"gate_up_tiles": gate_up, "down_tiles": down}
    exact = {
        t: run_experts(kernels.fn, experts, *b[0], **base, **row_options(exact_rows))
        for t, b in batches.items()
    }

    def rows_time(rows: RowTiles) -> dict[int, float]:
        options = {
            "gate_up_tiles": with_warps_for(gate_up, rows.block_m),
            "down_tiles": with_warps_for(down, rows.block_m),
            **row_options(rows),
        }
        error = disagreement(kernels.fn, experts, batches, exact, **options)
        if error is not None:
            print(f"moe tune grouped {tuple(rows)}: refused, {error}", file=sys.stderr)
            return {t: math.inf for t in batches}
        return times(**options)

    default_us = times(**base, **row_options(kernels.rows))
    row_candidates = [RowTiles(m, k) for m in BLOCK_M_CANDIDATES for k in kernels.promotions]
    rows, _ = best_tiles(row_candidates, rows_time, "moe tune grouped rows")
    sweep = functools.partial(sweep_kernel, kernels.fn, experts=experts, batches=batches, reference=exact)
    fixed = row_options(rows)

    def candidates(tiles: Sequence[Tiles]) -> list[Tiles]:
        return [with_warps_for(t, rows.block_m)._replace(expand=e) for t in tiles for e in kernels.expansions]

    down = with_warps_for(down, rows.block_m)
    gate_up, _ = sweep("gate_up", candidates(GATE_UP_CANDIDATES), {**fixed, "down_tiles": down})
    down, _ = sweep("down", candidates(DOWN_CANDIDATES), {**fixed, "gate_up_tiles": gate_up})
    gate_up, _ = sweep("gate_up", launch_variants(gate_up), {**fixed, "down_tiles": down})
    down, chosen_us = sweep("down", launch_variants(down), {**fixed, "gate_up_tiles": gate_up})
    entry = {
        "block_m": rows.block_m,
        "promote_k": rows.promote_k,
        "gate_up": list(gate_up),
        "down": list(down),
        "top_k": top_k,
        "shared_expert": shared,
        "us_per_call": _rounded(chosen_us),
        "default_us_per_call": _rounded(default_us),
    }
    if not nvfp4:  # NVFP4 experts have no torch path: their kernels run whatever the entry says
        entry["torch_us_per_call"] = _rounded(
            {t: time_in_graph(moe_experts_grouped, experts, b) for t, b in batches.items()}
        )
    return {**entry, "torch": torch.__version__, "triton": triton.__version__}


def _rounded(times: dict[int, float]) -> dict[str, float]:
    return {str(t): round(us, 2) for t, us in times.items()}


def record_grouped(entry: dict, device_name: str, shape: ExpertShape, directory: Path) -> Path:
    """Writes `entry` as the "grouped" entry of this device and shape's tuned file in `directory`, keeping
    what the file held (its decode tiles); a new file also names the device and the shape."""
    path = config_path(device_name, shape, directory)
    config = json.loads(path.read_text()) if path.exists() else {"device": device_name, **shape._asdict()}
    config["grouped"] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=2) + "\n")
    return path


def summary(entry: dict) -> str:
    """One line: each token count's time against the defaults' and (where timed) torch's grouped GEMMs'."""
    torch_us = entry.get("torch_us_per_call", {})
    return ", ".join(
        f"T={t} {us} us (defaults {entry['default_us_per_call'][t]}"
        + (f", torch {torch_us[t]})" if t in torch_us else ")")
        for t, us in entry["us_per_call"].items()
    )


def main(argv: Sequence[str] | None = None) -> None:
    args, shape, tokens = tuner_arguments(
        "python -m morion.ops.moe_tune_grouped", __doc__, ("fp8", "nvfp4", "bfloat16"), "1024,4096", argv
    )
    device = torch.device("cuda", torch.cuda.current_device())
    entry = tune_grouped(shape, args.top_k, tokens, device, args.shared_expert)
    path = record_grouped(entry, torch.cuda.get_device_name(device), shape, args.out)
    chosen = (
        f"block_m {entry['block_m']}, promote_k {entry['promote_k']}, gate_up {entry['gate_up']}, "
        f"down {entry['down']}"
    )
    print(f"moe tune grouped: {chosen}: {summary(entry)}; wrote {path}")


if __name__ == "__main__":
    main()
