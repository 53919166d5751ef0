"""Speculative decoding speed at a set mean accepted length, on random weights (results are SYNTHETIC).

Random weights make any real drafter's acceptance meaningless, so the synthetic drafter
(`morion.spec.synthetic`) proposes the target's own greedy continuation, each position right with
probability p given the previous were (p solved from `--mean-accepted`, tokens per verify step incl. the
target's own token). Per concurrency C: C fresh prompts run without speculation (that run's outputs are
the oracle), then the same prompts with the synthetic drafter at `--width`; both engines share the
loaded weights, and the speculative outputs must equal the plain ones (checked). Reported: the
per-request post-first-token decode rate (median over requests and repeats), its ratio, and the measured
mean accepted length. With `--through mtp` (the default) the model's MTP head runs exactly as it would
(extend + chained draft steps), its proposals replaced by the synthetic ones, so its cost is included.

    PYTHONPATH=$PWD python scripts/spec_bench.py --model preset:qwen3-next-80b-a3b --weight-dtype fp8 \
        --kv-cache-dtype fp8 --out results
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

from morion.bench.provenance import collect
from morion.config import EngineConfig
from morion.engine.engine import Engine
from morion.engine.sampling_params import SamplingParams
from morion.loader import load_model
from morion.spec.synthetic import SyntheticDrafter, acceptance_for_mean_accepted


def _run(engine: Engine, prompts: list[list[int]], max_tokens: int) -> tuple[list[float], list[list[int]]]:
    """Per-request post-first-token decode tok/s and the generated ids, all prompts submitted at once."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    finals = {}
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            first.setdefault(out.request_id, now)
            last[out.request_id] = now
            if out.final is not None:
                finals[out.request_id] = out.final
    rates = [(len(finals[i].token_ids) - 1) / (last[i] - first[i]) for i in ids]
    return rates, [finals[i].token_ids for i in ids]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="preset:qwen3-next-80b-a3b")
    parser.add_argument("--weight-dtype", default="fp8")
    parser.add_argument("--kv-cache-dtype", default="fp8")
    parser.add_argument("--concurrency", default="1,4")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--output-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--width", type=int, default=3)
    parser.add_argument("--mean-accepted", type=float, default=2.58)
    parser.add_argument("--kv-cache-tokens", type=int, default=65536)
    parser.add_argument(
        "--through", choices=("none", "mtp"), default="mtp", help="mtp: the MTP head runs for its cost"
    )
    parser.add_argument("--out", default="results")
    parser.add_argument("--label", default="h200-qwen3-next-80b-a3b-fp8-spec-synthetic")
    args = parser.parse_args(argv)
    concurrency = [int(c) for c in args.concurrency.split(",")]
    base = EngineConfig(
        model=args.model, load_format="dummy", weight_dtype=args.weight_dtype,
        kv_cache_dtype=args.kv_cache_dtype, kv_cache_tokens=args.kv_cache_tokens,
        max_running_requests=max(concurrency), cuda_graph_max_batch=max(concurrency),
        enable_prefix_cache=False,
    )  # fmt: skip
    loaded = load_model(base.model, base.torch_dtype, base.torch_device, base.load_format, base.seed,
                        weight_dtype=base.weight_dtype)  # fmt: skip
    acceptance = acceptance_for_mean_accepted(args.mean_accepted, args.width)
    vocab_size = loaded.model.config.vocab_size
    plain = Engine(base, loaded)
    speculative = Engine(
        EngineConfig(**{**base.__dict__, "spec_width": args.width,
                        "speculative": "mtp" if args.through == "mtp" else "off"}), loaded,
        drafter=SyntheticDrafter(acceptance, [], vocab_size, seed=0),
    )  # fmt: skip
    vocab = min(loaded.model.config.vocab_size, 32000)
    rng = random.Random(0)
    rows = []
    for c in concurrency:
        plain_rates, spec_rates = [], []
        for repeat in range(args.repeats + 1):  # the first is a warm-up
            prompts = [[rng.randrange(vocab) for _ in range(args.context)] for _ in range(c)]
            rates, outputs = _run(plain, prompts, args.output_tokens)
            oracle = [p + o for p, o in zip(prompts, outputs, strict=True)]
            speculative.speculative.drafter = SyntheticDrafter(acceptance, oracle, vocab_size, seed=repeat)
            fast, fast_outputs = _run(speculative, prompts, args.output_tokens)
            if fast_outputs != outputs:
                raise SystemExit(f"C{c}: speculative output differs from plain output (a correctness bug)")
            if repeat:
                plain_rates += rates
                spec_rates += fast
            print(f"C{c} run {repeat}{' (warm-up)' if not repeat else ''}: plain "
                  f"{statistics.median(rates):.1f} tok/s, speculative {statistics.median(fast):.1f} tok/s",
                  file=sys.stderr)  # fmt: skip
        stats = speculative.speculative.stats
        rows.append({
            "concurrency": c, "plain_tok_s": statistics.median(plain_rates),
            "speculative_tok_s": statistics.median(spec_rates),
            "speedup": statistics.median(spec_rates) / statistics.median(plain_rates),
            "measured_mean_accepted": stats.mean_accepted_length,  # cumulative, warm-ups included
            "verify_graph_replays": sum(r.replays for r in speculative.verify_graphs.values()),
        })  # fmt: skip
    result = {
        "label": args.label, "synthetic": True, "through": args.through,
        "drafter": "synthetic (oracle = the plain run's greedy output)",
        "width": args.width, "target_mean_accepted": args.mean_accepted, "acceptance_p": acceptance,
        "context": args.context, "output_tokens": args.output_tokens, "repeats": args.repeats,
        "model": args.model, "weight_dtype": args.weight_dtype, "kv_cache_dtype": args.kv_cache_dtype,
        "rows": rows, "provenance": collect(" ".join(sys.argv), "cuda"),
    }  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"{time.strftime('%Y-%m-%d')}-{args.label}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
    lines = [
        f"# Speculative decoding, SYNTHETIC drafter: {args.model} ({args.weight_dtype} weights, "
        f"{args.kv_cache_dtype} K/V)", "",
        f"Width {args.width}, acceptance p = {acceptance:.3f} per position (target mean accepted length "
        f"{args.mean_accepted} tokens per verify step incl. the target's own), context {args.context}, "
        f"{args.output_tokens} greedy output tokens, median of {args.repeats} runs after a warm-up. "
        "Per-request post-first-token decode rates; speculative output checked identical to plain. "
        f"Draft cost: {'the MTP head runs (its tokens replaced)' if args.through == 'mtp' else 'none'}.", "",
        "| C | plain tok/s | speculative tok/s | speedup | measured mean accepted | verify graph replays |",
        "|---:|---:|---:|---:|---:|---:|",
    ]  # fmt: skip
    for row in rows:
        lines.append(f"| {row['concurrency']} | {row['plain_tok_s']:.1f} | {row['speculative_tok_s']:.1f} | "
                     f"{row['speedup']:.2f}x | {row['measured_mean_accepted']:.2f} | "
                     f"{row['verify_graph_replays']} |")  # fmt: skip
    prov = result["provenance"]
    lines += [
        "",
        f"Provenance: commit {prov.get('git_commit')}, {prov.get('date')}; see the JSON.",
    ]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
