"""One GPU build's qualification from its pieces (`scripts/gpu_qualify.sh`): `morion validate restore soak
perf` against `morion serve` (one results JSON) and `morion bench` offline with the same engine flags on
the same machine (another), into `<date>-<label>.json` + `.md`.

The verdict: every restored answer identical to its cold one (0 wrong answers), at least `--min-hits`
hits on each lower tier and on the device, the soak clean and bounded, the perf figures valid. The
through-the-server speed is reported against offline as ratios with issue #20's targets (C1 per-request
>= 0.97, aggregate at the highest concurrency >= 0.9): reported, never a reason for the exit status.

    python -m morion.validate.qualify --validate V.json --offline B.json --label h200-qualify-MODEL
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from morion.bench.report import output_paths, parts_sentence, write_json
from morion.validate.restore_cause import by_cause
from morion.validate.restore_tokens import regrade

SCHEMA = "morion-qualify/1"
TIERS = ("device", "host", "disk")
# Through the server over offline, same flags and machine (issue #20).
RATIO_TARGETS = {"per_request_tok_s": 0.97, "aggregate_tok_s": 0.9}


def summarize(
    validate: dict[str, Any],
    offline: dict[str, Any] | None,
    min_hits: int,
    turn: dict[str, Any] | None = None,
    turn_target_s: float | None = None,
) -> dict[str, Any]:
    suites = validate["suites"]
    problems = []
    restore = suites.get("restore") or {}
    if "seed" in restore:  # generated conversations: graded with today's rules
        restore = regrade(restore)
    figures = restore.get("figures") or {}
    hits, wrong = figures.get("hits") or {}, figures.get("wrong_answers")
    if not restore or "hits" not in figures:
        problems.append("no generated-conversation restore suite")
    else:
        if wrong:  # whatever their causes: a wrong answer is wrong
            counts = figures.get("wrong_by_cause") or {}
            causes = ", ".join(f"{name} {count}" for name, count in counts.items() if count)
            problems.append(f"{wrong} wrong answers" + (f" ({causes})" if causes else ""))
        short = [f"{tier} {hits.get(tier, 0)}" for tier in TIERS if hits.get(tier, 0) < min_hits]
        if short:
            problems.append(f"fewer than {min_hits} hits: {', '.join(short)}")
        if restore.get("verdict") != "pass":
            problems.append("restore failed")
    for name in ("soak", "perf"):
        suite = suites.get(name)
        if suite is None:
            problems.append(f"no {name} suite")
        elif suite.get("verdict") != "pass":
            problems.append(f"{name} failed: {suite.get('reason')}")
    return {
        "schema": SCHEMA,
        "verdict": "fail" if problems else "pass",
        "problems": problems,
        "restore": {
            "conversations": figures.get("conversations"),
            "hits": hits,
            "hits_total": figures.get("hits_total"),
            "wrong_answers": wrong,
            "wrong_by_step": figures.get("wrong_by_step"),
            "wrong_by_cause": figures.get("wrong_by_cause"),
            "recomputed_differently_by_step": figures.get("recomputed_differently_by_step"),
            "median_ttft_s": figures.get("median_ttft_s"),
            "lengths": {k: v for k, v in (restore.get("lengths") or {}).items() if k != "drawn"},
            "wrong_cases": [
                {
                    "id": c["id"],
                    "prompt_tokens": c["prompt_tokens"],
                    "causes": c.get("causes"),
                    "reason": c["reason"],
                }
                for c in restore.get("cases") or []
                if c.get("wrong")
            ],
        },
        "soak": _soak(suites.get("soak")),
        "perf": _perf(suites.get("perf"), offline),
        "turn": _turn(turn, turn_target_s, offline),
    }


def _turn(
    bench: dict[str, Any] | None, target_s: float | None, offline: dict[str, Any] | None
) -> dict[str, Any] | None:
    """An agent turn's TTFT through the server (`morion bench --url ... --workloads turn`, issue #24):
    reported beside its target, not part of the verdict (the restore suite gates cached answers), and
    beside the offline bench's turn where it ran one (same engine flags and machine: what the server
    adds)."""
    turn = (bench or {}).get("turn")
    if not turn:
        return None
    median = turn.get("median") or {}
    ttft = median.get("turn_ttft_s")
    offline_turn = (offline or {}).get("turn") or {}
    same_shape = all(offline_turn.get(key) == turn[key] for key in ("prefix_tokens", "new_tokens"))
    return {
        "offline_turn_ttft_s": (offline_turn.get("median") or {}).get("turn_ttft_s") if same_shape else None,
        # Where the turn's TTFT went through the server and offline (bench/first_token_parts.py).
        "turn_parts": turn.get("turn_parts"),
        "offline_turn_parts": offline_turn.get("turn_parts") if same_shape else None,
        "prefix_tokens": turn["prefix_tokens"],
        "new_tokens": turn["new_tokens"],
        "repeats": len(turn.get("runs") or []),
        "prime_ttft_s": median.get("prime_ttft_s"),
        "turn_ttft_s": ttft,
        "ratio_to_cold": turn.get("ratio_to_cold"),
        "failures": turn.get("failures") or [],
        "target_ttft_s": target_s,
        "met": None if target_s is None or ttft is None else ttft <= target_s,
    }


def _soak(suite: dict[str, Any] | None) -> dict[str, Any] | None:
    if suite is None:
        return None
    figures = suite["figures"]
    keys = (
        "requests",
        "errors",
        "empty",
        "truncated",
        "elapsed_s",
        "memory_growth_mib",
        "resident_growth_mib",
        "cache_memory_growth_mib",
        "idle",
        "drift",
    )
    return {"verdict": suite["verdict"], **{key: figures.get(key) for key in keys}}


def _points(decode: list[dict[str, Any]]) -> dict[tuple[int, int], dict[str, float]]:
    return {(p["concurrency"], p["context"]): p["median"] for p in decode}


def _perf(suite: dict[str, Any] | None, offline: dict[str, Any] | None) -> dict[str, Any] | None:
    if suite is None:
        return None
    served = _points(suite["decode"])
    alone = _points(offline["decode"]) if offline else {}
    top = max(concurrency for concurrency, _ in served)
    rows = []
    for (concurrency, context), median in sorted(served.items()):
        other = alone.get((concurrency, context))
        row: dict[str, Any] = {
            "concurrency": concurrency,
            "context": context,
            "server": median,
            "offline": other,
        }
        if other:
            # A side can lack a figure: a request whose tokens all reached the client in one read has no
            # post-first-token rate (a loaded CPU). No ratio then, and its target reads as not measured.
            row["ratios"] = {
                key: median[key] / other[key]
                for key in ("per_request_tok_s", "aggregate_tok_s", "ttft_s")
                if median.get(key) is not None and other.get(key)
            }
            checked = ["per_request_tok_s"] if concurrency == 1 else []
            checked += ["aggregate_tok_s"] if concurrency == top and concurrency > 1 else []
            row["targets"] = {
                key: {
                    "target": RATIO_TARGETS[key],
                    "met": row["ratios"][key] >= RATIO_TARGETS[key] if key in row["ratios"] else None,
                }
                for key in checked
            }
        rows.append(row)
    prefill = [
        {"prompt_tokens": p["prompt_tokens"], "server": p.get("median")} for p in suite.get("prefill", [])
    ]
    return {"decode": rows, "prefill": prefill, "forwards": suite.get("forwards")}


def markdown(result: dict[str, Any]) -> str:
    summary, prov = result["summary"], result["provenance"]
    restore, soak, perf = summary["restore"], summary["soak"], summary["perf"]
    gpu = ", ".join(f"{g['name']} (driver {g['driver_version']})" for g in prov.get("gpus") or []) or "no GPU"
    lines = [
        f"# Qualification: {result['label']} ({result['date']})",
        "",
        f"**{summary['verdict'].upper()}**"
        + (f": {'; '.join(summary['problems'])}" if summary["problems"] else ""),
        "",
        f"`morion serve` {result['serve_command']}, then `{prov['command']}`; offline: "
        f"`{result['offline_command']}`. Commit `{prov.get('git_commit')}`"
        f"{' (dirty)' if prov.get('git_dirty') else ''}, {gpu}, torch {prov.get('torch')}, triton "
        f"{prov.get('triton')}, {prov.get('time_utc')}. Raw: `{result['sources']['validate']}`"
        + (f", `{result['sources']['offline']}`" if result["sources"].get("offline") else "")
        + ".",
        "",
        "## Restore identity (generated token-id conversations, soak traffic beside them)",
        "",
        f"{restore['conversations']} conversations, prompt lengths drawn from "
        f"{restore['lengths'].get('min'):,} to {restore['lengths'].get('max'):,} tokens. "
        f"**{restore['hits_total']} hits, {restore['wrong_answers']} wrong answers.**",
        "",
        "| step | hits | wrong answers (hits) | misses computed again differently | median TTFT ms |",
        "|---|---:|---:|---:|---:|",
    ]
    ttft = restore.get("median_ttft_s") or {}
    for step in ("cold", *TIERS):
        hits = "—" if step == "cold" else restore["hits"].get(step, 0)
        wrong = "—" if step == "cold" else (restore.get("wrong_by_step") or {}).get(step, 0)
        other = "—" if step == "cold" else (restore.get("recomputed_differently_by_step") or {}).get(step, 0)
        lines.append(f"| {step} | {hits} | {wrong} | {other} | {_ms(ttft.get(step))} |")
    if restore.get("wrong_cases"):
        lines += ["", f"Wrong answers. {by_cause(restore.get('wrong_by_cause'))}", ""]
    for case in restore.get("wrong_cases") or []:
        causes = ", ".join(f"{step} {found}" for step, found in (case.get("causes") or {}).items()) or "—"
        lines.append(f"- {case['id']} ({case['prompt_tokens']:,} tokens; cause {causes}): {case['reason']}")
    if soak:
        lines += [
            "",
            "## Soak",
            "",
            f"{soak['verdict']}: {soak['requests']} requests in {soak['elapsed_s']:.0f} s, "
            f"{soak['errors']} errors, {soak['empty']} empty, {soak['truncated']} truncated; "
            f"resident memory growth beyond the caches {_num(soak['memory_growth_mib'])} MiB "
            f"({_num(soak.get('resident_growth_mib'))} MiB in all); idle {soak['idle']}; "
            f"drift {soak['drift']}.",
        ]
    if perf:
        lines += [
            "",
            "## Decode through the server and offline (same flags, same machine; median of runs)",
            "",
            "| C | context | server tok/s per request | offline | ratio | server aggregate | offline | "
            "ratio | server TTFT ms | offline |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for row in perf["decode"]:
            server, offline, ratios = row["server"], row.get("offline") or {}, row.get("ratios") or {}
            lines.append(
                f"| {row['concurrency']} | {row['context']:,} | {_num(server['per_request_tok_s'])} | "
                f"{_num(offline.get('per_request_tok_s'))} | {_ratio(ratios, 'per_request_tok_s', row)} | "
                f"{_num(server['aggregate_tok_s'])} | {_num(offline.get('aggregate_tok_s'))} | "
                f"{_ratio(ratios, 'aggregate_tok_s', row)} | {_ms(server['ttft_s'])} | "
                f"{_ms(offline.get('ttft_s'))} |"
            )
        lines += [
            "",
            "Ratio targets (issue #20): C1 per request >= 0.97, aggregate at the highest C >= 0.9; "
            "a ✓ or ✗ marks the checked ones.",
            "",
            "Where a step's time goes: the client's time per token (1 / per-request rate) beside the "
            "engine's own decode step (`Engine.step` wall time, from the server's /metrics and in-process "
            "offline; engine/step_timing.py). Client minus engine is the serving path (engine loop, IPC, "
            "front end, HTTP, client).",
            "",
            "| C | context | server: client ms/token | server: engine decode step ms | "
            "offline: client ms/token | offline: engine decode step ms |",
            "|---:|---:|---:|---:|---:|---:|",
        ]
        for row in perf["decode"]:
            server, offline = row["server"], row.get("offline") or {}
            lines.append(
                f"| {row['concurrency']} | {row['context']:,} | {_ms(server.get('step_s'), 2)} | "
                f"{_fixed(server.get('engine_decode_step_ms'))} | {_ms(offline.get('step_s'), 2)} | "
                f"{_fixed(offline.get('engine_decode_step_ms'))} |"
            )
        lines += _prefill_lines(perf["prefill"])
        lines += _forward_lines(perf.get("forwards"))
    lines += _turn_lines(summary.get("turn"))
    return "\n".join(lines) + "\n"


def _prefill_lines(prefill: list[dict[str, Any]]) -> list[str]:
    """The cold prefill points through the server (issue #24's TTFT at 1K and tok/s at longer prompts)."""
    if not prefill:
        return []
    lines = [
        "",
        "Cold prefill through the server (a fresh prompt alone, max_tokens 1; median of runs):",
        "",
        "| prompt tokens | TTFT ms | prefill tok/s |",
        "|---:|---:|---:|",
    ]
    for point in prefill:
        median = point["server"] or {}
        ttft, rate = _ms(median.get("ttft_s")), _num(median.get("prefill_tok_s"))
        lines.append(f"| {point['prompt_tokens']:,} | {ttft} | {rate} |")
    return lines


def _forward_lines(forwards: dict[str, int] | None) -> list[str]:
    """How the server's engine ran the perf sweep's forwards (runner/forward_counts.py)."""
    if not forwards:
        return []
    kinds = dict.fromkeys(key.split("/")[0] for key in forwards)
    parts = [
        f"{kind} {forwards.get(kind + '/graph', 0):,} / {forwards.get(kind + '/eager', 0):,}"
        for kind in kinds
    ]
    return [
        "",
        "Forwards the server's engine ran for the sweep, replayed from a CUDA graph / eager: "
        + "; ".join(parts)
        + ".",
    ]


def _turn_lines(turn: dict[str, Any] | None) -> list[str]:
    if not turn:
        return []
    target = ""
    if turn["target_ttft_s"] is not None:
        target = f" (target <= {_ms(turn['target_ttft_s'])} ms {'✓' if turn['met'] else '✗'})"
    ratio = turn["ratio_to_cold"]
    offline = turn.get("offline_turn_ttft_s")  # absent from summaries written before it was reported
    lines = [
        "",
        "## An agent turn through the server (issue #24)",
        "",
        f"{turn['new_tokens']:,} new tokens on a cached {turn['prefix_tokens']:,}-token conversation, "
        f"max_tokens 1, median of {turn['repeats']}: turn TTFT **{_ms(turn['turn_ttft_s'])} ms**{target}; "
        f"the conversation cold {_ms(turn['prime_ttft_s'])} ms"
        + ("" if ratio is None else f" (ratio {ratio:.3f})")
        + ("" if offline is None else f"; offline, same flags: turn TTFT {_ms(offline)} ms")
        + ". Reported, not part of the verdict.",
    ]
    for where, key in (("Through the server", "turn_parts"), ("Offline", "offline_turn_parts")):
        parts = turn.get(key)  # absent from summaries written before they were measured
        if parts:
            lines += ["", f"{where}, the turn's TTFT by part (medians): {parts_sentence(parts)}."]
    lines += [f"- {failure}" for failure in turn["failures"]]
    return lines


def _ratio(ratios: dict[str, float], key: str, row: dict[str, Any]) -> str:
    if key not in ratios:
        return "—"
    mark = ""
    target = (row.get("targets") or {}).get(key)
    if target is not None and target["met"] is not None:
        mark = " ✓" if target["met"] else " ✗"
    return f"{ratios[key]:.2f}{mark}"


def _num(value: float | None) -> str:
    return "—" if value is None else f"{value:,.1f}"


def _ms(seconds: float | None, digits: int = 0) -> str:
    return "—" if seconds is None else f"{seconds * 1000:,.{digits}f}"


def _fixed(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def _declared(commit: str | None, recorded: dict[str, Any]) -> dict[str, Any]:
    if commit is None:
        return {}
    return {
        "git_commit": commit,
        "git_dirty": False,
        "git_commit_source": "--source-commit",
        "git_commit_recorded_by_the_runs": recorded.get("git_commit"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m morion.validate.qualify", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--validate",
        action="append",
        required=True,
        help="a results JSON of morion validate (repeat: their suites are merged, e.g. restore+soak, perf)",
    )
    parser.add_argument("--offline", help="the results JSON of morion bench offline (same flags)")
    parser.add_argument("--turn", help="the results JSON of morion bench --url ... --workloads turn")
    parser.add_argument(
        "--turn-target-ms", type=float, help="the agent turn's TTFT target (issue #24), marked in the report"
    )
    parser.add_argument("--label", required=True, help="file label, e.g. h200-qualify-qwen3-next-80b-a3b")
    parser.add_argument("--serve-command", default="", help="the morion serve command, as run")
    parser.add_argument("--min-hits", type=int, default=100, help="hits each tier must reach (100)")
    parser.add_argument(
        "--source-commit",
        help="the commit the runs' tree was, where their machine had it without its history (recorded as "
        "declared, beside what the runs themselves recorded)",
    )
    parser.add_argument("--out", default="results", help="output directory (results)")
    args = parser.parse_args(argv)
    runs = [json.loads(Path(path).read_text()) for path in args.validate]
    validate = {**runs[0], "suites": {name: suite for run in runs for name, suite in run["suites"].items()}}
    offline = json.loads(Path(args.offline).read_text()) if args.offline else None
    turn = json.loads(Path(args.turn).read_text()) if args.turn else None
    turn_target_s = None if args.turn_target_ms is None else args.turn_target_ms / 1000
    result = {
        "schema": SCHEMA,
        "label": args.label,
        "date": validate["date"],
        "provenance": {**validate["provenance"], **_declared(args.source_commit, validate["provenance"])},
        "serve_command": args.serve_command,
        "offline_command": (offline or {}).get("provenance", {}).get("command", "none"),
        "sources": {
            "validate": ", ".join(Path(path).name for path in args.validate),
            "offline": Path(args.offline).name if args.offline else None,
            "turn": Path(args.turn).name if args.turn else None,
        },
        "server": validate["server"],
        "summary": summarize(validate, offline, args.min_hits, turn, turn_target_s),
    }
    path = output_paths(Path(args.out), validate["date"], args.label)
    write_json(path, result)
    path.with_suffix(".md").write_text(markdown(result))
    summary = result["summary"]
    print(
        f"qualify: {summary['verdict']}"
        + (f": {'; '.join(summary['problems'])}" if summary["problems"] else "")
    )
    print(f"qualify: wrote {path} and {path.with_suffix('.md').name}")
    return 1 if summary["verdict"] == "fail" else 0


if __name__ == "__main__":
    sys.exit(main())
