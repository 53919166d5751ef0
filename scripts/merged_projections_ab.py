"""What merging linear layers of one input saves per decode layer (layers/merged_linears.py), on a GPU.

For each group of the presets (the 80B's attention q/k/v; Flash-Next's QSA q/k/v, Gated DeltaNet
in_proj_qkv + in_proj_z and in_proj_b + in_proj_a), with random weights of their shapes and the device's
tuned tiles: the microseconds of one layer's products at 1 and 4 rows, one launch per layer against the
merged launch, each timed as CUDA-graph replays over enough layers' weights that they stream from HBM
(as in a decode step), rows quantized before (the quantization is shared either way). Prints a table and
writes JSON with its provenance.

    python scripts/merged_projections_ab.py --out results --label h200-merged-projections
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

from morion.layers.linear_fp8 import Fp8Linear
from morion.layers.merged_linears import MergedLinears, group_tile
from morion.ops.fp8 import quantize_fp8
from morion.ops.moe_tune import graph_microseconds
from morion.ops.skinny_tiles import linear_forward

# name: (per-layer widths, K, FP8, layers of it per decode step in the preset)
GROUPS = {
    "qwen3-next-80b-a3b attention q|k|v": ((8192, 512, 512), 2048, True, 12),
    "qwen3.8-flash-next QSA q|k|v": ((12288, 512, 512), 2560, True, 12),
    "qwen3.8-flash-next GDN in_proj_qkv|z": ((10240, 6144), 2560, True, 36),
    "qwen3.8-flash-next GDN in_proj_b|a": ((48, 48), 2560, False, 36),
}
COPIES = 16  # weight sets cycled per replay: more than L2 holds for every group


def _layers(widths: tuple[int, ...], depth: int, fp8: bool, seed: int) -> list[nn.Module]:
    generator = torch.Generator(device="cuda").manual_seed(seed)
    layers: list[nn.Module] = []
    for width in widths:
        source = torch.randn(width, depth, device="cuda", generator=generator) * depth**-0.5
        if fp8:
            layer = Fp8Linear(depth, width).cuda()
            layer.weight.data, layer.weight_scale = quantize_fp8(source)
        else:
            layer = nn.Linear(depth, width, bias=False, device="cuda", dtype=torch.bfloat16)
            layer.weight.data = source.to(torch.bfloat16)
        layers.append(layer)
    return layers


def _time_group(widths: tuple[int, ...], depth: int, fp8: bool, rows: int) -> dict[str, float]:
    sets = [_layers(widths, depth, fp8, seed) for seed in range(COPIES)]
    x = torch.randn(rows, depth, device="cuda").to(torch.bfloat16)
    q, row_scale = quantize_fp8(x, per_row=True) if fp8 else (x, None)

    def alone(layers: list[nn.Module]) -> None:
        for layer in layers:
            if fp8:
                layer.forward_quantized(q, row_scale, torch.bfloat16)
            else:
                linear_forward(layer, x)

    separate = graph_microseconds(lambda: [alone(layers) for layers in sets], COPIES)
    merged = [MergedLinears(layers) for layers in sets]
    if group_tile(q, merged[0].weight, merged[0].widest) is None:
        return {"separate_us": round(separate, 2), "merged_us": None}
    together = graph_microseconds(lambda: [m.outputs(q, row_scale, torch.bfloat16) for m in merged], COPIES)
    return {"separate_us": round(separate, 2), "merged_us": round(together, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--label", default="merged-projections")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    results = []
    for name, (widths, depth, fp8, per_step) in GROUPS.items():
        for rows in (1, 4):
            print(f"timing {name} at {rows} rows ...", file=sys.stderr, flush=True)
            timing = _time_group(widths, depth, fp8, rows)
            results.append({"group": name, "rows": rows, "layers_per_step": per_step, **timing})
    lines = [
        "| group | rows | separate us/layer | merged us/layer | saved per decode step us |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in results:
        saved = (
            "—"
            if r["merged_us"] is None
            else f"{(r['separate_us'] - r['merged_us']) * r['layers_per_step']:.0f}"
        )
        merged = "untuned" if r["merged_us"] is None else r["merged_us"]
        lines.append(f"| {r['group']} | {r['rows']} | {r['separate_us']} | {merged} | {saved} |")
    table = "\n".join(lines)
    print(table)
    provenance = {
        "commit": os.environ.get("MORION_SOURCE_COMMIT", "unknown"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"{time.strftime('%Y-%m-%d')}-{args.label}"
    stem.with_suffix(".json").write_text(json.dumps({**provenance, "results": results}, indent=2) + "\n")
    header = f"# Merged projections A/B ({provenance['device']}, commit {provenance['commit'][:12]})\n\n"
    stem.with_suffix(".md").write_text(
        header + f"`scripts/merged_projections_ab.py`: {__doc__.splitlines()[0]}\n\n" + table + "\n"
    )


if __name__ == "__main__":
    main()
