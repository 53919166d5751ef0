"""Where does a prefill's host time go? The engine thread's Python, function by function, over fresh prompts.

Flash-Next's 1K prefill keeps the engine thread on a CPU for its whole time to first token on the H200
(251 of 251 ms, `results/2026-12-03-h200-flash-next-prefill-profile.md`), and the device idles between its
kernels meanwhile: the host sets the pace. torch.profiler names the model's parts but inflates their host
time; this probe runs one warm prompt (compiling everything), then `--prompts` fresh ones under cProfile,
and prints, per prefill, the wall time, the functions with the most time of their own (torch's and
CUDA's calls included: a graph replay, a kernel launch, a copy) and morion's (and fla's) functions with
the most time under them.

    python scripts/prefill_host_profile.py --model preset:qwen3.8-flash-next --weight-dtype fp8 \\
        --kv-cache-dtype fp8 --prompt-tokens 1024 --out results
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
import sys
import time
from typing import Any

import torch

from morion.bench.invariance_probe import (
    is_our_code,
    prefill_once,
    probe_config,
    probe_parser,
    probe_prompts,
    source_path,
    write_probe_result,
)
from morion.engine.engine import Engine


def _name(file: str, line: int, function: str) -> str:
    """A cProfile entry as path:line function, the path from its package on (morion/..., fla/..., or
    what follows site-packages/); built-ins as cProfile names them ("{method 'replay' of ...}")."""
    if file == "~":
        return function
    return f"{source_path(file)}:{line} {function}"


def _rows(stats: pstats.Stats, prefills: int) -> list[dict[str, Any]]:
    """Every function cProfile saw: calls, own and cumulative milliseconds, each per prefill."""
    rows = []
    for (file, line, function), (_, calls, own, cumulative, _) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append(
            {
                "function": _name(file, line, function),
                "ours": is_our_code(file),
                "calls": calls / prefills,
                "own_ms": own * 1e3 / prefills,
                "cumulative_ms": cumulative * 1e3 / prefills,
            }
        )
    return rows


def _table(title: str, rows: list[dict[str, Any]], key: str, top: int) -> list[str]:
    lines = [title, f"{'ms':>9} {'calls':>8}  function"]
    for row in sorted(rows, key=lambda r: r[key], reverse=True)[:top]:
        lines.append(f"{row[key]:9.2f} {row['calls']:8.1f}  {row['function']}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = probe_parser(__doc__.splitlines()[0], "prefill-host-profile")
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--prompts", type=int, default=3, help="fresh prompts profiled (after one warm one)")
    parser.add_argument("--probe-seed", type=int, default=0, help="draws the prompts")
    parser.add_argument("--top", type=int, default=25, help="rows of each table")
    args = parser.parse_args(argv)
    if args.prompts < 1:
        parser.error(f"--prompts must be at least 1, got {args.prompts}")
    engine = Engine(probe_config(args))
    cuda = engine.device.type == "cuda"
    warm, *fresh = probe_prompts(
        engine.model.config.vocab_size, 1 + args.prompts, args.prompt_tokens, args.probe_seed
    )
    prefill_once(engine, warm)  # compiles and autotunes: not the steady state
    profiler = cProfile.Profile()
    walls = []
    for prompt in fresh:
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        profiler.enable()
        prefill_once(engine, prompt)
        if cuda:
            torch.cuda.synchronize()  # inside: a prefill's time includes its wait for the device
        profiler.disable()
        walls.append((time.perf_counter() - started) * 1e3)
    engine.close()
    rows = _rows(pstats.Stats(profiler), len(fresh))
    wall = statistics.median(walls)
    own = sum(row["own_ms"] for row in rows)
    print(
        f"prefill_host_profile: {args.prompt_tokens}-token prefill, {len(fresh)} fresh prompts: "
        f"{wall:.1f} ms wall under cProfile (median), {own:.1f} ms of it in profiled calls"
    )
    print("\n".join(_table("own time per prefill:", rows, "own_ms", args.top)))
    ours = [row for row in rows if row["ours"]]
    print(
        "\n".join(
            _table(
                "morion's and fla's functions, time under them per prefill:", ours, "cumulative_ms", args.top
            )
        )
    )
    result = {"settings": vars(args), "wall_ms": walls, "profiled_ms": own, "functions": rows}
    write_probe_result(args.out, "prefill-host-profile", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
