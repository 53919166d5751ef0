"""`needle`: needles at chosen depths in a haystack sized to an exact server-counted prompt length.

For each length and case: filler words are added until the prompt counts exactly the target (counting.py;
a Newton step on the words-per-token rate, then a scan, at most `_MAX_COUNTS` counts), the needles sit at
their depth (a fraction of the haystack's words), the request is greedy, and the grade is exact: each
answer verbatim (case-sensitive) in the reply, in order (RULER's string match; the strict
`content == answers` is recorded beside it). The server's `usage.prompt_tokens` must equal the target.
A follow-up request with a known answer then checks the server is still healthy.
"""

from __future__ import annotations

from typing import Any

import httpx

from morion.errors import MorionError
from morion.validate import cases as case_files
from morion.validate.counting import Count, PromptCounter
from morion.validate.session import Session
from morion.validate.streaming import RequestFailed

_MAX_COUNTS = 12  # Pennyroyal converges in at most 8 counts; a few more for the scan near the target
_RATE_PROBE_WORDS = 256


def check(session: Session) -> None:
    """Before anything runs: every length plus the reply must fit the server's context, when known."""
    data = case_files.load("needle").data
    limit = session.capacity().get("max_model_len")
    for length in session.options.needle_lengths:
        if limit and length + data["max_tokens"] > limit:
            raise MorionError(
                f"--needle-lengths {length} + {data['max_tokens']} reply tokens exceeds the server's max "
                f"model len {limit}"
            )


def run(session: Session) -> dict[str, Any]:
    case_file = case_files.load("needle")
    data = case_file.data
    counter = PromptCounter(session)
    results = []
    for length in session.options.needle_lengths:
        for case in case_files.select(data["cases"], session.options.cases):
            result = _run_case(session, counter, data, case, length)
            session.say(f"needle {case['id']} at {length:,} tokens: {result['verdict']} {result['reason']}")
            results.append(result)
    verdict = "pass" if results and all(r["verdict"] == "pass" for r in results) else "fail"
    return {
        "verdict": verdict,
        "case_file": case_file.identity(),
        "counted_by": counter.method,
        "count_methods_unavailable": counter.unavailable,
        "cases": results,
        "figures": {
            "passed": sum(r["verdict"] == "pass" for r in results),
            "cases": len(results),
            "prefill_tok_s": {
                f"{r['id']}@{r['target_tokens']}": r["prefill_tok_s"]
                for r in results
                if r.get("prefill_tok_s")
            },
        },
    }


def _run_case(
    session: Session, counter: PromptCounter, data: dict[str, Any], case: dict[str, Any], target: int
) -> dict[str, Any]:
    result: dict[str, Any] = {"id": case["id"], "target_tokens": target, "answers": _answers(case)}
    try:
        words, count, counts = _size(counter, data, case, target)
    except (httpx.HTTPError, RequestFailed, MorionError) as error:
        return {**result, "verdict": "error", "reason": f"counting failed: {error}"}
    messages = build_messages(data, case, words)
    result.update(
        counted_tokens=count.tokens,
        counts_used=counts,
        filler_words=words,
        needle_word_index=[round(needle["depth"] * words) for needle in case["needles"]],
        prompt_sha256=count.sha256(messages),
    )
    if count.tokens != target:
        return {**result, "verdict": "fail", "reason": f"could not size to {target} (got {count.tokens})"}
    try:
        reply = session.chat.ask(messages, data["max_tokens"])
    except (httpx.HTTPError, RequestFailed) as error:
        return {**result, "verdict": "error", "reason": f"request failed: {error}"}
    result["reply"] = reply.evidence()
    if reply.ttft_s and reply.prompt_tokens:
        result["prefill_tok_s"] = reply.prompt_tokens / reply.ttft_s
    result["found_in_order"] = found = _in_order(reply.content, result["answers"])
    result["content_equals"] = reply.content.strip() == "\n".join(result["answers"])
    result["follow_up"] = follow = _follow_up(session, data["follow_up"])
    problems = []
    if reply.prompt_tokens != target:
        problems.append(f"server counted {reply.prompt_tokens} prompt tokens, not {target}")
    if not found:
        problems.append(f"answers not found verbatim in order in {reply.content[:120]!r}")
    if not follow["passed"]:
        problems.append(f"follow-up failed: {follow.get('error') or repr(follow.get('content'))}")
    return {**result, "verdict": "fail" if problems else "pass", "reason": "; ".join(problems)}


def build_messages(data: dict[str, Any], case: dict[str, Any], words: int) -> list[dict[str, Any]]:
    """One user message: `words` filler words with each needle sentence at its depth, then the question."""
    filler = data["filler_words"]
    tokens = [filler[i % len(filler)] for i in range(words)]
    for needle in sorted(case["needles"], key=lambda n: n["depth"], reverse=True):
        tokens.insert(round(needle["depth"] * words), needle["text"])  # deepest first: indices stay valid
    return [{"role": "user", "content": " ".join(tokens) + "\n\n" + case["question"]}]


def _size(
    counter: PromptCounter, data: dict[str, Any], case: dict[str, Any], target: int
) -> tuple[int, Count, int]:
    """(filler words, the final count, counts used) for a prompt of exactly `target` tokens if reachable."""
    seen: dict[int, Count] = {}

    def count(words: int) -> Count:
        if words not in seen:
            seen[words] = counter.count(build_messages(data, case, words))
        return seen[words]

    base = count(0).tokens
    if target <= base:
        raise MorionError(f"{target} tokens is not above the bare prompt's {base}")
    rate = max((count(_RATE_PROBE_WORDS).tokens - base) / _RATE_PROBE_WORDS, 1e-3)
    words = max(0, round((target - base) / rate))
    while len(seen) < _MAX_COUNTS:
        got = count(words).tokens
        if got == target:
            return words, seen[words], len(seen)
        step = round((target - got) / rate)
        if step == 0 or words + step in seen:
            break  # within a word or two, or cycling: scan the neighbours instead
        words = max(0, words + step)
    for offset in (1, -1, 2, -2, 3, -3):
        if len(seen) >= _MAX_COUNTS:
            break
        if count(max(0, words + offset)).tokens == target:
            return max(0, words + offset), seen[max(0, words + offset)], len(seen)
    closest = min(seen, key=lambda w: abs(seen[w].tokens - target))
    return closest, seen[closest], len(seen)


def _answers(case: dict[str, Any]) -> list[str]:
    return [needle["answer"] for needle in sorted(case["needles"], key=lambda n: n["depth"])]


def _in_order(content: str, answers: list[str]) -> bool:
    position = 0
    for answer in answers:
        found = content.find(answer, position)
        if found < 0:
            return False
        position = found + len(answer)
    return True


def _follow_up(session: Session, follow_up: dict[str, Any]) -> dict[str, Any]:
    try:
        reply = session.chat.ask(follow_up["messages"], follow_up["max_tokens"])
    except (httpx.HTTPError, RequestFailed) as error:
        return {"passed": False, "error": str(error)}
    return {"passed": follow_up["answer"] in reply.content, "content": reply.content}
