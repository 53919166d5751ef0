"""Times a model's decode-path linear shapes on this GPU, cuBLAS against the skinny Triton kernel's tiles,
and writes ops/skinny_tiles.py's file for each shape where the kernel is faster.

    python -m morion.bench.skinny_tune --model preset:qwen3-next-80b-a3b --weight-dtype fp8

The shapes are those of the model built on the meta device with `--weight-dtype` (nothing is loaded): every
FP8 linear layer (e4m3 rows and weights; the cuBLAS side is `torch._scaled_mm` plus the row-scale multiply it
needs), and the model-dtype products the decode path sends through `skinny_tiles.product`: the MoE router,
Gated DeltaNet's gates, QSA's indexer and PLE's projections (cuBLAS side: F.linear); and the merged weight of
each group of layers of one input that CUDA serving runs as one launch (layers/merged_linears.py). For each
shape and token count of `--tokens`, one CUDA graph calls the op once per weight copy, with enough copies to
exceed the L2 cache several times over (weights come from HBM, as in a decode step); microseconds per call are
the median of 10 replays. A candidate's cost is its sum over the token counts. The block shapes are swept with
4 warps, then warps and pipeline depths around the best (`moe_tune.launch_variants`), then that tile with K
split over 2, 4 and 8 programs (`moe_tune.split_variants`; a narrow product at one row otherwise fills a
fraction of the SMs, and the split's sum kernel costs a launch: the timing decides). An FP8 shape whose best
tile loses to cuBLAS gets no file (an earlier one is removed): it stays on cuBLAS. A model-dtype product
always gets its best tile (`skinny_tiles.INVARIANT_GEMV` among the candidates): it never runs cuBLAS at decode
sizes, for batch invariance, so the file can only make it faster. Prints one line per shape and the files
written.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from torch import nn

from morion.config import WEIGHT_DTYPES
from morion.layers.gated_delta_net import GatedDeltaNet
from morion.layers.linear_fp8 import Fp8Linear
from morion.layers.merged_linears import merged_shape
from morion.layers.moe import SparseMoE
from morion.layers.ple import PLELayer
from morion.layers.qsa_attention import QSAIndexer
from morion.models.presets import preset_config
from morion.models.registry import build_model
from morion.ops.fp8 import quantize_fp8, scaled_mm_rows
from morion.ops.moe_decode_triton import exact_mma
from morion.ops.moe_tiles import Tiles
from morion.ops.moe_tune import best_tiles, graph_microseconds, launch_variants, split_variants
from morion.ops.skinny_linear_triton import MAX_ROWS, skinny_linear
from morion.ops.skinny_tiles import CONFIG_DIR, INVARIANT_GEMV, LinearShape, config_path, linear_shape

# Block shapes swept first (4 warps): GEMV tiles (one row at a time on the CUDA cores), tl.dot tiles (16
# rows on the MMA's M side) and, for model-dtype weights, swapped tl.dot (never with FP8: `exact_mma`).
# GEMV tiles hold BLOCK_N x BLOCK_K fp32 products: at most 16K of them (128 registers a thread at 4 warps).
CANDIDATES = [
    *(Tiles(n, k, 4, 3, "gemv") for n, k in ((16, 256), (32, 128), (32, 256), (64, 64), (64, 128))),
    Tiles(128, 64, 4, 3, "gemv"),
    *(Tiles(n, k, 4, 3, "dot") for n in (32, 64, 128) for k in (128, 256)),
    *(Tiles(n, k, 4, 3, "swapped") for n in (64, 128) for k in (64, 128)),
]
# Weight bytes each timed graph streams: 8x the H200's 50 MB L2.
_STREAM_BYTES = 400 << 20
_MAX_COPIES = 64

Op = Callable[[torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]


def model_shapes(model: str, weight_dtype: str) -> list[LinearShape]:
    """The distinct decode-path linear shapes of `model` (a preset name or a config.json path)."""
    config = preset_config(model) if model.startswith("preset:") else json.loads(Path(model).read_text())
    built = build_model(config, torch.bfloat16, torch.device("meta"), weight_dtype)
    return sorted(set(shapes_of(built)))


def shapes_of(model: nn.Module) -> list[LinearShape]:
    """Each FP8 linear with cuBLASLt shapes and the model-dtype products of a decode step that go through
    `skinny_tiles.product`: each router (a stacked shared expert's gate row included), QSA's indexer
    projection, Gated DeltaNet's plain in_proj_ba (or in_proj_b and in_proj_a), PLE's key and value
    projections; and the merged weight of each group of layers of one input that CUDA serving runs as one
    launch (layers/merged_linears.py: its tuned tile comes before its widest layer's)."""
    shapes = []
    for module in model.modules():
        groups = getattr(module, "merge_groups", None)
        for layers in groups().values() if groups is not None else ():
            shape = merged_shape(layers)
            if shape is not None:
                shapes.append(shape)
        if isinstance(module, Fp8Linear) and module.kernel_shapes:
            shapes.append(linear_shape(module.weight))
        elif isinstance(module, SparseMoE) and type(module.gate) is nn.Linear:
            shapes.append(linear_shape(module.gate.weight))  # with a stacked shared gate's row
        elif isinstance(module, QSAIndexer) and type(module.index_qk_proj) is nn.Linear:
            shapes.append(linear_shape(module.index_qk_proj.weight))
        elif isinstance(module, (GatedDeltaNet, PLELayer)):
            # Qwen3-Next's in_proj_ba, the Qwen3.5 form's in_proj_b and a; PLE's projections.
            for name in ("in_proj_ba", "in_proj_b", "in_proj_a", "key_proj", "value_proj"):
                linear = getattr(module, name, None)
                if type(linear) is nn.Linear:
                    shapes.append(linear_shape(linear.weight))
    return shapes


def random_weight(shape: LinearShape, device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    """A weight [N, K] of the shape's dtype (fan-in scaled), an FP8 one with its scale."""
    generator = torch.Generator(device=device).manual_seed(seed)
    weight = torch.randn(shape.outputs, shape.depth, device=device, generator=generator) * shape.depth**-0.5
    if shape.dtype != "fp8":
        return {"weight": weight.to(getattr(torch, shape.dtype))}
    weight, weight_scale = quantize_fp8(weight)
    return {"weight": weight, "weight_scale": weight_scale}


def random_rows(shape: LinearShape, tokens: int, device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    """Rows [tokens, K] of the shape's dtype, FP8 ones quantized per row with their scales."""
    generator = torch.Generator(device=device).manual_seed(seed)
    rows = torch.randn(tokens, shape.depth, device=device, generator=generator)
    if shape.dtype != "fp8":
        return {"x": rows.to(getattr(torch, shape.dtype))}
    q, row_scale = quantize_fp8(rows, per_row=True)
    return {"x": q, "x_scale": row_scale}


def cublas_op(operands: dict[str, torch.Tensor]) -> torch.Tensor:
    if "x_scale" in operands:
        o = operands
        return scaled_mm_rows(o["x"], o["x_scale"], o["weight"], o["weight_scale"], None, torch.bfloat16)
    return F.linear(operands["x"], operands["weight"])


def skinny_op(tiles: Tiles) -> Callable[[dict[str, torch.Tensor]], torch.Tensor]:
    def run(operands: dict[str, torch.Tensor]) -> torch.Tensor:
        o = dict(operands)
        out_dtype = torch.bfloat16 if "x_scale" in o else None
        return skinny_linear(o.pop("x"), o.pop("weight"), tiles, **o, out_dtype=out_dtype)

    return run


def time_in_graph(op: Callable[[dict[str, torch.Tensor]], torch.Tensor], copies: Sequence[dict]) -> float:
    """Microseconds per call: one graph calls `op` once per weight copy (`moe_tune.graph_microseconds`)."""
    return graph_microseconds(lambda: [op(operands) for operands in copies], len(copies))


def tune_shape(shape: LinearShape, tokens: Sequence[int], device: torch.device) -> dict:
    """The shape's cuBLAS times, its best tile and that tile's times (the JSON written by `main`)."""
    weight_bytes = shape.outputs * shape.depth * (1 if shape.dtype == "fp8" else 2)
    count = max(2, min(_MAX_COPIES, -(-_STREAM_BYTES // weight_bytes)))
    weights = [random_weight(shape, device, seed=c) for c in range(count)]
    copies = {t: [{**random_rows(shape, t, device, seed=t), **w} for w in weights] for t in tokens}
    cublas_us = {t: time_in_graph(cublas_op, copies[t]) for t in tokens}
    fp8 = shape.dtype == "fp8"

    def time_of(tiles: Tiles) -> dict[int, float]:
        return {t: time_in_graph(skinny_op(tiles), copies[t]) for t in tokens}

    def sweep(candidates: Sequence[Tiles]) -> tuple[Tiles, dict[int, float]]:
        return best_tiles(candidates, time_of, f"skinny tune {tuple(shape)}", rows="M")

    candidates = [t for t in CANDIDATES if exact_mma(t, fp8)]
    if not fp8:  # what the product runs untuned: the file must beat it, not cuBLAS
        candidates.append(INVARIANT_GEMV)
    tiles, _ = sweep(candidates)
    tiles, _ = sweep(launch_variants(tiles))
    tiles, chosen_us = sweep([tiles, *split_variants(tiles, shape.depth, shape.dtype)])
    return {
        "device": torch.cuda.get_device_name(device),
        **shape._asdict(),
        "tiles": list(tiles),
        "us_per_call": {str(t): round(us, 2) for t, us in chosen_us.items()},
        "cublas_us_per_call": {str(t): round(us, 2) for t, us in cublas_us.items()},
        "weight_copies": count,
        "torch": torch.__version__,
        "triton": triton.__version__,
    }


def chosen_shapes(spec: str, shapes: Sequence[LinearShape]) -> set[tuple[int, int]]:
    """`--shapes`' (N, K) pairs, each one of the model's `shapes`; a ValueError names a bad or absent one."""
    wanted = set()
    for item in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)x(\d+)\s*", item)
        if match is None:
            raise ValueError(f"--shapes: {item!r} is not NxK (e.g. 9216x2048)")
        pair = (int(match[1]), int(match[2]))
        if not any((shape.outputs, shape.depth) == pair for shape in shapes):
            known = ", ".join(sorted({f"{s.outputs}x{s.depth}" for s in shapes}))
            raise ValueError(f"--shapes: {item.strip()} is not a shape of this model ({known})")
        wanted.add(pair)
    return wanted


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m morion.bench.skinny_tune", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--model", required=True, help="preset:NAME or a config.json path")
    parser.add_argument("--weight-dtype", default="fp8", choices=WEIGHT_DTYPES)
    parser.add_argument("--tokens", default="1,4,8,16", help="row counts whose summed time is minimised")
    parser.add_argument("--out", type=Path, default=CONFIG_DIR, help="directory of the JSON files")
    parser.add_argument(
        "--shapes",
        default="",
        help="only these of the model's shapes, as NxK (outputs x depth), comma separated: e.g. the merged "
        "projections' 9216x2048 (default: every shape)",
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("tuning needs a CUDA device")
    tokens = [int(t) for t in args.tokens.split(",")]
    if not tokens or max(tokens) > MAX_ROWS or min(tokens) < 1:
        parser.error(f"--tokens {args.tokens}: each from 1 to {MAX_ROWS}")
    device = torch.device("cuda", torch.cuda.current_device())
    shapes = model_shapes(args.model, args.weight_dtype)
    if args.shapes:
        try:
            wanted = chosen_shapes(args.shapes, shapes)
        except ValueError as error:
            parser.error(str(error))
        shapes = [shape for shape in shapes if (shape.outputs, shape.depth) in wanted]
    print(f"skinny tune: {len(shapes)} shapes of {args.model}", file=sys.stderr)
    for number, shape in enumerate(shapes, 1):
        config = tune_shape(shape, tokens, device)
        path = config_path(config["device"], shape, args.out)
        ours, theirs = sum(config["us_per_call"].values()), sum(config["cublas_us_per_call"].values())
        verdict = f"{ours:.1f} against cuBLAS {theirs:.1f} us summed over M={args.tokens}"
        where = f"skinny tune [{number}/{len(shapes)}] {tuple(shape)}"
        if ours < theirs or shape.dtype != "fp8":
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(config, indent=2) + "\n")
            print(f"{where}: {config['tiles']} {verdict}; wrote {path}")
        else:
            path.unlink(missing_ok=True)
            print(f"{where}: cuBLAS kept ({verdict})")


if __name__ == "__main__":
    main()
