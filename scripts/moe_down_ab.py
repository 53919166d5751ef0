"""The fused FP8 MoE decode kernels' down tiles side by side at the 80B's expert shape, on a CUDA GPU.

Issue #23: at one token the 80B's down kernel reads half of gate_up's bytes but ran at 1.3 TB/s against
gate_up's 2.1 on the H200 (results/2026-12-05-session-40-notes.md). This times, as `moe_tune` does (CUDA
graph replays, 20 routings per token count, the stacked shared expert as every token's last slot), the
H200's shipped and tuned down tiles against the tuner's new candidates (one-pass GEMV tiles of 16 to 64
columns, two-pass GEMV tiles of 16), each at 2 and 8 warps too, with the H200's shipped gate_up tile:
a minute where the whole tuner takes several. Each candidate's output must agree with the default tiles'
(`moe_tune.sweep_kernel`); one line per candidate on stderr, the best last.

    python scripts/moe_down_ab.py [--tokens 1,4]
"""

from __future__ import annotations

import argparse

import torch

from morion.ops import moe_tune
from morion.ops.moe_tiles import ExpertShape, Tiles

SHAPE = ExpertShape(513, 2048, 512, "fp8")  # the 80B's 512 routed experts and its stacked shared one
TOP_K = 11
SHIPPED_GATE_UP = Tiles(32, 256, 2, 3, "dot")  # moe_configs/NVIDIA_H200_E513_H2048_I512_fp8.json
SHIPPED_DOWN = [Tiles(128, 128, 2, 2, "gemv"), Tiles(64, 128, 2, 5, "gemv")]  # shipped, then tuned


def down_ab(
    tokens: list[int],
    device: torch.device,
    shape: ExpertShape = SHAPE,
    top_k: int = TOP_K,
    gate_up: Tiles = SHIPPED_GATE_UP,
) -> tuple[Tiles, dict[int, float]]:
    """The best down tile of `candidates` below and its microseconds per call at each token count."""
    experts = moe_tune.random_experts(shape, device)
    batches = {
        t: [
            moe_tune.random_batch(shape, t, top_k, device, 1000 * t + i, True)
            for i in range(moe_tune.ROUTINGS)
        ]
        for t in tokens
    }
    default_down = moe_tune.DOWN_TILES[experts["gate_up"].element_size()]
    reference = {
        t: moe_tune.run_experts(
            moe_tune.moe_experts_triton, experts, *b[0], gate_up_tiles=gate_up, down_tiles=default_down
        )
        for t, b in batches.items()
    }
    one_pass = [
        t for t in moe_tune.down_candidates(shape.intermediate) if t.mma == "gemv" and t.num_stages == 1
    ]
    new = [*moe_tune.NARROW_GEMV_DOWN_CANDIDATES, *one_pass]
    candidates = [*SHIPPED_DOWN, *new, *(t._replace(num_warps=w) for t in new for w in (2, 8))]
    return moe_tune.sweep_kernel(
        moe_tune.moe_experts_triton,
        "down",
        candidates,
        {"gate_up_tiles": gate_up},
        experts=experts,
        batches=batches,
        reference=reference,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="1,4", help="token counts, comma-separated")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("this times CUDA graphs: it needs a CUDA device")
    best, times = down_ab([int(t) for t in args.tokens.split(",")], torch.device("cuda"))
    print(f"best down tile {tuple(best)}: " + ", ".join(f"T={t} {us:.1f} us" for t, us in times.items()))


if __name__ == "__main__":
    main()
