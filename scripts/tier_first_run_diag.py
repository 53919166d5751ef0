"""Which engine setting changes a fresh prompt's answer: the tiny Qwen3-Next's first tokens under engines
that differ in one setting each, beside the CPU model's own logits.

On the H200 (session 33) `tests/engine/test_cache_tiers_gpu.py` found a tiered engine's first run
(prefix cache on, host and disk tiers) giving the CPU model's first tokens while the cold engine (prefix
cache off, the same chunk and page sizes, so the same cut points) differed at token 0. This runs the same
prompt through the CPU model's full prefill, then through each variant: prefix cache on or off, chunk 32
or the default, CUDA graphs on or off, tiers. One line a variant (its tokens, its first token's top
logprobs), and which variants differ from the first engine's answer.

    python scripts/tier_first_run_diag.py [--device cuda] [--tokens 4]
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))

from morion.engine.sampling_params import SamplingParams
from morion.loader import load_model
from tests.conftest import TINY_QWEN3_NEXT, full_prefill_logits, make_engine, run_engine

# (name, engine options) beyond page size 8: one setting changed at a time.
VARIANTS = (
    ("prefix cache off, chunk 32", {"enable_prefix_cache": False, "chunk_size": 32}),
    ("prefix cache on, chunk 32", {"chunk_size": 32}),
    ("prefix cache off, default chunk", {"enable_prefix_cache": False}),
    ("prefix cache on, default chunk", {}),
    ("tiers, chunk 32", {"chunk_size": 32, "host_cache_gb": 8 / 1024}),
    (
        "prefix cache off, chunk 32, no graphs",
        {"enable_prefix_cache": False, "chunk_size": 32, "cuda_graph": False},
    ),
    ("prefix cache on, chunk 32, no graphs", {"chunk_size": 32, "cuda_graph": False}),
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=4)
    args = parser.parse_args(argv)
    directory = Path(tempfile.mkdtemp())
    (directory / "config.json").write_text(json.dumps(TINY_QWEN3_NEXT))
    cpu = load_model(str(directory), torch.float32, torch.device("cpu"), "dummy")
    loaded = cpu if args.device == "cpu" else cpu._replace(model=copy.deepcopy(cpu.model).to(args.device))
    rng = random.Random(0)
    prompt = [rng.randrange(256) for _ in range(75)]
    top = full_prefill_logits(cpu.model, prompt)[-1].float().topk(3)
    print(
        f"CPU model, full prefill: top 3 {top.indices.tolist()} {[round(v, 4) for v in top.values.tolist()]}"
    )
    greedy = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True, logprobs=3)
    answers = {}
    for name, options in VARIANTS:
        if args.device == "cpu" and "cuda_graph" in options:
            continue
        engine = make_engine(loaded, page_size=8, device=args.device, **options)
        output = run_engine(engine, [prompt], greedy)[0]
        engine.close()
        answers[name] = output.token_ids
        print(f"{name:40s} tokens {output.token_ids} first token's top {output.top_logprobs[0]}", flush=True)
    first = next(iter(answers.values()))
    differing = [name for name, tokens in answers.items() if tokens != first]
    print(f"differ from the first variant: {differing or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
