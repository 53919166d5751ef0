"""`restore`: cache-hit identity. A wrong answer from a fast cache hit looks exactly like a right one.

Each case is sent, greedy, at each step; every step's text must equal the cold text, token for token:

- cold: a unique salt leads the case's first message, so at most a chat template's fixed preamble (a
  default system prompt) can be cached;
- device: sent again at once (`cached_tokens` must grow beyond cold's);
- host: after the server dropped its device cache (`POST /v1/cache/evict_device`, morion's), or where it
  has no such route after a flood of other prompts (twice the KV pool by default) pushed the cases out of
  GPU memory (growth required only when the server declares a host tier; otherwise it is recomputed);
- disk: after `--restart-cmd` and the server answering /health again (growth required only when the
  server declares a disk tier).

A server that does not report `prompt_tokens_details.cached_tokens` is checked on identity alone, and the
result says so. Steps run for all cases before the next step, so one flood and one restart serve all.
With `--restore-conversations N` the suite runs generated token-id conversations instead
(restore_tokens.py).
"""

from __future__ import annotations

import asyncio
import copy
import secrets
import subprocess
import time
from collections.abc import Callable
from typing import Any

import httpx

from morion.bench.prompts import PromptFactory
from morion.bench.remote import RemoteTarget
from morion.errors import MorionError
from morion.validate import cases as case_files
from morion.validate.session import Session
from morion.validate.streaming import RequestFailed

_DEFAULT_FLOOD_TOKENS = 262_144  # when the server does not say how large its KV pool is
_FLOOD_PROMPT_TOKENS = 4096
_FLOOD_CONCURRENCY = 4


def check(session: Session) -> None:
    """Before any suite runs: a run to resume must be readable and of generated conversations."""
    if session.options.restore_resume:
        from morion.validate import restore_tokens

        restore_tokens.earlier_run(session.options.restore_resume)


def run(session: Session, before_restart: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """`before_restart` runs just before `--restart-cmd` (a suite running beside this one ends first)."""

    def restart_after_hook(session: Session) -> dict[str, Any]:
        before_restart()
        return restart(session)

    if session.options.restore_conversations or session.options.restore_resume:
        from morion.validate import restore_tokens

        return restore_tokens.run(session, _declared_tiers(session), make_room, restart_after_hook)
    case_file = case_files.load("restore")
    data = case_file.data
    # A salt per case, not per run: cases salted alike would share their first page with each other.
    cases = [
        {"id": case["id"], "salt": secrets.token_hex(8), "messages": case["messages"]}
        for case in case_files.select(data["cases"], session.options.cases)
    ]
    for case in cases:
        case["messages"] = _salted(case["messages"], data["salt_template"].format(salt=case["salt"]))
    tiers = _declared_tiers(session)
    steps: dict[str, dict[str, Any]] = {}
    events: dict[str, Any] = {}
    steps["cold"] = _send_all(session, cases, data["max_tokens"], "cold")
    steps["device"] = _send_all(session, cases, data["max_tokens"], "device")
    events["eviction"] = make_room(session)
    steps["host"] = _send_all(session, cases, data["max_tokens"], "host")
    if session.options.restart_cmd:
        events["restart"] = restart_after_hook(session)
        steps["disk"] = _send_all(session, cases, data["max_tokens"], "disk")
    results = [
        _grade(case["id"], {step: replies[case["id"]] for step, replies in steps.items()}, tiers)
        for case in cases
    ]
    for result in results:
        session.say(f"restore {result['id']}: {result['verdict']} {result['reason']}")
    verdict = "pass" if results and all(r["verdict"] == "pass" for r in results) else "fail"
    if "error" in events["eviction"]:
        verdict = "fail"  # the host step did not follow an eviction: it proved nothing
    return {
        "verdict": verdict,
        "case_file": case_file.identity(),
        "salts": {case["id"]: case["salt"] for case in cases},
        "tiers_declared": tiers,
        "steps": list(steps),
        "events": events,
        "cases": results,
        "figures": {"ttft_s": {step: _median_ttft(replies) for step, replies in steps.items()}},
    }


def _declared_tiers(session: Session) -> dict[str, bool]:
    """Which lower tiers the server says it runs: morion's live cache stats (a disk tier can be skipped
    at start-up), else its configuration; none for a server without /v1/server_info."""
    cache = ((session.server_info or {}).get("load") or {}).get("cache") or {}
    config = session.server_config()
    return {
        "host": bool(cache.get("host_enabled", config.get("host_cache_gb"))),
        "disk": bool(cache.get("disk_enabled", config.get("disk_cache_dir"))),
    }


def _salted(messages: list[dict[str, Any]], prefix: str) -> list[dict[str, Any]]:
    salted = copy.deepcopy(messages)
    salted[0]["content"] = prefix + salted[0]["content"]
    return salted


def _send_all(
    session: Session, cases: list[dict[str, Any]], max_tokens: int, step: str
) -> dict[str, dict[str, Any]]:
    """One first attempt per case: its evidence, or the error it met."""
    replies = {}
    for case in cases:
        try:
            reply = session.chat.ask(case["messages"], max_tokens)
        except (httpx.HTTPError, RequestFailed) as error:
            replies[case["id"]] = {"error": str(error) or type(error).__name__}
            continue
        replies[case["id"]] = {**reply.evidence(), "cached_tokens": reply.cached_tokens}
    session.say(f"restore: {step} step sent ({len(cases)} cases)")
    return replies


def _grade(case_id: str, steps: dict[str, dict[str, Any]], tiers: dict[str, bool]) -> dict[str, Any]:
    problems = []
    cold = steps["cold"]
    for step, reply in steps.items():
        if "error" in reply:
            problems.append(f"{step}: {reply['error']}")
            continue
        if step != "cold" and "error" not in cold:
            if reply["content"] != cold["content"]:
                problems.append(f"{step}: text differs from cold ({reply['content'][:60]!r})")
            elif (reply["usage"] or {}).get("completion_tokens") != (cold["usage"] or {}).get(
                "completion_tokens"
            ):
                problems.append(f"{step}: completion token count differs from cold")
        cached, cold_cached = reply["cached_tokens"], cold.get("cached_tokens")
        required = step == "device" or tiers.get(step, False)
        known = cached is not None and cold_cached is not None
        if step != "cold" and required and known and cached <= cold_cached:
            problems.append(f"{step}: {cached} cached tokens, no more than cold's {cold_cached}")
    reported = all(r.get("cached_tokens") is not None for r in steps.values() if "error" not in r)
    return {
        "id": case_id,
        "verdict": "fail" if problems else "pass",
        "reason": "; ".join(problems) if problems else ("" if reported else "cached_tokens not reported"),
        "cached_tokens": {step: reply.get("cached_tokens") for step, reply in steps.items()},
        "steps": steps,
    }


def make_room(session: Session) -> dict[str, Any]:
    """Takes the cases out of the server's GPU memory: its `POST /v1/cache/evict_device` where it has one
    (morion), else a flood of other prompts."""

    async def evict() -> httpx.Response:
        async with session.endpoint.client() as client:
            return await client.post("/v1/cache/evict_device", json={})

    started = time.perf_counter()
    try:
        response = asyncio.run(evict())
    except httpx.HTTPError as error:
        return {"method": "evict_device", "error": str(error) or type(error).__name__}
    if response.status_code in (404, 405):
        return {"method": "flood", **_flood(session)}
    if response.status_code != 200:
        return {"method": "evict_device", "error": f"HTTP {response.status_code}: {response.text[:200]}"}
    pages = response.json().get("evicted_pages")
    return {"method": "evict_device", "evicted_pages": pages, "s": time.perf_counter() - started}


def _flood(session: Session) -> dict[str, Any]:
    """Unrelated fresh prompts, `max_tokens` 1, through bench's URL target: enough to evict the cases."""
    tokens = session.options.flood_tokens
    kv_tokens = session.capacity().get("kv_cache_tokens")
    source = "--flood-tokens"
    if tokens is None:
        tokens = 2 * kv_tokens if kv_tokens else _DEFAULT_FLOOD_TOKENS
        source = "twice the server's KV pool" if kv_tokens else "default (the KV pool size is not reported)"
    limit = session.capacity().get("max_model_len") or _FLOOD_PROMPT_TOKENS + 1
    length = min(_FLOOD_PROMPT_TOKENS, limit - 1)
    started = time.perf_counter()
    options = session.options
    target = RemoteTarget(options.url, session.model, options.api_key, options.request_timeout_s, None)
    prompts = PromptFactory(target.vocab_size)
    sent = requests = 0
    try:
        while sent < tokens:
            group = [prompts.make(f"flood:{requests + i}", length) for i in range(_FLOOD_CONCURRENCY)]
            target.run_group(group, 1)
            sent += length * len(group)
            requests += len(group)
    except MorionError as error:
        return {"error": str(error), "tokens": sent, "requests": requests}
    finally:
        target.close()
    seconds = time.perf_counter() - started
    session.say(f"restore: flooded {sent:,} prompt tokens in {requests} requests ({seconds:.1f} s)")
    return {
        "tokens": sent,
        "requests": requests,
        "prompt_tokens_each": length,
        "source": source,
        "s": seconds,
    }


def restart(session: Session) -> dict[str, Any]:
    command = session.options.restart_cmd
    timeout = session.options.restart_timeout_s
    session.say(f"restore: restarting the server: {command}")
    started = time.monotonic()
    try:
        done = subprocess.run(
            command, shell=True, timeout=timeout, capture_output=True, text=True, check=False
        )
    except subprocess.TimeoutExpired:
        raise MorionError(f"--restart-cmd did not finish in {timeout:g} s") from None
    if done.returncode != 0:
        raise MorionError(f"--restart-cmd exited with {done.returncode}: {done.stderr.strip()[-300:]}")
    ready_after = session.wait_healthy(max(1.0, timeout - (time.monotonic() - started)))
    return {"command": command, "exit_status": done.returncode, "healthy_after_s": ready_after}


def _median_ttft(replies: dict[str, dict[str, Any]]) -> float | None:
    values = sorted(r["ttft_s"] for r in replies.values() if r.get("ttft_s") is not None)
    return values[len(values) // 2] if values else None
