"""The workloads: a decode sweep over concurrency x context, cold prefill, and TTFT at one length.

Each point runs `warmup_runs` unmeasured runs (decode only; at most 32 output tokens: enough to build
graphs and tune kernels for the shape) and then `repeats` measured runs, each on fresh prompts. A point's
reported value is the median over its runs of the per-run value; the runs are kept raw beside it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, TextIO

from morion.bench.first_token_parts import engine_thread, mean_parts, parts_text
from morion.bench.prompts import PromptFactory
from morion.bench.timing import GroupResult, Target, median_of

WARMUP_MAX_TOKENS = 32  # output tokens of a warm-up run


class Workbench:
    """Runs workloads on one target with one prompt factory, printing a progress line per run."""

    def __init__(
        self, target: Target, prompts: PromptFactory, label: str, stream: TextIO | None = None
    ) -> None:
        self.target = target
        self.label = label  # names the engine in progress lines, points and prompt keys
        self.prompts = prompts
        self.stream = stream or sys.stderr
        self._started = time.perf_counter()

    def say(self, line: str) -> None:
        elapsed = time.perf_counter() - self._started
        self.stream.write(f"bench [{elapsed:7.1f}s] {line}\n")
        self.stream.flush()

    def _group(self, key: str, concurrency: int, length: int, max_tokens: int) -> GroupResult:
        prompts = [self.prompts.make(f"{key}:{i}", length) for i in range(concurrency)]
        return self.target.run_group(prompts, max_tokens)

    def warm_engine(self, length: int, max_tokens: int = 16) -> None:
        """One unrelated request first: a fresh process pays for graph capture and JIT on its first
        requests, which is neither prefill nor decode."""
        self.say(f"{self.target.name}: warm-up request ({length} prompt tokens, {max_tokens} output)")
        self._group("engine-warmup", 1, length, max_tokens)

    # ----------------------------------------------------------------------------- decode
    def decode_point(
        self, concurrency: int, context: int, output_tokens: int, repeats: int, warmups: int
    ) -> dict[str, Any]:
        label = self.label
        name = f"{label} decode C={concurrency} ctx={context}"
        for w in range(warmups):
            self.say(f"{name}: warm-up {w + 1}/{warmups}")
            self._group(
                f"{label}:decode:{concurrency}:{context}:warmup{w}",
                concurrency,
                context,
                min(output_tokens, WARMUP_MAX_TOKENS),
            )
        runs = []
        for r in range(repeats):
            before = self.target.step_times()
            group = self._group(
                f"{label}:decode:{concurrency}:{context}:{r}", concurrency, context, output_tokens
            )
            run = group.sample()
            after = self.target.step_times() if before is not None else None
            # The engine's own time per decode step beside the client's: the gap is the serving path.
            run["engine_steps"] = after.since(before) if after is not None else None
            run["engine_decode_step_ms"] = (run["engine_steps"] or {}).get("decode_step_ms")
            runs.append(run)
            engine_ms = run["engine_decode_step_ms"]
            self.say(
                f"{name}: run {r + 1}/{repeats}: per-request {rate_text(run['per_request_tok_s'])} tok/s, "
                f"aggregate {rate_text(run['aggregate_tok_s'])} tok/s, TTFT {run['ttft_s'] * 1e3:.0f} ms"
                + (f", engine decode step {engine_ms:.2f} ms" if engine_ms is not None else "")
            )
        return {
            "engine": label,
            "concurrency": concurrency,
            "context": context,
            "output_tokens": output_tokens,
            "runs": runs,
            "median": {
                key: median_of(runs, key)
                for key in (
                    "per_request_tok_s",
                    "step_s",
                    "aggregate_tok_s",
                    "ttft_s",
                    "engine_decode_step_ms",
                )
            },
            "cached_tokens": sum(run["cached_tokens"] for run in runs),
        }

    # ---------------------------------------------------------------------------- prefill
    def prefill_point(self, length: int, repeats: int, workload: str = "prefill") -> dict[str, Any]:
        """One request at a time, max_tokens 1: TTFT and prompt tokens / TTFT (fresh prompts: cold)."""
        label = self.label
        runs = []
        for r in range(repeats):
            before = self.target.forward_counts()
            parts_before = self.target.first_token_parts()
            group = self._group(f"{label}:{workload}:{length}:{r}", 1, length, 1)
            request = group.requests[0]
            # How the engine ran this prompt's forwards (a chunk up to its last page boundary, its tail):
            # replayed from graphs or eager, where the target counts them; the TTFT's parts (front end,
            # engine queue and prefill, hand-over) and where the engine thread's prefill went (on a CPU,
            # waiting for one, off CPU: the engine's own split), where the target tells.
            forwards = _counted(before, self.target.forward_counts())
            parts_after = self.target.first_token_parts()
            parts = mean_parts(parts_before, parts_after)
            thread = engine_thread(parts_before, parts_after)
            runs.append(
                {
                    "prompt_tokens": request.prompt_tokens,
                    "cached_tokens": request.cached_tokens,
                    "ttft_s": request.ttft_s,
                    "prefill_tok_s": request.prompt_tokens / request.ttft_s,
                    "forwards": forwards,
                    "engine_thread": thread,
                    "ttft_parts": parts,
                }
            )
            self.say(
                f"{label} {workload} {length}: run {r + 1}/{repeats}: TTFT {request.ttft_s * 1e3:.0f} ms, "
                f"{runs[-1]['prefill_tok_s']:.0f} tok/s"
                + (f", forwards {', '.join(f'{k} {n}' for k, n in forwards.items())}" if forwards else "")
                + (_thread_note(thread) if thread else "")
                + parts_text(parts)
            )
        return {
            "engine": label,
            "prompt_tokens": length,
            "runs": runs,
            "median": {key: median_of(runs, key) for key in ("ttft_s", "prefill_tok_s")},
            "cached_tokens": sum(run["cached_tokens"] for run in runs),
        }


def _thread_note(thread: dict[str, float]) -> str:
    return (
        f", engine thread on CPU {thread['on_cpu_s'] * 1e3:.0f} ms, waiting for a CPU "
        f"{thread['runqueue_s'] * 1e3:.0f} ms, off CPU {thread['off_cpu_s'] * 1e3:.0f} ms"
    )


def _counted(before: dict[str, int] | None, after: dict[str, int] | None) -> dict[str, int] | None:
    """The forwards between two `forward_counts` readings, those that ran ("kind/path" -> count); None
    where the target does not count them."""
    if before is None or after is None:
        return None
    return {key: count - before.get(key, 0) for key, count in after.items() if count > before.get(key, 0)}


def run_decode_sweep(
    bench: Workbench,
    concurrency: tuple[int, ...],
    contexts: tuple[int, ...],
    output_tokens: int,
    repeats: int,
    warmups: int,
    max_cell_prompt_tokens: int = 0,
    on_point: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, int]]]:
    """Every (context, concurrency) point, contexts outermost; returns (points, skipped points)."""
    points, skipped = [], []
    for c, context in grid(bench, "decode", concurrency, contexts, max_cell_prompt_tokens, skipped):
        point = bench.decode_point(c, context, output_tokens, repeats, warmups)
        points.append(point)
        if on_point is not None:
            on_point(point)
    return points, skipped


def grid(
    bench: Workbench,
    workload: str,
    concurrency: tuple[int, ...],
    contexts: tuple[int, ...],
    max_cell_prompt_tokens: int,
    skipped: list[dict[str, int]],
) -> Iterator[tuple[int, int]]:
    """(concurrency, context) of every point, contexts outermost. A point of more than
    `max_cell_prompt_tokens` prompt tokens in all (0: no limit) is announced and appended to `skipped`."""
    for context in contexts:
        for c in concurrency:
            if max_cell_prompt_tokens and c * context > max_cell_prompt_tokens:
                bench.say(
                    f"{bench.label} {workload} C={c} ctx={context}: skipped (over --max-cell-prompt-tokens)"
                )
                skipped.append({"concurrency": c, "context": context})
                continue
            yield c, context


def rate_text(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"
