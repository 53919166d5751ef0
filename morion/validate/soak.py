"""`soak`: N concurrent clients holding multi-turn conversations for M minutes (or a request count).

Each client takes the next conversation of the case file and sends its user turns one at a time with the
growing history (its own greedy replies appended), then starts the next. Every request is a first attempt:
an error is recorded and the client moves on to a new conversation, never retrying. With `--soak-prompts
token-ids` (a server without a tokenizer or chat template: a random-weight preset) the turns are blocks of
`--soak-turn-tokens` random token ids on `/v1/completions`, the history growing by a block a turn (the
replies are not appended: the next turn still extends a cached prefix).

Recorded per request: start time, TTFT, the gaps between content chunks (inter-token latency at the
client), tokens, finish reason; errors, empty replies (no text, no tool call) and truncated streams (no
finish reason or no `[DONE]`). Drift: p50/p99 TTFT and ITL in equal time windows. Memory: the growth of
`process_resident_memory_bytes` in /metrics between the start and the idle end, when the server exports
it (vLLM, SGLang; morion adds its engine process's `morion_engine_process_resident_memory_bytes`), less
the growth of what the server says its caches hold by design (`morion_engine_cache_memory_bytes`:
index entries and the resident part of preallocated pools, each bounded by a configured capacity). A
soak beside restore fills the tiers: on the first H200 qualification the radix tree alone took 48 MB of
the 208 MiB growth, and a cache that fills to its capacity is not a leak; whatever else grows still
counts. A morion server is also checked for pages still held when idle (a leak) through /v1/server_info.
Pass: zero errors, empties and truncations, growth within --soak-max-growth-mib, nothing held when idle.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import httpx

from morion.bench.prompts import PromptFactory
from morion.validate import cases as case_files
from morion.validate.completions import complete
from morion.validate.session import Session
from morion.validate.streaming import RequestFailed

_WINDOWS = 6
_RSS = "process_resident_memory_bytes"
# morion serves from two processes: the front end exports its own process_* series and the engine's
# resident memory as morion_engine_process_*. The soak bound applies to their sum.
_ENGINE_RSS = "morion_engine_process_resident_memory_bytes"
# What the caches hold by design (morion/cache/cache_memory.py), measured by the engine when idle.
_CACHE_MEMORY = "morion_engine_cache_memory_bytes"
_IDLE_WAIT_S = 10.0  # for the server to settle (finish aborted work) before the idle checks
# Once idle, before the memory and the pool's state are read: a server may give freed memory back after a
# moment of idleness (morion's engine after 1 s: morion/server/heap_trim.py), and morion checks its pool's
# integrity once idle for 0.1 s (morion/server/engine_process.py).
_SETTLE_S = 2.0


def run(
    session: Session, idle_wait_s: float = _IDLE_WAIT_S, before_end: Callable[[], object] = lambda: None
) -> dict[str, Any]:
    """`idle_wait_s`: how long the end checks wait for the server to go idle (longer when another suite
    runs beside this one: `--soak-during-restore`). `before_end` returns when the end may be measured:
    beside restore, once restore's traffic is over, so that memory is compared between two idle points
    (between two requests of restore the server is idle too, but only for a moment, and busy again by
    the time /metrics is read)."""
    case_file = case_files.load("soak")
    data = case_file.data
    conversations = case_files.select(data["conversations"], session.options.cases)
    options = session.options
    before = session.metrics() or {}
    session.say(
        f"soak: {options.soak_clients} clients ({options.soak_prompts} prompts) for up to "
        f"{options.soak_minutes:g} min"
        + (f" or {options.soak_max_requests} requests" if options.soak_max_requests else "")
    )
    started = time.perf_counter()
    max_tokens = options.soak_max_tokens or data["max_tokens"]
    records = asyncio.run(_soak(session, conversations, max_tokens, started))
    elapsed = time.perf_counter() - started
    before_end()
    _idle_state(session, idle_wait_s)
    time.sleep(_SETTLE_S)
    idle = _idle_state(session, idle_wait_s)
    after = session.metrics() or {}
    problems = []
    counts = {
        "requests": len(records),
        "errors": sum(1 for r in records if r["error"]),
        "empty": sum(1 for r in records if r["empty"]),
        "truncated": sum(1 for r in records if r["truncated"]),
    }
    for key in ("errors", "empty", "truncated"):
        if counts[key]:
            problems.append(f"{counts[key]} {key}")
    if not records:
        problems.append("no request was sent")
    memory = _memory_growth(before, after)
    growth_mib = memory["memory_growth_mib"]
    if growth_mib is not None and growth_mib > options.soak_max_growth_mib:
        beyond = " beyond the caches" if memory["cache_memory_growth_mib"] is not None else ""
        problems.append(
            f"resident memory grew {growth_mib:.0f} MiB{beyond} (bound {options.soak_max_growth_mib:g})"
        )
    if idle.get("pages_held"):
        problems.append(f"{idle['pages_held']} KV pages still held when idle")
    if idle.get("integrity") not in (None, "ok"):
        problems.append(f"pool integrity {idle['integrity']!r} when idle")
    windows = _windows(records, elapsed)
    session.say(
        f"soak: {counts['requests']} requests in {elapsed:.0f} s, {counts['errors']} errors: "
        + ("pass" if not problems else "fail: " + "; ".join(problems))
    )
    return {
        "verdict": "fail" if problems else "pass",
        "reason": "; ".join(problems),
        "case_file": case_file.identity(),
        "bounds": {"max_growth_mib": options.soak_max_growth_mib},
        "figures": {
            **counts,
            "elapsed_s": elapsed,
            **memory,
            "idle": idle,
            "windows": windows,
            "drift": _drift(windows),
        },
        "requests": records,
    }


async def _soak(
    session: Session, conversations: list[dict[str, Any]], max_tokens: int, started: float
) -> list[dict[str, Any]]:
    options = session.options
    deadline = started + options.soak_minutes * 60
    records: list[dict[str, Any]] = []
    budget = [options.soak_max_requests or None]  # shared count bound; None: time only

    def may_send() -> bool:
        if time.perf_counter() >= deadline or budget[0] == 0:
            return False
        if budget[0] is not None:
            budget[0] -= 1
        return True

    vocab = ((session.server_info or {}).get("model") or {}).get("vocab_size")
    blocks = PromptFactory(vocab)

    async def client_loop(client_id: int, client: httpx.AsyncClient) -> None:
        index = client_id
        while True:
            conversation = conversations[index % len(conversations)]
            index += options.soak_clients
            messages: list[dict[str, Any]] = []
            history: list[int] = []
            for turn, text in enumerate(conversation["turns"]):
                if not may_send():
                    return
                record = {"client": client_id, "conversation": conversation["id"], "turn": turn}
                record["t_s"] = time.perf_counter() - started
                try:
                    if options.soak_prompts == "token-ids":
                        history += blocks.make(f"soak:{client_id}:{index}:{turn}", options.soak_turn_tokens)
                        reply = await complete(client, session.model, history, max_tokens)
                        empty = not reply.completion_tokens
                    else:
                        messages.append({"role": "user", "content": text})
                        reply = await session.chat.send(client, messages, max_tokens)
                        empty = not reply.content and not reply.tool_calls
                        messages.append({"role": "assistant", "content": reply.content})
                except (httpx.HTTPError, RequestFailed) as error:
                    records.append({**record, **_failed(error)})
                    break  # a new conversation: the history of this one is broken
                records.append(
                    {
                        **record,
                        "error": None,
                        "empty": empty,
                        "truncated": not reply.done or reply.finish_reason is None,
                        "finish_reason": reply.finish_reason,
                        "completion_tokens": reply.completion_tokens,
                        "prompt_tokens": reply.prompt_tokens,
                        "ttft_s": reply.ttft_s,
                        "itl_s": reply.chunk_gaps_s,
                        "latency_s": reply.latency_s,
                    }
                )

    async with session.endpoint.client(max_connections=options.soak_clients + 1) as client:
        await asyncio.gather(*(client_loop(i, client) for i in range(options.soak_clients)))
    return sorted(records, key=lambda r: r["t_s"])


def _memory_growth(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """Resident growth of the server's processes, the growth of what its caches hold by design (where it
    says), and the difference, which is what the bound judges. Signed: caches that shrank while resident
    memory did not leave that much unexplained growth."""
    rss = [name for name in (_RSS, _ENGINE_RSS) if name in before and name in after]
    if _RSS not in rss:
        return {
            "memory_growth_mib": None,
            "resident_growth_mib": None,
            "cache_memory_growth_mib": None,
            "memory_metric": None,
        }
    resident = sum(after[name] - before[name] for name in rss) / 2**20
    metric = " + ".join(rss)
    cache = None
    if _CACHE_MEMORY in before and _CACHE_MEMORY in after:
        cache = (after[_CACHE_MEMORY] - before[_CACHE_MEMORY]) / 2**20
        metric = f"{metric} - {_CACHE_MEMORY}"
    return {
        "memory_growth_mib": resident - (cache or 0.0),
        "resident_growth_mib": resident,
        "cache_memory_growth_mib": cache,
        "memory_metric": metric,
    }


def _failed(error: Exception) -> dict[str, Any]:
    return {"error": str(error) or type(error).__name__, "empty": False, "truncated": False}


def _idle_state(session: Session, wait_s: float) -> dict[str, Any]:
    """morion's pool load once idle (pages held must be 0); empty for servers without /v1/server_info."""
    deadline = time.monotonic() + wait_s
    while True:
        info = session.endpoint.server_info() or {}
        load = info.get("load") or {}
        if not load or (not load.get("running") and not load.get("waiting")) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    keys = ("running", "waiting", "pages_held", "integrity")
    return {key: load[key] for key in keys if key in load}


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0-100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))  # ceil
    return ordered[int(rank) - 1]


def _windows(records: list[dict[str, Any]], elapsed: float) -> list[dict[str, Any]]:
    """Equal time windows by request start: count, errors, p50/p99 TTFT and ITL."""
    width = max(elapsed, 1e-9) / _WINDOWS
    windows = []
    for w in range(_WINDOWS):
        inside = [
            r
            for r in records
            if w * width <= r["t_s"] < (w + 1) * width or (w == _WINDOWS - 1 and r["t_s"] >= elapsed)
        ]
        ttft = [r["ttft_s"] for r in inside if r.get("ttft_s") is not None]
        itl = [gap for r in inside for gap in r.get("itl_s") or ()]
        windows.append(
            {
                "start_s": w * width,
                "end_s": (w + 1) * width,
                "requests": len(inside),
                "errors": sum(1 for r in inside if r["error"]),
                "ttft_p50_s": percentile(ttft, 50),
                "ttft_p99_s": percentile(ttft, 99),
                "itl_p50_s": percentile(itl, 50),
                "itl_p99_s": percentile(itl, 99),
            }
        )
    return windows


def _drift(windows: list[dict[str, Any]]) -> dict[str, float | None]:
    """Last window's p50 over the first's (1.0: no drift), from the first and last windows with data."""
    drift: dict[str, float | None] = {}
    for key in ("ttft_p50_s", "itl_p50_s"):
        values = [w[key] for w in windows if w[key]]
        drift[key.replace("_s", "_ratio")] = values[-1] / values[0] if len(values) >= 2 else None
    return drift
