"""Tunes the hyper-connection mix kernels' tiles for this GPU and a mix shape; writes ops/hc_tiles.py's file.

    python -m morion.ops.hc_tune --hidden 2560 --lowrank 320 --streams 4   # Qwen3.8-Flash-Next

Random bf16 weights of the shape (fan-in scaled), `ROTATIONS` sets of them: more bytes than L2 holds, so
each call reads its weights from HBM, as the 96 mixes of a decode step do. A candidate's cost is the sum
over `--tokens` of the microseconds per mix, timed as CUDA-graph replays. Kernel 1's tile is swept with
kernel 2's default, then kernel 2's with the chosen kernel-1 tile. A candidate's mix must agree with the
default tiles' within `TOLERANCE` (another tile sums in another order, nothing else), or it is refused.
Prints one line per candidate, writes the JSON with the default and the chosen tiles' timings, and prints
its path.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
import triton

from morion.ops.hc_tiles import CONFIG_DIR, DEFAULT_MIX_TILES, MixShape, MixTiles, config_path
from morion.ops.hyper_connection_triton import mix
from morion.ops.moe_tune import best_tiles, graph_microseconds, write_tuned

# Kernel 1: rows per program x K step x warps x pipeline stages; kernel 2: hidden columns per program x R
# step x warps x stages. The accumulators are [2 tokens, rows, step] fp32 (kernel 2: rows of the n streams):
# 32 to 64 a thread, fewer for the small tiles allowed at 4 warps (the bounds were drawn for blocks of 4
# tokens, twice that). Stages 1 (the plain loop), 3 and 6: at Flash-Next's shape 6 puts a whole stream's K
# (5 steps of 512) or the whole R (5 steps of 64) in flight at once, 3 the whole loop at steps of 1024 or
# 128. Rows per program from 2 (644 kernel-1 programs, ~5 an SM of the H200's 132) to 8; columns from 4
# (640 kernel-2 programs) to 16 (160). Kernel 2 also takes all of R in one step (512 > 320, masked), its
# loads then all issued together.
DOWN_CANDIDATES = [
    (n, k, w, s)
    for n in (2, 4, 8)
    for k in (256, 512, 1024)
    for w in (4, 8)
    for s in (1, 3, 6)
    if 512 * w <= n * k <= 1024 * w or (w == 4 and n * k <= 4096)
]
UP_CANDIDATES = [
    (c, r, w, s)
    for c in (4, 8, 16)
    for r in (32, 64, 128)
    for w in (4, 8)
    for s in (1, 3, 6)
    if 128 * w <= c * r <= 256 * w or (w == 4 and c * r <= 1024)
] + [(2, 512, 4, 2), (4, 512, 8, 2)]
ROTATIONS = 8
EPS = 1e-6
TOLERANCE = 2**-6  # absolute and relative: a few bf16 ulps of values of order one


class Disagrees(RuntimeError):
    """A candidate whose mix is not the default tiles' up to the summation order."""


def random_mixes(shape: MixShape, device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    """`ROTATIONS` weight sets (norm weight, W_down, W_up, W_inject) of the shape."""
    generator = torch.Generator(device=device).manual_seed(0)
    width, dtype = shape.streams * shape.hidden, getattr(torch, shape.dtype)

    def weight(*size: int) -> torch.Tensor:
        values = torch.randn(size, device=device, generator=generator) * size[-1] ** -0.5
        return values.to(dtype)

    lowrank, streams = shape.lowrank, shape.streams
    return [
        (weight(width) * 0.1, weight(lowrank, width), weight(width, lowrank), weight(streams, width))
        for _ in range(ROTATIONS)
    ]


Outputs = list[tuple[torch.Tensor, torch.Tensor | None]]  # (block input, inject weights) of each mix


def run_mixes(
    shape: MixShape, mixes: list[tuple[torch.Tensor, ...]], streams: torch.Tensor, tiles: MixTiles
) -> Outputs:
    return [mix(streams, *weights, shape.streams, EPS, tiles=tiles) for weights in mixes]


def time_tiles(
    shape: MixShape,
    mixes: list[tuple[torch.Tensor, ...]],
    inputs: dict[int, torch.Tensor],
    reference: dict[int, Outputs],
    tiles: MixTiles,
) -> dict[int, float]:
    """Microseconds per mix for each token count; raises `Disagrees` when the outputs are not `reference`'s
    (the default tiles') up to `TOLERANCE`."""
    for t, streams in inputs.items():
        for got, want in zip(run_mixes(shape, mixes, streams, tiles), reference[t], strict=True):
            for a, b in zip(got, want, strict=True):
                if not torch.allclose(a.float(), b.float(), rtol=TOLERANCE, atol=TOLERANCE):
                    raise Disagrees(
                        f"{tiles}: max difference {(a.float() - b.float()).abs().max().item():.3g}"
                    )
    return {
        t: graph_microseconds(lambda streams=streams: run_mixes(shape, mixes, streams, tiles), len(mixes))
        for t, streams in inputs.items()
    }


def tune(shape: MixShape, tokens: Sequence[int], device: torch.device) -> dict:
    """The tuned config (the JSON written by `main`)."""
    mixes = random_mixes(shape, device)
    generator = torch.Generator(device=device).manual_seed(1)
    width, dtype = shape.streams * shape.hidden, getattr(torch, shape.dtype)
    inputs = {t: torch.randn(t, width, device=device, generator=generator).to(dtype) for t in tokens}
    reference = {t: run_mixes(shape, mixes, streams, DEFAULT_MIX_TILES) for t, streams in inputs.items()}

    def time_of(tiles: MixTiles) -> dict[int, float]:
        try:
            return time_tiles(shape, mixes, inputs, reference, tiles)
        except Disagrees as error:  # best_tiles skips only candidates that do not compile: never chosen
            print(f"hc tune: refused, {error}", file=sys.stderr)
            return {t: math.inf for t in tokens}

    default_us = time_of(DEFAULT_MIX_TILES)
    down = [
        DEFAULT_MIX_TILES._replace(down_block_n=n, down_block_k=k, down_warps=w, down_stages=s)
        for n, k, w, s in DOWN_CANDIDATES
    ]
    chosen, _ = best_tiles(down, time_of, "hc tune down")
    up = [
        chosen._replace(up_block_c=c, up_block_r=r, up_warps=w, up_stages=s) for c, r, w, s in UP_CANDIDATES
    ]
    chosen, chosen_us = best_tiles(up, time_of, "hc tune up")
    if math.isinf(sum(chosen_us.values())):
        raise RuntimeError("hc tune: every candidate disagreed with the default tiles")
    return {
        "device": torch.cuda.get_device_name(device),
        **shape._asdict(),
        "tiles": chosen._asdict(),
        "us_per_call": {str(t): round(us, 2) for t, us in chosen_us.items()},
        "default_us_per_call": {str(t): round(us, 2) for t, us in default_us.items()},
        "torch": torch.__version__,
        "triton": triton.__version__,
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m morion.ops.hc_tune", description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, required=True, help="one stream's width H")
    parser.add_argument("--lowrank", type=int, required=True, help="W_down's rows R")
    parser.add_argument("--streams", type=int, required=True, help="hyper-connection streams n")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    parser.add_argument("--tokens", default="1,4", help="token counts whose summed time is minimised")
    parser.add_argument("--out", type=Path, default=CONFIG_DIR, help="directory of the JSON file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("tuning needs a CUDA device")
    shape = MixShape(args.hidden, args.lowrank, args.streams, args.dtype)
    device = torch.device("cuda", torch.cuda.current_device())
    config = tune(shape, [int(t) for t in args.tokens.split(",")], device)
    path = config_path(config["device"], shape, args.out)
    print(f"hc tune: {config['tiles']}: {write_tuned(config, path)}; wrote {path}")


if __name__ == "__main__":
    main()
