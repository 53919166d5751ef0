"""The turn workload (issue #24): TTFT of one turn of an agent conversation on top of its cached prefix.

An agent pays prefill on every turn: the new tool output or user message, after a conversation the server
has cached. Per repeat, two requests of max_tokens 1, one after the other:

1. prime: a fresh conversation of P tokens (`--turn-prefix`, whole pages) and one more token, prefilled
   cold; it leaves the conversation in the prefix cache;
2. turn: the same tokens and N new ones (`--turn-new`). Its TTFT is the turn's: N + 1 tokens computed on
   top of P cached ones.

Why the one token after the conversation (as in restore.py): a request always computes its last token,
and a hybrid model's state is reusable only where a snapshot was taken, the last page boundary of the cold
prompt; with one token past P, exactly P tokens are reusable on every model. Where the page size is known
(the offline engine, a morion server) a turn whose `cached_tokens` is not P is a problem: its TTFT would
measure a different amount of work. Whether a cached turn answers as a cold one does is the restore
workload's and `morion validate`'s check, not this one's.
"""

from __future__ import annotations

from typing import Any

from morion.bench.first_token_parts import mean_parts, median_parts, parts_text
from morion.bench.timing import RequestTiming, median_of
from morion.bench.workloads import Workbench
from morion.errors import MorionError


def check_prefix(prefix_tokens: int, page_size: int | None) -> None:
    if page_size and prefix_tokens % page_size:
        raise MorionError(
            f"--turn-prefix must be a multiple of the page size {page_size} (a conversation is cached in "
            f"whole pages), got {prefix_tokens}"
        )


def tokens_needed(prefix_tokens: int, new_tokens: int) -> int:
    """The turn's prompt and its one output token."""
    return prefix_tokens + 1 + new_tokens + 1


def run_turns(
    bench: Workbench, prefix_tokens: int, new_tokens: int, repeats: int, page_size: int | None
) -> dict[str, Any]:
    label = bench.label
    runs = []
    for r in range(repeats):
        key = f"{label}:turn:{prefix_tokens}:{new_tokens}:{r}"
        conversation = bench.prompts.make(f"{key}:conversation", prefix_tokens + 1)
        appended = bench.prompts.make(f"{key}:new", new_tokens)
        [prime] = bench.target.run_group([conversation], 1).requests
        parts_before = bench.target.first_token_parts()
        [turn] = bench.target.run_group([conversation + appended], 1).requests
        run = _run(r, prime, turn, prefix_tokens, page_size)
        # Where the turn's TTFT went (front end, engine queue and prefill, hand-over), where the target
        # tells: what a server adds to the offline turn.
        run["turn_parts"] = mean_parts(parts_before, bench.target.first_token_parts())
        runs.append(run)
        bench.say(
            f"{label} turn {prefix_tokens}+{new_tokens}: run {r + 1}/{repeats}: prime (cold) TTFT "
            f"{prime.ttft_s * 1e3:.0f} ms, turn TTFT {turn.ttft_s * 1e3:.0f} ms "
            f"({turn.cached_tokens} cached, {run['turn_tok_s']:.0f} new tok/s)"
            + parts_text(run["turn_parts"])
            + (f"; {'; '.join(run['problems'])}" if run["problems"] else "")
        )
    median = {
        key: median_of(runs, key) for key in ("prime_ttft_s", "prime_tok_s", "turn_ttft_s", "turn_tok_s")
    }
    prime_ttft, turn_ttft = median["prime_ttft_s"], median["turn_ttft_s"]
    return {
        "engine": label,
        "prefix_tokens": prefix_tokens,
        "new_tokens": new_tokens,
        "page_size": page_size,
        "runs": runs,
        "median": median,
        "ratio_to_cold": turn_ttft / prime_ttft if prime_ttft else None,
        # Each part's median over the runs (bench/first_token_parts.py); None where the target tells none.
        "turn_parts": median_parts([run["turn_parts"] for run in runs]),
        "failures": [f"run {run['repeat'] + 1}: {problem}" for run in runs for problem in run["problems"]],
    }


def _run(
    repeat: int, prime: RequestTiming, turn: RequestTiming, prefix_tokens: int, page_size: int | None
) -> dict[str, Any]:
    problems = []
    if prime.cached_tokens:
        problems.append(f"the prime request was not cold ({prime.cached_tokens} cached tokens)")
    if page_size and turn.cached_tokens != prefix_tokens:
        problems.append(
            f"the turn found {turn.cached_tokens} cached tokens, not the conversation's {prefix_tokens}"
        )
    computed = turn.prompt_tokens - turn.cached_tokens
    return {
        "repeat": repeat,
        "prime": _request(prime),
        "turn": _request(turn),
        "prime_ttft_s": prime.ttft_s,
        "prime_tok_s": prime.prompt_tokens / prime.ttft_s,
        "turn_ttft_s": turn.ttft_s,
        "computed_tokens": computed,
        "turn_tok_s": computed / turn.ttft_s,
        "problems": problems,
    }


def _request(timing: RequestTiming) -> dict[str, Any]:
    return {
        "prompt_tokens": timing.prompt_tokens,
        "cached_tokens": timing.cached_tokens,
        "ttft_s": timing.ttft_s,
    }
