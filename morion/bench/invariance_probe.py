"""What the engine probes share (scripts/decode_invariance.py, decode_divergence_trace.py,
row_invariance_probe.py, prefill_syncs.py, prefill_host_profile.py): their flags, the engine they run, their
prompts, one prefill, and their result files."""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

from morion.config import EngineConfig
from morion.engine.engine import Engine
from morion.engine.sampling_params import SamplingParams
from morion.engine_flags import add_engine_flags, engine_options

DEFAULT_MODEL = "preset:qwen3-next-80b-a3b-12l"  # the 80B's layer shapes, 12 of its 48 layers
# Where a probe's stack frames count as the engine's own code: morion's, and fla-core's kernels it calls.
OUR_CODE = ("/morion/", "/fla/")


def probe_parser(description: str, result_name: str) -> argparse.ArgumentParser:
    """Every engine flag (so a probe bisects by kernel, `--no-cuda-graph`, `--moe-kernel grouped`, ...) and
    `--out`, a directory for <date>-<result_name>.json."""
    parser = argparse.ArgumentParser(description=description)
    add_engine_flags(parser)
    parser.add_argument("--out", help=f"a directory for <date>-{result_name}.json")
    return parser


def probe_config(args: argparse.Namespace, batch: int = 1, **overrides: Any) -> EngineConfig:
    """The engine of a probe: its flags, the 12-layer 80B preset unless --model names another, a pool of
    262,144 tokens unless --kv-cache-tokens, room for `batch` requests at once."""
    options = engine_options(args)
    options.setdefault("kv_cache_tokens", 262144)
    options["max_running_requests"] = max(batch, options.get("max_running_requests", 1))
    options.update(overrides)
    return EngineConfig(model=args.model or DEFAULT_MODEL, **options)


def probe_prompts(vocab_size: int, count: int, length: int, seed: int) -> list[list[int]]:
    """`count` prompts of `length` random token ids; the same for the same seed in every probe."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(length)] for _ in range(count)]


def is_our_code(file: str) -> bool:
    """Whether a source file is morion's or fla-core's (`OUR_CODE`)."""
    return any(part in file for part in OUR_CODE)


def source_path(file: str) -> str:
    """A source file's path from its package on: morion/..., fla/..., or what follows site-packages/."""
    starts = [file.rfind(part) + 1 for part in OUR_CODE if part in file]
    return file[max(starts) :] if starts else file.split("/site-packages/")[-1]


def prefill_once(engine: Engine, prompt: list[int]) -> None:
    """`prompt` prefilled to its first token (greedy), the engine stepped until it is done."""
    engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()


def write_probe_result(out: str | None, result_name: str, result: dict[str, Any]) -> None:
    """`result` as <out>/<date>-<result_name>.json, where --out was given."""
    if not out:
        return
    path = Path(out) / f"{time.strftime('%Y-%m-%d')}-{result_name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{result_name}: wrote {path}", file=sys.stderr)
