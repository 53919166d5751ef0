"""The Markdown report of a validation run, made from its results JSON alone: what was validated where,
one section per suite with its verdict, its cases and its figures."""

from __future__ import annotations

from typing import Any

from morion.bench.timing import median_of
from morion.validate.restore_cause import by_cause


def markdown(result: dict[str, Any], images: dict[str, str]) -> str:
    """`images`: suite -> PNG file name beside the report."""
    lines = _header(result)
    for name, suite in result["suites"].items():
        lines += [f"## {name}: **{suite['verdict']}**", ""]
        if suite.get("reason"):
            lines += [suite["reason"], ""]
        if suite.get("case_file"):
            ident = suite["case_file"]
            lines += [f"Cases: `{ident['file']}` (SHA-256 `{ident['sha256']}`).", ""]
        lines += _SECTIONS.get(name, lambda s: [])(suite)
        if name in images:
            lines += [f"![{name}]({images[name]})", ""]
    return "\n".join(lines)


def _header(result: dict[str, Any]) -> list[str]:
    prov = result["provenance"]
    server = result["server"]
    info = server.get("server_info") or {}
    commit = (prov.get("git_commit") or "unknown")[:12] + (" (dirty)" if prov.get("git_dirty") else "")
    identity = (
        f"morion {info.get('version')}, model `{(info.get('model') or {}).get('path')}`"
        if info
        else f"models listed: {', '.join(server['models_listed'])}"
    )
    verdicts = ", ".join(f"{name} {suite['verdict']}" for name, suite in result["suites"].items())
    return [
        f"# morion validate: {result['label']} ({result['date']})",
        "",
        f"`{prov.get('command', '')}`",
        "",
        f"**{(result['verdict'] or 'incomplete').upper()}** ({verdicts}). Server {server['url']}, served "
        f"model `{server['served_model']}` ({identity}). Client: morion {prov.get('morion_version')} at "
        f"commit `{commit}`, httpx {prov.get('httpx')}, Python {prov.get('python')}, host "
        f"{prov.get('hostname')}. Status {result['status']}; every reply raw in the JSON beside this file.",
        "",
    ]


def _table(header: tuple[str, ...], rows: list[tuple[Any, ...]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell).replace("|", "\\|") for cell in row) + " |" for row in rows]
    return [*lines, ""]


def _ms(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds * 1e3:,.0f}"


def _needle(suite: dict[str, Any]) -> list[str]:
    rows = [
        (
            case["id"],
            f"{case['target_tokens']:,}",
            case.get("counted_tokens", "—"),
            _ms((case.get("reply") or {}).get("ttft_s")),
            (case.get("follow_up") or {}).get("passed", "—"),
            case["verdict"],
            case.get("reason", ""),
        )
        for case in suite.get("cases", [])
    ]
    return [
        f"Prompts counted by `{suite.get('counted_by')}`.",
        "",
        *_table(("case", "target tokens", "counted", "TTFT ms", "follow-up", "verdict", "why"), rows),
    ]


def _restore(suite: dict[str, Any]) -> list[str]:
    if "steps" not in suite:
        return _restore_conversations(suite)
    steps = suite["steps"]
    rows = [
        (
            case["id"],
            *(case["cached_tokens"].get(step, "—") for step in steps),
            case["verdict"],
            case["reason"],
        )
        for case in suite["cases"]
    ]
    ttft = suite["figures"]["ttft_s"]
    lines = [
        f"Salts {suite['salts']}; tiers declared by the server: {suite['tiers_declared']}. Before the host "
        f"step: {_eviction(suite['events']['eviction'])}.",
        "",
        *_table(("case", *(f"cached ({s})" for s in steps), "verdict", "why"), rows),
        "Median TTFT ms by step: " + ", ".join(f"{step} {_ms(value)}" for step, value in ttft.items()) + ".",
        "",
    ]
    return lines


def _eviction(event: dict[str, Any]) -> str:
    if "error" in event:
        return f"eviction failed ({event['error']})"
    if event["method"] == "evict_device":
        return f"the server dropped its device cache ({event['evicted_pages']:,} pages)"
    return f"a flood of {event.get('tokens', 0):,} prompt tokens ({event.get('source')})"


def _restore_conversations(suite: dict[str, Any]) -> list[str]:
    figures, lengths = suite["figures"], suite["lengths"]
    hits, wrong = figures["hits"], figures["wrong_by_step"]
    rows = [
        (step, hits[step], wrong[step], _ms(figures["median_ttft_s"][step]))
        for step in ("device", "host", "disk")
    ]
    failed = [case for case in suite["cases"] if case["verdict"] != "pass"]
    drawn = lengths["drawn"]
    evictions = suite["events"]["evictions"]
    lines = [
        f"{figures['conversations']} generated token-id conversations (seed {suite['seed']}), "
        f"{min(drawn):,} to {max(drawn):,} prompt tokens ({sum(drawn):,} in all; drawn from "
        f"{lengths['min']:,}:{lengths['max']:,}), page size {suite['page_size']}; tiers declared by the "
        f"server: {suite['tiers_declared']}. Before each round's host step: "
        f"{_eviction(evictions[0]) if evictions else 'none'} ({len(evictions)} rounds).",
        "",
        f"**{figures['hits_total']} hits, {figures['wrong_answers']} wrong answers** (an answer is wrong "
        "when its text, any token's log probability or its token ids differ from cold)."
        + (f" {by_cause(figures.get('wrong_by_cause'))}" if figures["wrong_answers"] else ""),
        "",
        *_table(("step", "hits", "wrong answers", "median TTFT ms"), rows),
        f"Cold median TTFT: {_ms(figures['median_ttft_s']['cold'])} ms. Server cache counters over the "
        f"steps (all traffic): {suite['events']['counters']}.",
        "",
    ]
    if failed:
        lines += [
            *_table(
                ("conversation", "tokens", "cause", "why"),
                [(c["id"], c["prompt_tokens"], _causes(c), c["reason"]) for c in failed],
            )
        ]
    return lines


def _causes(case: dict[str, Any]) -> str:
    return ", ".join(f"{step}: {found}" for step, found in (case.get("causes") or {}).items()) or "—"


def _soak(suite: dict[str, Any]) -> list[str]:
    fig = suite["figures"]
    growth = fig["memory_growth_mib"]
    rows = [
        (
            f"{w['start_s']:.0f}-{w['end_s']:.0f}",
            w["requests"],
            w["errors"],
            _ms(w["ttft_p50_s"]),
            _ms(w["ttft_p99_s"]),
            _ms(w["itl_p50_s"]),
            _ms(w["itl_p99_s"]),
        )
        for w in fig["windows"]
    ]
    memory = (
        "not exported"
        if growth is None
        else f"{growth:+.1f} MiB (bound {suite['bounds']['max_growth_mib']:g})"
    )
    if fig.get("cache_memory_growth_mib") is not None:
        memory += (
            f": {fig['resident_growth_mib']:+.1f} MiB resident, of which the caches hold "
            f"{fig['cache_memory_growth_mib']:+.1f} MiB by design"
        )
    return [
        f"{fig['requests']} requests in {fig['elapsed_s']:.0f} s: {fig['errors']} errors, "
        f"{fig['empty']} empty, {fig['truncated']} truncated. Resident memory growth: {memory}. "
        f"Idle: {fig['idle'] or 'not reported'}. Drift, last window p50 / first: {_drift(fig['drift'])}.",
        "",
        *_table(
            ("window s", "requests", "errors", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms"), rows
        ),
    ]


def _drift(drift: dict[str, float | None]) -> str:
    return ", ".join(
        f"{key.split('_')[0].upper()} " + ("—" if value is None else f"x{value:.2f}")
        for key, value in drift.items()
    )


def _perf(suite: dict[str, Any]) -> list[str]:
    if "decode" not in suite:
        return []
    decode = [
        (
            p["concurrency"],
            f"{p['context']:,}",
            _num(p["median"]["per_request_tok_s"]),
            _num(p["median"]["aggregate_tok_s"]),
            _ms(p["median"]["ttft_s"]),
        )
        for p in suite["decode"]
    ]
    prefill = [_prefill_row(p) for p in suite["prefill"]]
    settings = suite["settings"]
    return [
        f"Decode, {settings['output_tokens']} tokens per request, median of {settings['repeats']} runs "
        "(definitions in the JSON, as docs/bench.md):",
        "",
        *_table(("C", "context", "per-request tok/s", "aggregate tok/s", "TTFT ms"), decode),
        *_table(PREFILL_COLUMNS, prefill),
    ]


PREFILL_COLUMNS = (
    "cold prefill tokens",
    "TTFT ms",
    "prefill tok/s",
    "engine prefill ms",
    "engine thread on / off CPU ms",
)


def _prefill_row(point: dict[str, Any]) -> tuple[str, ...]:
    """A prefill point's row of PREFILL_COLUMNS: its medians, with the engine's prefill part and its
    stepping thread's time on and off a CPU during it where the server tells (bench/first_token_parts.py;
    "—" elsewhere)."""
    runs, median = point["runs"], point["median"]
    prefill = median_of([run.get("ttft_parts") or {} for run in runs], "prefill_s")
    threads = [run["engine_thread"] for run in runs if run.get("engine_thread")]
    thread = "—"
    if threads:
        thread = f"{_ms(median_of(threads, 'on_cpu_s'))} / {_ms(median_of(threads, 'off_cpu_s'))}"
    tokens = f"{point['prompt_tokens']:,}"
    return (tokens, _ms(median["ttft_s"]), _num(median["prefill_tok_s"]), _ms(prefill), thread)


def _tools(suite: dict[str, Any]) -> list[str]:
    rows = [
        (case["id"], case["exact_calls"], case["arguments_parsed"], case["verdict"], case["reason"])
        for case in suite.get("cases", [])
    ]
    return _table(("case", "exact calls", "JSON arguments", "verdict", "why"), rows) if rows else []


def _num(value: float | None) -> str:
    return "—" if value is None else f"{value:,.1f}"


def _vision(suite: dict[str, Any]) -> list[str]:
    rows = [
        (case["id"], case["expected_image_tokens"], case.get("image_tokens", case.get("prompt_growth")),
         case.get("cached_tokens"), case["verdict"], case.get("reason", ""))
        for case in suite.get("cases", [])
    ]  # fmt: skip
    lines = [f"Image tokens expected from the processor settings of: {suite.get('processing')}.", ""]
    lines += _table(
        ("case", "expected image tokens", "counted", "cached (first, repeat)", "verdict", "why"), rows
    )
    corrupt = suite.get("corrupt_image") or {}
    return [
        *lines,
        f"Corrupt image: HTTP {corrupt.get('status')} ({'pass' if corrupt.get('pass') else 'FAIL'}).",
        "",
    ]


_SECTIONS = {
    "needle": _needle,
    "restore": _restore,
    "soak": _soak,
    "perf": _perf,
    "tools": _tools,
    "vision": _vision,
}
