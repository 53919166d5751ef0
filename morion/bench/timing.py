"""What one measured request and one group of concurrent requests produce, and the metrics taken from them.

Definitions (performance-anchors.md §5; the Markdown report repeats them):
- TTFT: submission to the first generated token, at the client.
- per-request decode tok/s, post-first-token: (n - 1) / (t_last - t_first) for a request of n tokens.
- aggregate tok/s: all generated tokens of the group / makespan, first submission to last token (TTFT
  included). It is a different timing window from the per-request rate: the two are never added.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

from morion.bench.first_token_parts import PartTotals
from morion.engine.step_timing import StepTimes


class RequestTiming(NamedTuple):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens the target served from its prefix cache (should be 0: fresh prompts)
    start: float  # perf_counter seconds: submitted
    first: float  # first generated token arrived
    last: float  # last generated token arrived

    @property
    def ttft_s(self) -> float:
        return self.first - self.start

    @property
    def decode_tok_s(self) -> float | None:
        """Post-first-token rate; None when fewer than two tokens (or no time) separate first and last."""
        if self.completion_tokens < 2 or self.last <= self.first:
            return None
        return (self.completion_tokens - 1) / (self.last - self.first)

    def sample(self) -> dict[str, Any]:
        """The raw per-request values kept in the results JSON."""
        rate = self.decode_tok_s
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "ttft_s": self.ttft_s,
            "decode_s": self.last - self.first,
            "decode_tok_s": rate,
            "step_s": None if rate is None else 1.0 / rate,
        }


class GroupResult(NamedTuple):
    """Requests submitted together; times are on one perf_counter clock."""

    requests: list[RequestTiming]

    @property
    def makespan_s(self) -> float:
        return max(r.last for r in self.requests) - min(r.start for r in self.requests)

    @property
    def total_tokens(self) -> int:
        return sum(r.completion_tokens for r in self.requests)

    def sample(self) -> dict[str, Any]:
        """One run: its requests, and the per-run values whose median over runs the report shows."""
        rates = [r.decode_tok_s for r in self.requests if r.decode_tok_s is not None]
        per_request = statistics.median(rates) if rates else None
        return {
            "requests": [r.sample() for r in self.requests],
            "per_request_tok_s": per_request,
            "step_s": None if per_request is None else 1.0 / per_request,
            "aggregate_tok_s": self.total_tokens / self.makespan_s if self.makespan_s > 0 else None,
            "makespan_s": self.makespan_s,
            "total_tokens": self.total_tokens,
            "ttft_s": statistics.median(r.ttft_s for r in self.requests),
            "cached_tokens": sum(r.cached_tokens for r in self.requests),
        }


class Target(Protocol):
    """Something that generates: an in-process engine, an HTTP server, or the transformers baseline."""

    name: str  # "morion (offline)", "server at URL", "transformers"
    vocab_size: int | None  # random prompt ids are drawn below this (None: a safe default)

    def run_group(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> GroupResult:
        """Submits every prompt at once (greedy, EOS ignored, exactly `max_tokens` each); returns when all
        have finished."""
        ...

    def describe(self) -> dict[str, Any]:
        """What the results JSON records about this target."""
        ...

    def step_times(self) -> StepTimes | None:
        """The engine's cumulative step counters (engine/step_timing.py), where the target can see them:
        in-process, or a morion server's /metrics; None elsewhere."""
        ...

    def forward_counts(self) -> dict[str, int] | None:
        """The engine's forwards so far as "kind/path" -> count (runner/forward_counts.py: replayed from a
        CUDA graph or eager), where the target can see them; None elsewhere."""
        ...

    def first_token_parts(self) -> PartTotals | None:
        """Running totals of where requests' times to first token went (bench/first_token_parts.py), where
        the target tells: a morion server, the offline engine; None elsewhere."""
        ...

    def close(self) -> None: ...


def median_of(runs: Sequence[dict[str, Any]], key: str) -> float | None:
    """The median of one per-run value over runs (runs without it are left out)."""
    values = [run[key] for run in runs if run.get(key) is not None]
    return statistics.median(values) if values else None
