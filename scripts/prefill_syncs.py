"""Where does a prefill make the host wait for the GPU? Every synchronizing CUDA call of one prefill, by site.

The 80B's 1K prefill leaves the GPU idle 152 of its 204 ms a step, waiting on the host
(`results/2026-12-02-h200-profile-80b-prefill.md`). A host sync in a layer makes it worse: the GPU drains,
then idles while the host queues the layer's next kernels. Under `torch.cuda.set_sync_debug_mode("warn")`
torch warns at every synchronizing call; this probe runs one warm prompt (compiling everything first),
then one fresh prompt under that mode, and counts the warnings by the innermost frame of morion's (and
fla's) code on their stacks.

    python scripts/prefill_syncs.py --model preset:qwen3-next-80b-a3b-12l --weight-dtype fp8 \\
        --kv-cache-dtype fp8 --prompt-tokens 1024 --out results
"""

from __future__ import annotations

import collections
import sys
import traceback
import warnings

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


def _site(stack: list[traceback.FrameSummary]) -> str:
    """The innermost frame of our code (or fla's) on a warning's stack, as file:line function."""
    for frame in reversed(stack):
        if is_our_code(frame.filename) and "warnings" not in frame.filename:
            return f"{source_path(frame.filename)}:{frame.lineno} {frame.name}"
    return "(outside morion and fla)"


def main(argv: list[str] | None = None) -> int:
    parser = probe_parser(__doc__.splitlines()[0], "prefill-syncs")
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--probe-seed", type=int, default=0, help="draws the prompts")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("counting CUDA syncs needs a CUDA device")
    engine = Engine(probe_config(args))
    warm, fresh = probe_prompts(engine.model.config.vocab_size, 2, args.prompt_tokens, args.probe_seed)
    prefill_once(engine, warm)  # compiles and autotunes: those syncs are not the steady state
    torch.cuda.synchronize()
    sites: collections.Counter[str] = collections.Counter()

    def record(*_: object, **__: object) -> None:  # warnings.showwarning's place: count, never print
        sites[_site(traceback.extract_stack()[:-1])] += 1

    with warnings.catch_warnings():  # which puts warnings.showwarning back on exit
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            prefill_once(engine, fresh)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    total = sum(sites.values())
    print(f"prefill_syncs: {total} synchronizing calls in one {args.prompt_tokens}-token prefill")
    for site, count in sites.most_common():
        print(f"{count:6d}  {site}")
    result = {"settings": vars(args), "total": total, "sites": dict(sites)}
    write_probe_result(args.out, "prefill-syncs", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
