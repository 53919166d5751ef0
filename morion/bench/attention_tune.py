"""Times the paged extend-attention kernel's tiles on this GPU at prefill shapes, beside a library kernel.

    python -m morion.bench.attention_tune --heads 16 --kv-heads 2 --head-dim 256 --out DIR

The extend kernel (ops/paged_attention_triton.py) runs every prefill chunk's attention: a fresh prompt's
tokens over themselves, an agent turn's 1K new tokens over a long cached prefix, the chunks of a long
prompt over all that came before. Its tiles (`extend_config`) are chosen by this sweep's timings (they
were first chosen from register counts). For each shape of `SHAPES` (queries over a context, FP8 or BF16
K/V in a shuffled page table), each candidate `KernelConfig` is timed as CUDA-graph replays and reported
in TFLOP/s of the causal work (4 * head_dim * heads * visible keys, summed over queries); a candidate
whose output disagrees with the default tiles' beyond `AGREEMENT` is refused. The anchor is torch's
scaled_dot_product_attention (flash backend where it takes the shape) over the same keys laid out
contiguously in BF16 with no mask: the same products, no page table, no FP8. Writes
`attention-tune-h*-kv*-d*-<dtype>.json` and `.md` to --out and prints the Markdown table.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
from triton.runtime.errors import OutOfResources

from morion.ops.moe_tune import graph_microseconds
from morion.ops.paged_attention import FP8_KV_DTYPE
from morion.ops.paged_attention_triton import KernelConfig, extend_config, paged_attention

PAGE_SIZE = 16
# Max |candidate - default| over the output, relative to max |default|: another key block sums the
# softmax in another order (bf16 probabilities), nothing else.
AGREEMENT = 2e-2


class Shape(NamedTuple):
    name: str
    queries: int  # this chunk's new tokens
    context: int  # keys before them (a cached prefix or earlier chunks)


SHAPES = (
    Shape("fresh 1K prompt", 1024, 0),
    Shape("agent turn: 1K on 32K", 1024, 32768),
    Shape("8K prompt, 2nd chunk", 4096, 4096),
    Shape("64K prompt, last chunk", 4096, 61440),
)

CANDIDATES = tuple(
    KernelConfig(m, n, w, s)
    for m in (64, 128)
    for n in (32, 64, 128)
    for w in (4, 8)
    for s in (1, 2, 3)
    if not (m == 64 and w == 8)
)


class Case(NamedTuple):
    q: torch.Tensor
    kv_layer: torch.Tensor
    page_table: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    k_contiguous: torch.Tensor  # [1, Hq, keys, D] bf16, K/V heads repeated per query head (the anchor's)
    v_contiguous: torch.Tensor
    scale: float
    flops: float


def make_case(shape: Shape, heads: int, kv_heads: int, head_dim: int, kv_dtype: torch.dtype) -> Case:
    """One sequence: `shape.queries` query rows at the end of `shape.context + shape.queries` keys."""
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(0)
    keys = shape.context + shape.queries
    pages = -(-keys // PAGE_SIZE)
    q = torch.randn(shape.queries, heads, head_dim, device=device, generator=generator).bfloat16()
    kv = torch.randn(pages * PAGE_SIZE, 2, kv_heads, head_dim, device=device, generator=generator)
    page_order = torch.randperm(pages, device=device, generator=generator)
    kv_layer = torch.empty_like(kv)
    slots = (page_order[:, None] * PAGE_SIZE + torch.arange(PAGE_SIZE, device=device)).flatten()
    kv_layer[slots] = kv  # logical token t lives in slot page_order[t // P] * P + t % P
    kv_layer = kv_layer.to(kv_dtype)
    contiguous = kv[:keys].to(kv_dtype).bfloat16().repeat_interleave(heads // kv_heads, dim=2)
    visible = shape.queries * shape.context + shape.queries * (shape.queries + 1) / 2
    return Case(
        q=q,
        kv_layer=kv_layer,
        page_table=page_order[None].int(),
        cu_seqlens_q=torch.tensor([0, shape.queries], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([keys], dtype=torch.int32, device=device),
        k_contiguous=contiguous[:, 0].transpose(0, 1)[None].contiguous(),
        v_contiguous=contiguous[:, 1].transpose(0, 1)[None].contiguous(),
        scale=head_dim**-0.5,
        flops=4.0 * head_dim * heads * visible,
    )


def run_kernel(case: Case, config: KernelConfig | None, out: torch.Tensor) -> torch.Tensor:
    return paged_attention(
        case.q, case.kv_layer, case.page_table, case.cu_seqlens_q, case.seq_lens, PAGE_SIZE, case.scale,
        max_query_len=case.q.shape[0], out=out, extend_tiles=config,
    )  # fmt: skip


def anchor_microseconds(case: Case) -> float | None:
    """torch's SDPA over the contiguous BF16 keys (no mask: the prefix's products, and the new tokens'
    square in full), or None where no fused backend takes it."""
    q = case.q.transpose(0, 1)[None]
    try:
        return graph_microseconds(
            lambda: F.scaled_dot_product_attention(q, case.k_contiguous, case.v_contiguous, scale=case.scale),
            calls=1,
        )
    except RuntimeError as error:
        print(f"  anchor: {error}", file=sys.stderr)
        return None


class _StageFallbacks(logging.Handler):
    """Counts the kernel launcher's warnings that a config's pipeline did not fit and ran with 1 stage."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1


def _time_candidate(
    case: Case, config: KernelConfig, reference: torch.Tensor, fallbacks: _StageFallbacks
) -> dict:
    """One candidate's row: its microseconds and TFLOP/s, or why it could not run or was refused."""
    out = torch.empty_like(case.q)
    try:
        run_kernel(case, config, out)
        torch.cuda.synchronize()
        micros = graph_microseconds(lambda: run_kernel(case, config, out), calls=1)
    except (OutOfResources, RuntimeError, ValueError) as error:
        return {"config": config._asdict(), "error": str(error).splitlines()[0][:160]}
    off = (out.float() - reference.float()).abs().max().item() / reference.abs().max().item()
    row = {"config": config._asdict(), "us": micros, "tflops": case.flops / micros / 1e6, "rel_error": off}
    if fallbacks.count:
        row["refused"] = "its stages did not fit in shared memory (ran with 1)"
    elif off > AGREEMENT:
        row["refused"] = f"disagrees with the default tiles by {off:.3g} (> {AGREEMENT})"
    print(f"  {tuple(config)} {micros:9.1f} us {row['tflops']:6.1f} TFLOP/s", file=sys.stderr)
    return row


def tune_shape(shape: Shape, heads: int, kv_heads: int, head_dim: int, kv_dtype: torch.dtype) -> dict:
    case = make_case(shape, heads, kv_heads, head_dim, kv_dtype)
    reference = run_kernel(case, None, torch.empty_like(case.q)).clone()
    rows = []
    fallbacks = _StageFallbacks()
    launcher_log = logging.getLogger("morion.ops.paged_attention_triton")
    launcher_log.addHandler(fallbacks)
    try:
        for config in CANDIDATES:
            fallbacks.count = 0
            rows.append(_time_candidate(case, config, reference, fallbacks))
    finally:
        launcher_log.removeHandler(fallbacks)
    default = extend_config(head_dim)
    anchor = anchor_microseconds(case)
    return {
        "shape": shape._asdict(),
        "tflop": case.flops / 1e12,
        "default": default._asdict(),
        "default_us": next(r["us"] for r in rows if r["config"] == default._asdict() and "us" in r),
        "anchor_sdpa_bf16_us": anchor,
        "candidates": rows,
    }


def best_overall(results: Sequence[dict]) -> dict:
    """The candidate with the least total time over all shapes (one config serves every prefill)."""
    totals: dict[tuple, float] = {}
    for result in results:
        for row in result["candidates"]:
            key = tuple(row["config"].values())
            if "us" not in row or "refused" in row:
                totals[key] = float("inf")
            elif totals.get(key) != float("inf"):
                totals[key] = totals.get(key, 0.0) + row["us"]
    key = min(totals, key=totals.__getitem__)
    return {"config": dict(zip(KernelConfig._fields, key, strict=True)), "total_us": totals[key]}


def markdown(meta: dict, results: Sequence[dict], best: dict) -> str:
    head = meta["heads"], meta["kv_heads"], meta["head_dim"], meta["kv_dtype"]
    lines = [
        f"# Extend attention tiles: Hq={head[0]}, Hkv={head[1]}, D={head[2]}, K/V {head[3]}",
        "",
        f"{meta['gpu']}; torch {meta['torch']}, triton {meta['triton']}; page size {PAGE_SIZE}, shuffled"
        " pages; CUDA-graph replays, median of 10. TFLOP/s of the causal work (4·D·Hq·visible keys).",
        "",
        "| shape | TFLOP | default tiles | us | TFLOP/s | best here | us | TFLOP/s | chosen overall: us |"
        " SDPA BF16 contiguous (anchor): us |",
        "|---|---:|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    chosen = tuple(best["config"].values())
    for result in results:
        timed = [r for r in result["candidates"] if "us" in r and "refused" not in r]
        fastest = min(timed, key=lambda r: r["us"])
        chosen_us = next(r["us"] for r in timed if tuple(r["config"].values()) == chosen)
        anchor = result["anchor_sdpa_bf16_us"]
        lines.append(
            f"| {result['shape']['name']} | {result['tflop']:.2f} | {tuple(result['default'].values())} | "
            f"{result['default_us']:.0f} | {result['tflop'] * 1e6 / result['default_us']:.0f} | "
            f"{tuple(fastest['config'].values())} | {fastest['us']:.0f} | {fastest['tflops']:.0f} | "
            f"{chosen_us:.0f} | {'n/a' if anchor is None else f'{anchor:.0f}'} |"
        )
    lines += ["", f"Chosen overall (least total time): {chosen} (block_m, block_n, warps, stages)."]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", type=int, required=True)
    parser.add_argument("--kv-heads", type=int, required=True)
    parser.add_argument("--head-dim", type=int, required=True)
    parser.add_argument("--kv-dtype", choices=("fp8", "bf16"), default="fp8")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    kv_dtype = FP8_KV_DTYPE if args.kv_dtype == "fp8" else torch.bfloat16
    meta = {
        "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim, "kv_dtype": args.kv_dtype,
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }  # fmt: skip
    results = []
    for number, shape in enumerate(SHAPES, 1):
        print(f"[{number}/{len(SHAPES)}] {shape.name}: {len(CANDIDATES)} candidates", file=sys.stderr)
        results.append(tune_shape(shape, args.heads, args.kv_heads, args.head_dim, kv_dtype))
    best = best_overall(results)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"attention-tune-h{args.heads}-kv{args.kv_heads}-d{args.head_dim}-{args.kv_dtype}"
    (args.out / f"{stem}.json").write_text(json.dumps({**meta, "results": results, "best": best}, indent=1))
    table = markdown(meta, results, best)
    (args.out / f"{stem}.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
