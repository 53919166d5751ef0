"""QSA's two prefill kernels side by side at Qwen3.8-Flash-Next's shapes, on a GPU: where they cross sets
`layers/qsa_attention.SELECTED_PREFILL_MAX_BUDGETS` (`--qsa-prefill selected`'s context limit).

For each context, a 4,096-query prefill chunk at the end of it, in the layer's prefill tiles, after the
block scores both share: the split-KV path (`select_token_slots` + `sparse_attention`: each row alone)
against the selected-blocks path (`select_block_bits` + `selected_prefill_attention`: a tile of queries
on tensor cores over the blocks any of them selected). Random block scores select nearly disjoint blocks
for neighbouring queries, the selected kernel's worst case; a trained model's neighbours share most of
theirs. Prints a table (ms per chunk per layer, medians of CUDA-event timings) and the two outputs' largest
difference; writes it as JSON to --out.

    python scripts/qsa_prefill_ab.py [--contexts 8192,16384,32768,65536] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from morion.ops.paged_attention import FP8_KV_DTYPE, store_kv
from morion.ops.qsa_prefill_triton import selected_prefill_attention
from morion.ops.qsa_triton import select_block_bits, select_token_slots, sparse_attention

HEADS, KV_HEADS, HEAD_DIM, RATIO, BLOCK_TOPK, PAGE_SIZE = 24, 2, 256, 4, 512, 64
CHUNK, TILE = 4096, 256


def _timed(run, repeats: int) -> float:
    """Median ms of `run()` over `repeats` timings after two warm-ups."""
    for _ in range(2):
        run()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure(context: int, repeats: int) -> dict[str, float]:
    generator = torch.Generator(device="cuda").manual_seed(context)
    pages = context // PAGE_SIZE
    page_row = torch.randperm(pages, device="cuda", generator=generator).int()
    kv = torch.empty(pages * PAGE_SIZE, 2, KV_HEADS, HEAD_DIM, dtype=FP8_KV_DTYPE, device="cuda")
    k, v = (
        torch.randn(pages * PAGE_SIZE, KV_HEADS, HEAD_DIM, device="cuda", generator=generator) for _ in "kv"
    )
    store_kv(kv, torch.arange(pages * PAGE_SIZE, device="cuda"), k, v, 0.05, 0.05)
    del k, v
    q = torch.randn(CHUNK, HEADS, HEAD_DIM, device="cuda", generator=generator).bfloat16()
    positions = torch.arange(context - CHUNK, context, device="cuda")
    complete = (positions + 1) // RATIO
    blocks = torch.arange(pages * PAGE_SIZE // RATIO, device="cuda")
    scores = torch.rand(CHUNK, blocks.numel(), device="cuda", generator=generator)
    scores = torch.where(blocks[None] < complete[:, None], scores, float("-inf"))
    tiles = [slice(start, start + TILE) for start in range(0, CHUNK, TILE)]
    scale = HEAD_DIM**-0.5

    def split() -> list[torch.Tensor]:
        outputs = []
        for rows in tiles:
            slots, counts = select_token_slots(
                scores[rows], complete[rows], positions[rows], page_row[None], BLOCK_TOPK, RATIO, PAGE_SIZE
            )
            outputs.append(sparse_attention(q[rows], kv, slots, counts, scale, 0.05, 0.05))
        return outputs

    def selected() -> list[torch.Tensor]:
        outputs = []
        for rows in tiles:
            bits = select_block_bits(scores[rows].contiguous(), complete[rows], BLOCK_TOPK)
            outputs.append(
                selected_prefill_attention(
                    q[rows], kv, page_row, positions[rows], bits, RATIO, PAGE_SIZE, scale, 0.05, 0.05
                )
            )
        return outputs

    difference = max(
        (a.float() - b.float()).abs().max().item() for a, b in zip(split(), selected(), strict=True)
    )
    return {
        "context": context,
        "split_ms": _timed(split, repeats),
        "selected_ms": _timed(selected, repeats),
        "max_abs_difference": difference,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="8192,16384,32768,65536")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default=None, help="JSON file for the rows")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("qsa_prefill_ab: needs a CUDA device", file=sys.stderr)
        return 2
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        print(f"qsa_prefill_ab: context {context:,} ...", file=sys.stderr, flush=True)
        rows.append(measure(context, args.repeats))
    print("| context | split-KV ms | selected ms | selected / split | max abs diff |")
    print("|---:|---:|---:|---:|---:|")
    for row in rows:
        ratio = row["selected_ms"] / row["split_ms"]
        print(
            f"| {row['context']:,} | {row['split_ms']:.2f} | {row['selected_ms']:.2f} | {ratio:.2f} | "
            f"{row['max_abs_difference']:.2e} |"
        )
    if args.out:
        with open(args.out, "w") as file:
            json.dump(
                {"device": torch.cuda.get_device_name(), "chunk": CHUNK, "tile": TILE, "rows": rows}, file
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
