"""Tunes the fused MoE kernels' tiles for this GPU and one expert shape; writes ops/moe_tiles.py's file.

    python -m morion.ops.moe_tune --experts 512 --hidden 2048 --intermediate 512 --top-k 10 --dtype fp8

`--dtype nvfp4` tunes the NVFP4 decode kernels (ops/moe_nvfp4_triton.py) the same way, each candidate
tile in both code expansions (`Tiles.expand`: a block scale per byte or per 16-column group), the GEMV
tiles also with K split over 2, 4 and 8 programs (`Tiles.split_k`).

Random experts of the shape (FP8: quantized per (expert, row); NVFP4: per (expert, projection); as the
loader does), and for each token count of `--tokens` 20 random routings (different experts per call, so
weights come from HBM as in a decode step, not from L2); `--shared-expert` routes every token's last slot
to the last expert, as the presets route their stacked shared expert (E = 513, top-11), whose rows the
kernels then meet T at a time. A candidate's cost is the sum over those token counts of the microseconds
per call, timed as CUDA-graph replays (what decode and verify steps run). The gate/up tile is swept with
the default down tile, then the down tile with the best gate/up one; then each again over warp counts and
pipeline depths around the chosen block shapes (`launch_variants`), FP8 and bf16 experts' also with K
split over several programs (`split_variants`). One tile per kernel for every token count (batch
invariance: see ops/moe_tiles.py). A candidate's output must agree with the default tiles'
within `AGREEMENT` (another tile sums in another order, nothing else), or it is refused. Prints one line
per candidate, writes the JSON with the default tiles' and the chosen tiles' timings, and prints its
path.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
import triton
from triton.runtime.errors import OutOfResources

from morion.ops.fp8 import quantize_fp8
from morion.ops.moe_decode_triton import DOWN_TILES, GATE_UP_TILES, exact_mma, moe_experts_triton
from morion.ops.moe_nvfp4_triton import DECODE_DOWN_TILES, DECODE_GATE_UP_TILES, moe_experts_nvfp4
from morion.ops.moe_tiles import CONFIG_DIR, ExpertShape, Tiles, config_path, tuned_tiles
from morion.ops.nvfp4 import quantize_nvfp4_parts

# Candidates: BLOCK_N x BLOCK_K x stages, 4 warps, in each of the three MMA modes (Tiles.mma; swapped
# operands put BLOCK_N on the MMA's M side: 64 columns and up; never with FP8 weights, `exact_mma`); the
# defaults are among them. The down kernel also tries one-pass tiles (BLOCK_K spanning all of I,
# `down_candidates`).
GATE_UP_CANDIDATES = [
    *(Tiles(n, k, 4, s) for n in (16, 32, 64, 128) for k in (128, 256, 512) for s in (3, 4)),
    *(Tiles(n, k, 4, s, "swapped") for n in (64, 128) for k in (128, 256) for s in (3, 4)),
    *(Tiles(n, k, 4, 3, "gemv") for n in (16, 32, 64) for k in (128, 256)),
]
TWO_PASS_DOWN_CANDIDATES = [
    *(Tiles(n, k, 4, s) for n in (64, 128, 256) for k in (64, 128) for s in (2, 3)),
    *(Tiles(n, k, 4, 3, "swapped") for n in (64, 128, 256) for k in (64, 128)),
    *(Tiles(n, k, 4, 3, "gemv") for n in (32, 64, 128) for k in (64, 128)),
]


# Narrow GEMV tiles for the down kernel at one token, where its grid is k pairs x H / BLOCK_N programs that
# each stream a [I, BLOCK_N] slice: with a K of only I = 512 a program's slice is small, so more, narrower
# programs, or one pass over all of I, put more bytes in flight. Session 40's profiles: on the 80B the down
# kernel reads half of gate_up's bytes but ran at 1.3 TB/s against gate_up's 2.1 on the H200 (tuned; 0.6
# against 1.9 on an H100, defaults): results/2026-12-05-session-40-notes.md. Timed on an H100 with the
# H200's gate_up tile (scripts/moe_down_ab.py), the best of them, 32 columns in one pass at 2 warps, took
# 25.6 us a call at one token against 27.9 for the H200's shipped down tile and 26.4 for its tuned one, even
# at four: the tile's shape is not what holds the down kernel back. They stay candidates.
NARROW_GEMV_DOWN_CANDIDATES = [Tiles(16, k, 4, 3, "gemv") for k in (64, 128)]


def down_candidates(intermediate: int) -> list[Tiles]:
    """The two-pass tiles, then one-pass ones: BLOCK_K = I rounded up to a power of two (the whole
    [BLOCK_K, BLOCK_N] weight tile in flight at once; narrow MMA ones measured slower on the H200), as MMA
    tiles and as GEMV tiles of 16 to 64 columns."""
    full = triton.next_power_of_2(intermediate)
    one_pass = [Tiles(64, full, w, 1) for w in (4, 8)] + [Tiles(n, full, 4, 1, "gemv") for n in (16, 32, 64)]
    return TWO_PASS_DOWN_CANDIDATES + NARROW_GEMV_DOWN_CANDIDATES + one_pass


# "gemv_acc" tiles (FP8 and bf16 experts): a [BLOCK_K, BLOCK_N] fp32 accumulator a program, so at most
# 64 registers a thread at 4 warps (8 warps at 128 x 128); `launch_variants` tries the other warp counts.
GEMV_ACC_CANDIDATES = [
    *(Tiles(n, k, 4, s, "gemv_acc") for n, k in ((16, 256), (32, 128), (32, 256), (64, 128)) for s in (2, 3)),
    *(Tiles(128, 128, 8, s, "gemv_acc") for s in (2, 3)),
]


# K slices a program of the NVFP4 decode kernels (`Tiles.split_k`) tried with each GEMV tile: at one token
# their grid is k pairs x N / BLOCK_N column blocks, too few programs for the H200 (issue #25).
SPLIT_K = (1, 2, 4, 8)


def with_expansions(candidates: Sequence[Tiles], dtype: str) -> list[Tiles]:
    """The candidates, and for NVFP4 weights each once more with the codes expanded per block-scale group
    (`Tiles.expand`: the other kernels ignore it), and each GEMV tile with every `SPLIT_K`, the GEMV tiles
    first; for FP8 and bf16 weights `GEMV_ACC_CANDIDATES` too (the NVFP4 kernels refuse that mode)."""
    if dtype != "nvfp4":
        return [*candidates, *GEMV_ACC_CANDIDATES]
    expanded = [expanded for tiles in candidates for expanded in (tiles, tiles._replace(expand="group"))]
    # Split K for the GEMV tiles only: they won at one token, where split K is for, and are the cheapest to
    # compile and time (a kernel's 12 GEMV candidates become 48); split K on every tile would double a
    # sweep whose MMA tiles take longest. `launch_variants` keeps the chosen tile's split_k.
    expanded += [tiles._replace(split_k=s) for tiles in expanded if tiles.mma == "gemv" for s in SPLIT_K[1:]]
    # One token is where NVFP4 decodes and where its GEMV tiles won (the 80B's sweep, session 17); the MMA
    # tiles take the longest to compile and time. First, so a sweep cut short has timed the GEMV tiles.
    return sorted(expanded, key=lambda tiles: tiles.mma != "gemv")


def split_variants(tiles: Tiles, depth: int, dtype: str) -> list[Tiles]:
    """FP8 and bf16 experts (`dtype`; NVFP4's first round has split K already, `with_expansions`): `tiles`
    with K split over 2, 4 and 8 programs (ops/moe_split_k.py) at 2 and 4 warps, where its K (`depth`: H
    for gate_up, I for down) has at least that many BLOCK_K tiles (a one-pass down tile has one). Tried
    with the second round's launch variants, around the block shape the first chose: at one token its grid
    is about one wave of the H200's SMs (k pairs x N / BLOCK_N)."""
    if dtype == "nvfp4":
        return []
    k_tiles = -(-depth // tiles.block_k)
    return [
        tiles._replace(split_k=split, num_warps=warps)
        for split in SPLIT_K[1:]
        if split <= k_tiles
        for warps in (2, 4)
    ]


def launch_variants(tiles: Tiles) -> list[Tiles]:
    """`tiles` with each warp count and pipeline depth (the first sweeps keep 4 warps): the second round
    of the sweep, around the block shapes it chose. The chosen tile itself comes first."""
    variants = [tiles._replace(num_warps=w, num_stages=s) for w in (2, 4, 8) for s in (2, 3, 4, 5)]
    return [tiles, *(v for v in variants if v != tiles)]


ROUTINGS = 20
# A candidate's output against the default tiles' (relative L2 over a batch): other tiles sum in another
# fp32 order, so outputs differ by a bf16 ulp here and there (FP8: an activation may round to the next
# e4m3 value); a code, block scale or row read wrong is O(1).
AGREEMENT = 2**-7

Experts = dict[str, torch.Tensor]
Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def random_experts(shape: ExpertShape, device: torch.device, seed: int = 0) -> Experts:
    """gate_up [E, 2I, H], down [E, H, I] (fan-in scaled), with per-row scales when `shape.dtype` is fp8,
    as NVFP4 codes with their block and global scales when it is nvfp4."""
    generator = torch.Generator(device=device).manual_seed(seed)
    experts, hidden, inter = shape.experts, shape.hidden, shape.intermediate
    dtype = torch.bfloat16 if shape.dtype in ("fp8", "nvfp4") else getattr(torch, shape.dtype)
    weights = {
        name: torch.randn(size, device=device, dtype=dtype, generator=generator) * size[-1] ** -0.5
        for name, size in (("gate_up", (experts, 2 * inter, hidden)), ("down", (experts, hidden, inter)))
    }
    if shape.dtype == "nvfp4":
        gate_up = quantize_nvfp4_parts(weights["gate_up"], 2)
        down = quantize_nvfp4_parts(weights["down"], 1)
        return {
            "gate_up": gate_up.codes,
            "down": down.codes,
            "gate_up_scale": gate_up.block_scales,
            "down_scale": down.block_scales,
            "gate_up_scale_2": gate_up.global_scale,
            "down_scale_2": down.global_scale,
        }
    if shape.dtype != "fp8":
        return weights
    gate_up, gate_up_scale = quantize_fp8(weights["gate_up"], per_row=True)
    down, down_scale = quantize_fp8(weights["down"], per_row=True)
    return {"gate_up": gate_up, "down": down, "gate_up_scale": gate_up_scale, "down_scale": down_scale}


def random_batch(
    shape: ExpertShape, tokens: int, top_k: int, device: torch.device, seed: int, shared_expert: bool = False
) -> Batch:
    """hidden [T, H] bf16 and a renormalised softmax top-k routing over random router logits. With
    `shared_expert` the last of the E experts is a shared expert stacked after the routed ones (the
    presets' layout: layers/moe.py's `shared_slot`): every token's last slot, with a sigmoid-like weight,
    and the other k - 1 slots routed over the first E - 1."""
    generator = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(tokens, shape.hidden, device=device, generator=generator).to(torch.bfloat16)
    routed = shape.experts - 1 if shared_expert else shape.experts
    chosen = top_k - 1 if shared_expert else top_k
    logits = torch.randn(tokens, routed, device=device, generator=generator)
    weights, ids = torch.softmax(logits, dim=-1).topk(chosen, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    if shared_expert:
        gate = torch.rand(tokens, 1, device=device, generator=generator)
        weights = torch.cat((weights, gate), dim=-1)
        ids = torch.cat((ids, torch.full_like(ids[:, :1], routed)), dim=-1)
    return hidden, weights.to(torch.bfloat16), ids


def run_experts(
    fn: Callable[..., torch.Tensor],
    experts: Experts,
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    **options,
) -> torch.Tensor:
    """`fn` (a `moe_experts_*` op) on one batch, with the experts' scales where they have them."""
    names = ("gate_up_scale", "down_scale", "gate_up_scale_2", "down_scale_2")
    scales = {k: experts[k] for k in names if k in experts}
    return fn(hidden, experts["gate_up"], experts["down"], topk_weights, topk_ids, **scales, **options)


def capture_graph(step: Callable[[], object], warmups: int = 2) -> torch.cuda.CUDAGraph:
    """`step` warmed up on a side stream (compiles the kernels; a capture must not), then captured."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def graph_microseconds(step: Callable[[], object], calls: int) -> float:
    """Microseconds per call of `step`, which makes `calls` calls: captured in a CUDA graph, median over
    10 replays (CUDA events)."""
    graph = capture_graph(step)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def time_in_graph(
    fn: Callable[..., torch.Tensor], experts: Experts, batches: Sequence[Batch], **options
) -> float:
    """Microseconds per call: one graph calls `fn` once per batch (`graph_microseconds`)."""
    return graph_microseconds(
        lambda: [run_experts(fn, experts, *batch, **options) for batch in batches], len(batches)
    )


Candidate = TypeVar("Candidate", bound=tuple)


def best_tiles(
    candidates: Sequence[Candidate],
    time_of: Callable[[Candidate], dict[int, float]],
    label: str,
    rows: str = "T",
) -> tuple[Candidate, dict[int, float]]:
    """The candidate with the least summed time over the row counts (`time_of`: microseconds per row
    count), and its times; one line per candidate on stderr, prefixed by `label`. A candidate that does
    not compile (raised in the warm-up, before any capture) is skipped."""
    best: tuple[float, Candidate, dict[int, float]] | None = None
    for tiles in candidates:
        try:
            times = time_of(tiles)
        except OutOfResources as error:
            print(f"{label} {tuple(tiles)}: skipped, {error}", file=sys.stderr)
            continue
        listed = ", ".join(f"{rows}={t} {us:.1f} us" for t, us in times.items())
        print(f"{label} {tuple(tiles)}: {listed}", file=sys.stderr)
        if best is None or sum(times.values()) < best[0]:
            best = (sum(times.values()), tiles, times)
    if best is None:
        raise RuntimeError(f"{label}: no candidate tile compiled")
    return best[1], best[2]


def disagreement(
    fn: Callable[..., torch.Tensor],
    experts: Experts,
    batches: dict[int, list[Batch]],
    reference: dict[int, torch.Tensor],
    **options,
) -> str | None:
    """Why `fn` with `options` does not give `reference` (the default tiles' output on each token count's
    first batch) within `AGREEMENT`, or None."""
    for t, batch in batches.items():
        got, want = run_experts(fn, experts, *batch[0], **options).float(), reference[t].float()
        error = ((got - want).norm() / want.norm()).item()
        if not error <= AGREEMENT:  # NaN disagrees too
            return f"T={t}: relative L2 {error:.3g} from the default tiles' output"
    return None


def sweep_kernel(
    fn: Callable[..., torch.Tensor],
    kernel: str,
    candidates: Sequence[Tiles],
    fixed: dict[str, Any],
    experts: Experts,
    batches: dict[int, list[Batch]],
    reference: dict[int, torch.Tensor],
) -> tuple[Tiles, dict[int, float]]:
    """The best of `candidates` for `kernel` with the other kernel's tile (and any other option of `fn`)
    `fixed` (`best_tiles`); one whose output disagrees with `reference` is refused (never chosen)."""

    def time_of(tiles: Tiles) -> dict[int, float]:
        options = {**fixed, f"{kernel}_tiles": tiles}
        error = disagreement(fn, experts, batches, reference, **options)
        if error is not None:
            print(f"moe tune {kernel} {tuple(tiles)}: refused, {error}", file=sys.stderr)
            return {t: math.inf for t in batches}
        return {t: time_in_graph(fn, experts, b, **options) for t, b in batches.items()}

    chosen, times = best_tiles(candidates, time_of, f"moe tune {kernel}")
    if math.isinf(sum(times.values())):
        raise RuntimeError(f"moe tune {kernel}: every candidate disagreed with the default tiles")
    return chosen, times


def tune(
    shape: ExpertShape,
    top_k: int,
    tokens: Sequence[int],
    device: torch.device,
    shared_expert: bool = False,
    shipped: tuple[Tiles, Tiles] | None = None,
) -> dict:
    """The tuned config (the JSON written by `main`); `shared_expert` as `random_batch`'s. `shipped`: the
    (gate_up, down) tiles of the file that serving reads now, timed on the same batches
    (`shipped_us_per_call`), so that a new file replaces it only where it is faster."""
    experts = random_experts(shape, device)
    batches = {
        t: [random_batch(shape, t, top_k, device, 1000 * t + i, shared_expert) for i in range(ROUTINGS)]
        for t in tokens
    }
    if shape.dtype == "nvfp4":
        fn = moe_experts_nvfp4
        defaults = {"gate_up_tiles": DECODE_GATE_UP_TILES, "down_tiles": DECODE_DOWN_TILES}
    else:
        fn = moe_experts_triton
        width = experts["gate_up"].element_size()
        defaults = {"gate_up_tiles": GATE_UP_TILES[width], "down_tiles": DOWN_TILES[width]}

    def rounded_times(options: dict[str, Tiles]) -> dict[str, float]:
        return {str(t): round(time_in_graph(fn, experts, b, **options), 2) for t, b in batches.items()}

    default_us = rounded_times(defaults)
    shipped_entries = {}
    if shipped is not None:
        shipped_entries = {
            "shipped": {"gate_up": list(shipped[0]), "down": list(shipped[1])},
            "shipped_us_per_call": rounded_times({"gate_up_tiles": shipped[0], "down_tiles": shipped[1]}),
        }
    reference = {t: run_experts(fn, experts, *b[0], **defaults) for t, b in batches.items()}
    fixed_down = {"down_tiles": defaults["down_tiles"]}
    fp8 = shape.dtype == "fp8"
    gate_up_candidates = with_expansions([t for t in GATE_UP_CANDIDATES if exact_mma(t, fp8)], shape.dtype)
    down_tiles = with_expansions(
        [t for t in down_candidates(shape.intermediate) if exact_mma(t, fp8)], shape.dtype
    )
    sweep = functools.partial(sweep_kernel, fn, experts=experts, batches=batches, reference=reference)
    gate_up, _ = sweep("gate_up", gate_up_candidates, fixed_down)
    down, _ = sweep("down", down_tiles, {"gate_up_tiles": gate_up})
    gate_up_round = launch_variants(gate_up) + split_variants(gate_up, shape.hidden, shape.dtype)
    gate_up, _ = sweep("gate_up", gate_up_round, {"down_tiles": down})
    down_round = launch_variants(down) + split_variants(down, shape.intermediate, shape.dtype)
    down, chosen_us = sweep("down", down_round, {"gate_up_tiles": gate_up})
    return {
        "device": torch.cuda.get_device_name(device),
        **shape._asdict(),
        "top_k": top_k,
        "shared_expert": shared_expert,
        "gate_up": list(gate_up),
        "down": list(down),
        "us_per_call": {str(t): round(us, 2) for t, us in chosen_us.items()},
        "default_us_per_call": default_us,
        **shipped_entries,
        "torch": torch.__version__,
        "triton": triton.__version__,
    }


def write_tuned(config: dict, path: Path) -> str:
    """Writes a tuner's config (with `us_per_call` and `default_us_per_call` per token count) as JSON at
    `path`, its folder made; returns those timings as one line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=2) + "\n")
    shipped = config.get("shipped_us_per_call", {})
    return ", ".join(
        f"T={t} {us} us (default {config['default_us_per_call'][t]}"
        + (f", shipped file {shipped[t]}" if t in shipped else "")
        + ")"
        for t, us in config["us_per_call"].items()
    )


def tuner_arguments(
    prog: str, doc: str, dtypes: Sequence[str], tokens: str, argv: Sequence[str] | None
) -> tuple[argparse.Namespace, ExpertShape, list[int]]:
    """The MoE tuners' command line (this one's, ops/moe_tune_grouped.py's): the expert shape, the token
    counts (default `tokens`), `--shared-expert` and `--out`; checked, with a CUDA device required."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.split("\n")[0])
    parser.add_argument("--experts", type=int, required=True)
    parser.add_argument("--hidden", type=int, required=True)
    parser.add_argument("--intermediate", type=int, required=True)
    parser.add_argument("--top-k", type=int, required=True)
    parser.add_argument("--dtype", default="fp8", choices=dtypes)
    parser.add_argument("--tokens", default=tokens, help="token counts whose summed time is minimised")
    parser.add_argument(
        "--shared-expert",
        action="store_true",
        help="the last expert is a shared expert stacked after the routed ones (the presets' E = 513): "
        "every token's last slot",
    )
    parser.add_argument("--out", type=Path, default=CONFIG_DIR, help="directory of the JSON file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("tuning needs a CUDA device")
    try:
        token_counts = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        token_counts = []
    if not token_counts or min(token_counts) < 1:
        parser.error(f"--tokens must be positive integers separated by commas, got {args.tokens!r}")
    if args.shared_expert and args.top_k < 2:
        parser.error("--shared-expert needs --top-k of at least 2 (the routed slots and the shared one)")
    shape = ExpertShape(args.experts, args.hidden, args.intermediate, args.dtype)
    return args, shape, token_counts


def main(argv: Sequence[str] | None = None) -> None:
    args, shape, tokens = tuner_arguments(
        "python -m morion.ops.moe_tune", __doc__, ("fp8", "nvfp4", "bfloat16"), "1,4", argv
    )
    device = torch.device("cuda", torch.cuda.current_device())
    shipped = tuned_tiles(torch.cuda.get_device_name(device), shape)
    config = tune(shape, args.top_k, tokens, device, args.shared_expert, shipped)
    path = config_path(config["device"], shape, args.out)
    chosen = write_tuned(config, path)
    print(f"moe tune: gate_up {config['gate_up']}, down {config['down']}: {chosen}; wrote {path}")


if __name__ == "__main__":
    main()
