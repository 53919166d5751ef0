"""`restore --restore-conversations N`: cache-hit identity over many generated conversations, by token ids.

For a server without a tokenizer (a random-weight preset) and for qualifying a GPU build at scale: N
prompts of token ids (unique random ids, so no two share a page), their lengths drawn log-uniformly from
`--restore-lengths MIN:MAX`, every other one a multiple of 256 tokens (on any page boundary) and the
others on none. In rounds of `--restore-group` conversations:

- cold: each conversation once (nothing of it can be cached);
- device: each again at once;
- host: after the server dropped its device cache (`POST /v1/cache/evict_device`, or a flood of other
  prompts where the server has no such route), each again;

then, once all rounds are done, after `--restart-cmd`: disk, each again. `--restore-resume FILE` instead
takes the conversations and their answers from an earlier run's results (the server restarted in
between, on the same disk cache) and sends only the disk step: the restart may then be anything, a
new process on the same machine in a later session of its operator's. Every answer is greedy,
`--restore-max-tokens` long, and must equal its cold answer in text, in every token's log probability and
in token ids where the server sends them: a wrong answer from a fast cache hit looks exactly like a right
one, and a near-tie can hide a wrong restore behind an equal token. A hit is a reply with cached tokens
(where the server's page size is known, morion's /v1/server_info, exactly every full page before the
prompt's last token); a wrong answer is a hit that differs. A miss that differs, computed again, is
counted apart: no cache was involved (prefill in another batch or process is not bitwise reproducible).
A wrong answer's conversation is sent again, as a hit and once cold with a fresh `cache_salt`, in the
process that served it: whether that process computes the prompt as the first cold run did tells a wrong
restore from a process that computes otherwise (restore_cause.py). Other traffic is whatever runs beside
the suite (the qualification runs `soak` at the same time).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import random
import time
from pathlib import Path
from typing import Any

import httpx

from morion.bench.prompts import PromptFactory
from morion.errors import MorionError
from morion.validate.completions import CompletionReply, complete
from morion.validate.restore_cause import CAUSES, ColdHere, cause, differs, explain, recorded
from morion.validate.session import Session
from morion.validate.streaming import RequestFailed

STEPS = ("cold", "device", "host", "disk")
AGAIN = 2  # repeats of a conversation whose hit answered otherwise than cold (_send_again)
_ALIGN = 256  # "aligned" lengths are multiples of this: a page boundary for every page size up to it


def conversation_lengths(count: int, low: int, high: int, seed: int) -> list[int]:
    """`count` lengths log-uniform in [low, high]: even indices multiples of _ALIGN, odd ones on no
    16-token boundary."""
    rng = random.Random(seed)
    lengths = []
    for index in range(count):
        length = round(math.exp(rng.uniform(math.log(low), math.log(high))))
        if index % 2 == 0:
            length = max(_ALIGN, length // _ALIGN * _ALIGN)
        else:
            length = length // 16 * 16 + rng.randrange(1, 16)
        lengths.append(min(max(length, 2), high))
    return lengths


def run(session: Session, tiers: dict[str, bool], evict, restart) -> dict[str, Any]:
    """`evict(session)` empties the server's device cache and returns what it did; `restart(session)`
    runs --restart-cmd (restore.py owns both: the frozen-case suite uses them too)."""
    options = session.options
    previous = earlier_run(options.restore_resume) if options.restore_resume else None
    seed = previous["seed"] if previous else options.restore_seed
    low, high = (
        (previous["lengths"]["min"], previous["lengths"]["max"]) if previous else options.restore_lengths
    )
    vocab = ((session.server_info or {}).get("model") or {}).get("vocab_size")
    prompts = PromptFactory(vocab, salt=seed)
    if previous:
        lengths = previous["lengths"]["drawn"]
    else:
        lengths = conversation_lengths(options.restore_conversations, low, high, seed)
    page_size = session.server_config().get("page_size")
    conversations = []
    for index, length in enumerate(lengths):
        tokens = prompts.make(f"restore:{index}", length)
        digest = hashlib.sha256(b"".join(t.to_bytes(4, "little") for t in tokens)).hexdigest()
        conversations.append({"id": f"conversation-{index}", "tokens": tokens, "sha256": digest})
    session.say(
        f"restore: {len(conversations)} conversations of {min(lengths):,} to {max(lengths):,} tokens "
        f"({sum(lengths):,} in all), seed {seed}"
        + (f", resumed from {options.restore_resume}" if previous else "")
    )
    replies: dict[str, dict[str, dict[str, Any]]] = {c["id"]: {} for c in conversations}
    events: dict[str, Any] = {"evictions": [], "counters": {}}
    cold_here = ColdHere(lambda tokens, salt: _send(session, tokens, salt), session.say)
    if previous:
        _resume(previous, conversations, replies, events, options.restore_resume)
    group = options.restore_group
    for start in range(0, len(conversations) if not previous else 0, group):
        chunk = conversations[start : start + group]
        for conversation in chunk:
            for step in ("cold", "device"):
                replies[conversation["id"]][step] = _send(session, conversation["tokens"])
        events["evictions"].append(evict(session))
        _counting(session, events, "host", lambda chunk=chunk: _send_all(session, chunk, replies, "host"))
        _send_again(session, chunk, replies, ("device", "host"), cold_here)
        session.say(f"restore: conversations {start + 1}-{start + len(chunk)} cold, device and host sent")
    if options.restart_cmd:
        events["restart"] = restart(session)
    if options.restart_cmd or previous:
        _counting(session, events, "disk", lambda: _send_all(session, conversations, replies, "disk"))
        _send_again(session, conversations, replies, ("disk",), cold_here)
    if cold_here.refused:
        events["cold_here_unavailable"] = cold_here.refused
    results = [
        _grade(c, replies[c["id"]], tiers, _expected_cached(len(c["tokens"]), page_size))
        for c in conversations
    ]
    figures = _figures(results)
    for result in results:
        if result["verdict"] != "pass":
            session.say(f"restore {result['id']}: fail {result['reason']}")
    session.say(
        "restore: hits "
        + ", ".join(f"{step} {figures['hits'][step]}" for step in STEPS[1:])
        + f"; wrong answers {figures['wrong_answers']}"
        + "".join(f", {name} {count}" for name, count in figures["wrong_by_cause"].items() if count)
    )
    return {
        "verdict": "pass" if results and all(r["verdict"] == "pass" for r in results) else "fail",
        "mode": "generated conversations (token ids)",
        "seed": seed,
        "lengths": {"min": low, "max": high, "drawn": lengths},
        "page_size": page_size,
        "tiers_declared": tiers,
        "events": events,
        "figures": figures,
        "cases": results,
    }


def earlier_run(path: str) -> dict[str, Any]:
    """The generated-conversation restore suite of an earlier results JSON."""
    try:
        suite = json.loads(Path(path).read_text())["suites"]["restore"]
    except (OSError, ValueError, KeyError) as error:
        raise MorionError(f"--restore-resume {path}: no restore suite to resume ({error})") from None
    if "seed" not in suite or "lengths" not in suite:
        raise MorionError(f"--restore-resume {path}: its restore suite ran the chat cases, not conversations")
    return suite


def _resume(previous, conversations, replies, events, path: str) -> None:
    """The earlier run's answers (cold, device, host) and events, checked against the prompts rebuilt here
    (same seed and vocabulary: same token ids)."""
    cases = {case["id"]: case for case in previous["cases"]}
    for conversation in conversations:
        case = cases.get(conversation["id"])
        if case is None or case["prompt_sha256"] != conversation["sha256"]:
            raise MorionError(
                f"--restore-resume {path}: {conversation['id']} is not the prompt it was "
                "(another vocabulary?)"
            )
        # The disk step and the evidence sent after it ("again-disk", "cold-here-disk") are this run's.
        replies[conversation["id"]].update(
            {step: reply for step, reply in case["steps"].items() if not step.endswith("disk")}
        )
    events.update(previous["events"])
    events["resumed_from"] = Path(path).name


def _send(session: Session, tokens: list[int], cache_salt: str | None = None) -> dict[str, Any]:
    async def one() -> CompletionReply:
        async with session.endpoint.client() as client:
            max_tokens = session.options.restore_max_tokens
            return await complete(client, session.model, tokens, max_tokens, cache_salt)

    try:
        reply = asyncio.run(one())
    except RequestFailed as error:
        return {"error": str(error), "status": error.status}
    except httpx.HTTPError as error:
        return {"error": str(error) or type(error).__name__}
    return {
        **reply.answer(),
        "cached_tokens": reply.cached_tokens,
        "finish_reason": reply.finish_reason,
        "ttft_s": reply.ttft_s,
        "latency_s": reply.latency_s,
    }


def _send_all(session: Session, conversations, replies, step: str) -> None:
    for conversation in conversations:
        replies[conversation["id"]][step] = _send(session, conversation["tokens"])


def _send_again(
    session: Session,
    conversations: list[dict[str, Any]],
    replies: dict[str, dict[str, Any]],
    steps: tuple,
    cold_here: ColdHere,
) -> None:
    """A conversation whose hit at one of `steps` answered otherwise than its cold run is sent AGAIN more
    times at once, in the same process and under the same traffic (by then a device hit), and kept as
    `again-<last of steps>`: whether the repeats answer as the hit or as cold tells which run was the odd
    one. Then once with a fresh cache salt, kept as `cold-here-<last of steps>`: computed cold in this
    process, it tells a wrong restore from a process that computes otherwise (restore_cause.py). The
    verdict is the hit's; the rest is evidence for finding why."""
    for conversation in conversations:
        sent = replies[conversation["id"]]
        if any(_wrong_hit(sent.get(step), sent.get("cold")) for step in steps):
            sent[f"again-{steps[-1]}"] = [_send(session, conversation["tokens"]) for _ in range(AGAIN)]
            sent[f"cold-here-{steps[-1]}"] = cold_here.send(conversation["tokens"])


def _wrong_hit(reply: dict[str, Any] | None, cold: dict[str, Any] | None) -> bool:
    if reply is None or cold is None or "error" in reply or "error" in cold:
        return False
    return bool(reply.get("cached_tokens")) and differs(reply, cold)


def _counting(session: Session, events: dict[str, Any], step: str, send) -> None:
    """Runs `send` and adds the server's cache-hit counters' growth over it to events["counters"][step]
    (morion's /v1/server_info; other traffic counts too: the totals are context, not the verdict)."""
    before = _hit_counters(session)
    started = time.perf_counter()
    send()
    after = _hit_counters(session)
    total = events["counters"].setdefault(step, {"seconds": 0.0})
    total["seconds"] += time.perf_counter() - started
    for key, value in after.items():
        total[key] = total.get(key, 0) + value - before.get(key, 0)


def _hit_counters(session: Session) -> dict[str, int]:
    info = session.endpoint.server_info() or {}
    cache = (info.get("load") or {}).get("cache") or {}
    keys = ("device_hits", "host_hits", "disk_hits", "restores", "checksum_failures")
    return {key: int(cache[key]) for key in keys if key in cache}


def _expected_cached(length: int, page_size: int | None) -> int | None:
    """Every full page before the prompt's last token (which always runs), where the page size is known."""
    return None if not page_size else (length - 1) // page_size * page_size


def _grade(
    conversation: dict[str, Any],
    steps: dict[str, dict[str, Any]],
    tiers: dict[str, bool],
    expected: int | None,
) -> dict[str, Any]:
    problems, hits, wrong, recomputed = [], [], [], []
    again: dict[str, dict[str, int]] = {}
    causes: dict[str, str] = {}
    cold_here: dict[str, Any] = {}
    cold = steps["cold"]
    if "error" in cold:
        problems.append(f"cold: {cold['error']}")
    for step in STEPS[1:]:
        reply = steps.get(step)
        if reply is None:
            continue
        if "error" in reply:
            problems.append(f"{step}: {reply['error']}")
            continue
        cached = reply.get("cached_tokens")
        if cached:
            hits.append(step)
        if "error" not in cold and differs(reply, cold):
            difference = _first_difference(reply, cold)
            if cached:
                wrong.append(step)  # a hit that answers otherwise: what this suite exists to catch
                evidence = _again(steps, step)
                if evidence:
                    again[step] = evidence
                    difference += (
                        f"; sent again {evidence['sent']}: {evidence['as_hit']} as this hit, "
                        f"{evidence['as_cold']} as cold"
                    )
                here = steps.get(_evidence_key("cold-here", step))
                causes[step], cold_here[step] = cause(here, reply, cold), recorded(here)
                difference += f"; {explain(causes[step], here)}"
                problems.append(f"{step}: answer differs from cold ({difference})")
            else:
                # A miss computed again, in another batch or process: prefill is not bitwise reproducible
                # there (docs/architecture.md), and no cache was involved. Reported, apart from wrong hits.
                recomputed.append(step)
                problems.append(f"{step}: missed, and computed again it differs from cold ({difference})")
        if step == "device" or tiers.get(step, False):
            if cached is None:
                problems.append(f"{step}: cached_tokens not reported")
            elif expected is not None and cached != expected:
                problems.append(f"{step}: {cached} cached tokens, expected {expected}")
            elif not cached:
                problems.append(f"{step}: no cached tokens")
    return {
        "id": conversation["id"],
        "prompt_tokens": len(conversation["tokens"]),
        "prompt_sha256": conversation["sha256"],
        "verdict": "fail" if problems else "pass",
        "reason": "; ".join(problems),
        "hits": hits,
        "wrong": wrong,
        "recomputed_differently": recomputed,
        "sent_again": again,
        "causes": causes,  # of each wrong answer: restore_cause.py
        "cold_here": cold_here,
        "steps": steps,
    }


def _again(steps: dict[str, Any], step: str) -> dict[str, int] | None:
    """How the repeats sent after a wrong hit at `step` answered (`_send_again`): as the hit, as cold."""
    repeats = steps.get(_evidence_key("again", step))
    if not repeats:
        return None
    answered = [r for r in repeats if "error" not in r]
    return {
        "sent": len(repeats),
        "as_hit": sum(not differs(r, steps[step]) for r in answered),
        "as_cold": sum(not differs(r, steps["cold"]) for r in answered),
    }


def _evidence_key(kind: str, step: str) -> str:
    """Where `_send_again` kept `kind` ("again", "cold-here") of a wrong answer at `step`: one per round
    (its device and host hits) and one after the restart."""
    return f"{kind}-{'disk' if step == 'disk' else 'host'}"


def _first_difference(reply: dict[str, Any], cold: dict[str, Any]) -> str:
    ours, theirs = reply.get("token_logprobs") or [], cold.get("token_logprobs") or []
    index = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), None)
    if index is not None:
        return f"token {index}: logprob {ours[index]} vs {theirs[index]}"
    return "text or token count"


def _figures(results: list[dict[str, Any]]) -> dict[str, Any]:
    hits = {step: sum(step in r["hits"] for r in results) for step in STEPS[1:]}
    wrong = {step: sum(step in r["wrong"] for r in results) for step in STEPS[1:]}
    recomputed = {step: sum(step in r["recomputed_differently"] for r in results) for step in STEPS[1:]}
    causes = [found for r in results for found in r["causes"].values()]
    ttft: dict[str, float | None] = {}
    for step in STEPS:
        values = sorted(
            r["steps"][step]["ttft_s"]
            for r in results
            if step in r["steps"] and r["steps"][step].get("ttft_s") is not None
        )
        ttft[step] = values[len(values) // 2] if values else None
    return {
        "conversations": len(results),
        "hits": hits,
        "hits_total": sum(hits.values()),
        "wrong_by_step": wrong,
        "wrong_answers": sum(wrong.values()),
        "wrong_by_cause": {name: causes.count(name) for name in CAUSES},
        "recomputed_differently_by_step": recomputed,
        "median_ttft_s": ttft,
    }


def regrade(suite: dict[str, Any]) -> dict[str, Any]:
    """A recorded suite graded again with today's rules (its replies unchanged): for a qualification put
    together from runs made before a rule changed."""
    tiers, page_size = suite["tiers_declared"], suite["page_size"]
    results = []
    for case in suite["cases"]:
        conversation = {
            "id": case["id"],
            "tokens": range(case["prompt_tokens"]),
            "sha256": case["prompt_sha256"],
        }
        expected = _expected_cached(case["prompt_tokens"], page_size)
        results.append(_grade(conversation, case["steps"], tiers, expected))
    verdict = "pass" if results and all(r["verdict"] == "pass" for r in results) else "fail"
    return {**suite, "verdict": verdict, "cases": results, "figures": _figures(results)}
