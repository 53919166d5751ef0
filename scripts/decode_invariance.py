"""Does a request's decode depend on what decodes beside it? In-process, on one engine, bit for bit.

The second 80B qualification (results/2026-12-01-h200-qualify-qwen3-next-80b-a3b-run2-notes.md) found
hits whose first 5 to 13 tokens equal the cold run's, log probability for log probability, and then part:
every wrong one ran alone on one side (a decode-graph bucket of 1) and beside other traffic on the other.
This probe asks the question directly, for many steps (a rare flip per step needs many to show):

  cold:     every prompt once, alone (its prefill, then decode at batch 1);
  alone:    every prompt again, alone (a device hit: its tail, then decode at batch 1);
  together: every prompt again, `--batch` at a time (the same hit path, decode beside the others).

`alone` against `together` differs only in the decode's company; `cold` against `alone` only in the
prefill path (a hit recomputes just its tail). So both later phases must hit: the engine gets state slots
for every prompt's snapshots, and a prompt that misses in them is reported and fails the probe (exit 1).
Reported per comparison: the prompts that part and the first token where each does. Engine flags
(`--no-cuda-graph`, `--moe-kernel grouped`, ...) bisect by kernel.

The result keeps the cold answers' log probabilities; `--compare-cold FILE` (an earlier run's result, same
prompts) adds `cold_vs_other_process`: does another process, same flags, compute the same answers? (A
restart, as the disk tier's hits see it.)

    python scripts/decode_invariance.py --model preset:qwen3-next-80b-a3b-12l --weight-dtype fp8 \\
        --kv-cache-dtype fp8 --prompts 64 --tokens 64 --batch 8 --out results
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from morion.bench.invariance_probe import probe_config, probe_parser, probe_prompts, write_probe_result
from morion.engine.engine import Engine
from morion.engine.sampling_params import SamplingParams


def _run(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list[tuple[list[float], int]]:
    """Submits `prompts` together and steps until all finish: each one's token log probabilities and
    cached prompt tokens."""
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    finals = {}
    while engine.has_unfinished():
        for step in engine.step():
            if step.final is not None:
                finals[step.request_id] = step.final
    return [(list(finals[i].logprobs), finals[i].usage.cached_tokens) for i in ids]


def _state_slots(args: argparse.Namespace) -> dict[str, int]:
    """Room for every prompt's snapshots (its prompt tail's and its finish's) beside a batch's working and
    boundary states: with the default 4 slots per running request, the least recently used snapshots went
    first, the alone phase found none of its prompts cached (each evicted its own next ones), and the
    together phase re-prefilled some prompts side by side, which may change their bits by design
    (docs/architecture.md: prefill chunks may depend on their batch; hits never recompute them)."""
    return {} if args.state_slots else {"state_slots": 2 * args.prompts + 4 * args.batch}


def _parting(ours: list[list[float]], theirs: list[list[float]]) -> dict[str, object]:
    """Which prompts' answers differ, and the first token at which each does."""
    first = {}
    for index, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        token = next((t for t, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        if token is not None:
            first[index] = token
    return {"prompts_differing": len(first), "first_differing_token": first}


# What must match for two runs' cold answers to be comparable.
_SAME_PROMPTS = ("model", "prompts", "prompt_tokens", "tokens", "probe_seed")


def _earlier_cold(args: argparse.Namespace) -> list[list[float]]:
    """The cold answers of the result file --compare-cold names; exits with one line if it does not fit."""
    try:
        earlier = json.loads(Path(args.compare_cold).read_text())
        answers = earlier["cold_logprobs"]
        settings = earlier["settings"]
    except (OSError, ValueError, KeyError) as error:
        sys.exit(
            f"decode_invariance: --compare-cold {args.compare_cold}: not a result with cold answers ({error})"
        )
    differing = [name for name in _SAME_PROMPTS if settings.get(name) != getattr(args, name)]
    if differing:
        sys.exit(
            f"decode_invariance: --compare-cold {args.compare_cold} ran other prompts"
            f" ({', '.join(differing)} differ)"
        )
    return answers


def main(argv: list[str] | None = None) -> int:
    parser = probe_parser(__doc__.splitlines()[0], "decode-invariance")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=1000, help="off a page boundary by default")
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens per request")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--probe-seed", type=int, default=0, help="draws the prompts")
    parser.add_argument(
        "--compare-cold", metavar="FILE", help="an earlier run's result: compare cold answers"
    )
    args = parser.parse_args(argv)
    earlier = _earlier_cold(args) if args.compare_cold else None
    engine = Engine(probe_config(args, batch=args.batch, **_state_slots(args)))
    prompts = probe_prompts(engine.model.config.vocab_size, args.prompts, args.prompt_tokens, args.probe_seed)
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    # A hit restores up to the prompt's last page boundary and recomputes its tail.
    boundary = (args.prompt_tokens - 1) // engine.config.page_size * engine.config.page_size
    answers: dict[str, list[list[float]]] = {}
    misses: dict[str, list[int]] = {}
    for phase in ("cold", "alone", "together"):
        started = time.perf_counter()
        size = args.batch if phase == "together" else 1
        runs = [
            run
            for start in range(0, len(prompts), size)
            for run in _run(engine, prompts[start : start + size], params)
        ]
        answers[phase] = [logprobs for logprobs, _ in runs]
        if phase != "cold":
            misses[phase] = [index for index, (_, cached) in enumerate(runs) if cached != boundary]
        print(f"decode_invariance: {phase}: {time.perf_counter() - started:.1f} s", file=sys.stderr)
    result = {
        "settings": vars(args),
        "steps_compared": args.prompts * args.tokens,
        # Prompts of the hit phases that did not hit their last page boundary (none, or the comparisons
        # are not what they say: the exit status is then 1).
        "misses": misses,
        "alone_vs_together": _parting(answers["alone"], answers["together"]),
        "cold_vs_alone": _parting(answers["cold"], answers["alone"]),
        "cold_logprobs": answers["cold"],
    }
    if earlier is not None:
        result["cold_vs_other_process"] = _parting(answers["cold"], earlier)
    for name in ("alone_vs_together", "cold_vs_alone", "cold_vs_other_process"):
        figures = result.get(name)
        if figures is None:
            continue
        print(f"decode_invariance: {name}: {figures['prompts_differing']} of {args.prompts} prompts part")
    write_probe_result(args.out, "decode-invariance", result)
    missed = {phase: indices for phase, indices in misses.items() if indices}
    if missed:
        print(
            "decode_invariance: not every hit phase hit (prompts that missed, by phase): "
            + "; ".join(f"{phase} {indices}" for phase, indices in missed.items())
            + " (--state-slots too few for --prompts?)",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
