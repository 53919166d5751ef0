"""`perf`: the decode sweep and cold prefill of `morion bench --url`, run by bench's own code.

The points are bench's (same prompts, timing and definitions: docs/bench.md), without the roofline. The
verdict is about the measurement's validity, not its speed: every request generated exactly its budget,
and no prompt hit the prefix cache (fresh prompts must be cold, or the figures are not what they say).
"""

from __future__ import annotations

from typing import Any

from morion.bench.prompts import PromptFactory
from morion.bench.remote import RemoteTarget
from morion.bench.report import DEFINITIONS
from morion.bench.workloads import Workbench, run_decode_sweep
from morion.errors import MorionError
from morion.validate.session import Session


def check(session: Session) -> None:
    options = session.options
    limit = session.capacity().get("max_model_len")
    longest = max(
        max(options.perf_contexts) + options.perf_output_tokens, max(options.perf_prefill_lengths) + 1
    )
    if limit and longest > limit:
        raise MorionError(
            f"perf needs {longest} tokens (prompt + output) but the server's max model len is {limit}"
        )


def run(session: Session) -> dict[str, Any]:
    options = session.options
    target = RemoteTarget(options.url, session.model, options.api_key, options.request_timeout_s, None)
    prompts = PromptFactory(target.vocab_size)
    bench = Workbench(target, prompts, "server", session.stream)
    try:
        bench.warm_engine(min(1024, *options.perf_contexts, *options.perf_prefill_lengths))
        before = target.forward_counts()
        decode, _ = run_decode_sweep(
            bench,
            options.perf_concurrency,
            options.perf_contexts,
            options.perf_output_tokens,
            options.perf_repeats,
            1,
        )
        prefill = [
            bench.prefill_point(length, options.perf_repeats) for length in options.perf_prefill_lengths
        ]
        after = target.forward_counts()
    finally:
        target.close()
    problems = []
    for point in decode:
        for run in point["runs"]:
            short = [r for r in run["requests"] if r["completion_tokens"] != options.perf_output_tokens]
            if short:
                problems.append(
                    f"decode C={point['concurrency']} ctx={point['context']}: {len(short)} requests did not "
                    f"generate {options.perf_output_tokens} tokens"
                )
                break
    cached = sum(p["cached_tokens"] for p in [*decode, *prefill])
    if cached:
        problems.append(f"{cached} prompt tokens of fresh prompts were served from the cache")
    return {
        "verdict": "fail" if problems else "pass",
        "reason": "; ".join(problems),
        "target": target.describe(),
        "settings": {
            "output_tokens": options.perf_output_tokens,
            "repeats": options.perf_repeats,
            "warmup_runs": 1,
            "prompt_salt": prompts.salt,
        },
        "definitions": {
            key: DEFINITIONS[key]
            for key in ("per_request_tok_s", "aggregate_tok_s", "ttft_s", "prefill_tok_s")
        },
        "decode": decode,
        "prefill": prefill,
        # What the server's engine ran for the sweep (after its warm-up), per kind: replayed from a CUDA
        # graph or eager. None where the server exports no such counts.
        "forwards": {key: after[key] - before.get(key, 0) for key in after} if before and after else None,
    }
