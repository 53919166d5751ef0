"""Flash-Next's hyper-connection mix at prefill sizes on a CUDA GPU: the eager code against the mix whose up
half is one kernel of tl.dot tiles (ops/hyper_connection_prefill_triton.py), at the real shape in bf16.

Issue #24: an 8K prompt prefills as two 4K pieces of 97 mixes each, and the eager mix moves ~0.6 GB a mix
past its silu. This times one mix (CUDA graph replays, `moe_tune.graph_microseconds`) of each path
at each token count, and the kernel's up half alone for the default tiles and a few others (each must
agree with the eager mix within bf16's tolerance), then prints a table, the best tiles last:

    python scripts/hc_prefill_ab.py [--tokens 1024,4096] [--out DIR]

With --out, the table and the raw times are written there as hc-prefill-ab.{md,json}.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch

from morion.layers.hyper_connection import HyperConnection
from morion.ops import hyper_connection_prefill_triton as tiled
from morion.ops.moe_tune import graph_microseconds

# Qwen3.8-Flash-Next (models/presets.py): H = 2560, n = 4 streams, R = 320, eps of its config.
HIDDEN, STREAMS, LOWRANK, EPS = 2560, 4, 320, 1e-6
CANDIDATES = [
    tiled.DEFAULT_TILES,
    tiled.UpMixTiles(64, 32, 64, 8),
    tiled.UpMixTiles(128, 32, 64, 8),
    tiled.UpMixTiles(64, 64, 64, 8),
    tiled.UpMixTiles(128, 16, 64, 4),
    tiled.UpMixTiles(64, 32, 32, 4),
]
# bf16's: an ulp of the products the mean averages (tests/ops/test_hyper_connection_triton.py)
TOLERANCE = 2**-6


def random_mix(device: torch.device, dtype: torch.dtype, seed: int = 0) -> HyperConnection:
    generator = torch.Generator().manual_seed(seed)
    module = HyperConnection(HIDDEN, STREAMS, LOWRANK, EPS, inject=True)
    with torch.no_grad():
        for parameter in module.parameters():
            fan_in = parameter.shape[-1] if parameter.dim() == 2 else 10
            parameter.copy_(torch.randn(parameter.shape, generator=generator) / fan_in**0.5)
    return module.to(device, dtype).requires_grad_(False)


def measure(tokens: list[int], device: torch.device, dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """One row per (token count, path or tile): microseconds a mix (or an up half), and whether it agrees
    with the eager mix."""
    module = random_mix(device, dtype)
    up = module.input_mix_weight_up.weight
    rows = []
    for count in tokens:
        generator = torch.Generator().manual_seed(count)
        streams = (torch.randn(count, STREAMS * HIDDEN, generator=generator) * 3).to(device, dtype)
        expected = module.mix_reference(streams)[0]
        for path, mix in (("eager mix", module.mix_reference), ("tiled mix", module.mix_tiled)):
            agrees = torch.allclose(mix(streams)[0], expected, rtol=TOLERANCE, atol=TOLERANCE)
            us = graph_microseconds(functools.partial(mix, streams), 1)
            rows.append({"tokens": count, "path": path, "us": us, "agrees": agrees})
            print(f"T={count} {path}: {us:.1f} us", file=sys.stderr, flush=True)
        normed = module.hc_norm(streams)
        act = torch.nn.functional.silu(module.input_mix_weight_down(normed) / STREAMS)
        for tiles in CANDIDATES:
            step = functools.partial(tiled.up_mix, act, up, normed, STREAMS, tiles)
            agrees = torch.allclose(step(), expected, rtol=TOLERANCE, atol=TOLERANCE)
            us = graph_microseconds(step, 1)
            rows.append({"tokens": count, "path": f"up half {tuple(tiles)}", "us": us, "agrees": agrees})
            print(f"T={count} up half {tuple(tiles)}: {us:.1f} us", file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict], device_name: str) -> str:
    lines = [
        f"# Hyper-connection mix at prefill sizes, {device_name}, bf16, H={HIDDEN} n={STREAMS} R={LOWRANK}",
        "",
        "| T | path | us | agrees with eager |",
        "|---:|---|---:|---|",
    ]
    lines += [f"| {r['tokens']:,} | {r['path']} | {r['us']:.1f} | {r['agrees']} |" for r in rows]
    for count in sorted({r["tokens"] for r in rows}):
        halves = [r for r in rows if r["tokens"] == count and r["path"].startswith("up half") and r["agrees"]]
        if halves:
            best = min(halves, key=lambda r: r["us"])
            lines.append(f"\nT={count:,}: best {best['path']}, {best['us']:.1f} us")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="256,1024,4096", help="token counts, comma-separated")
    parser.add_argument("--out", type=Path, help="directory for hc-prefill-ab.{md,json}")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("this times CUDA graphs: it needs a CUDA device")
    device = torch.device("cuda")
    rows = measure([int(t) for t in args.tokens.split(",")], device)
    text = table(rows, torch.cuda.get_device_name(device))
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "hc-prefill-ab.md").write_text(text)
        (args.out / "hc-prefill-ab.json").write_text(json.dumps({"rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
