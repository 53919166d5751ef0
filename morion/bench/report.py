"""The results files: `<date>-<label>.json` (everything, raw runs included) and the Markdown table made
from that JSON alone, so `morion bench --plot FILE.json` can remake it anywhere."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from morion.bench.first_token_parts import median_parts
from morion.bench.profile_report import profile_markdown
from morion.bench.restore import KIND_NAMES, KINDS
from morion.bench.timing import median_of

# The spec workload's method (morion/bench/speculative.py); a spec section without it was measured with
# the oracle drafter that forced acceptance replaced.
SPEC_METHOD = "forced acceptance"
# Its real mode (`--speculative ngram`): the target's own verdict on a model-free drafter's proposals.
SPEC_METHOD_REAL = "real acceptance"

DEFINITIONS = {
    "per_request_tok_s": (
        "per-request decode tok/s, post-first-token: (n - 1) / (t_last - t_first) for each request of n "
        "generated tokens, at the client; the median over a run's requests, then the median over runs"
    ),
    "aggregate_tok_s": (
        "aggregate tok/s: all tokens generated in a run / makespan (first submission to last token, TTFT "
        "included); median over runs. Its timing window differs from the per-request rate's: the two are "
        "never added or compared as like for like"
    ),
    "ttft_s": "TTFT: submission to first generated token, at the client; median over runs",
    "roofline": (
        "decode bound: bytes(B, L) = dense weight bytes (at storage dtype) + sum over MoE layers of "
        "D(B) x bytes per expert + B x (2 x per-request state bytes + K/V bytes per token x L), with "
        "D(B) = E(1 - (1 - k/E)^B), at the mean decode context L = context + (output - 1)/2; floor step = "
        "bytes / bandwidth; per-request bound = 1 / floor step, aggregate bound = B / floor step"
    ),
    "mbu": (
        "MBU: modelled bytes per step / (measured step time x bandwidth); step time = 1 / per-request rate"
    ),
    "prefill_tok_s": (
        "cold prefill tok/s: prompt tokens / TTFT for a fresh prompt, max_tokens 1; median over runs"
    ),
    "prefill_bound": (
        "prefill bound: peak FLOP/s / (2 x active parameters without embedding and LM head + "
        "sum over attention layers of 4 x heads x head_dim x N/2) FLOPs per token; MFU = measured / bound"
    ),
    "restore": (
        "restore: per repeat one fresh conversation of N tokens + 1 new token, 8 greedy tokens per request: "
        "cold (nothing cached), device hit (the same prompt again), host hit (after evicting the device "
        "cache), disk hit (after closing the engine and building a new one on the same disk directory, "
        "then evicting that directory's files from the OS page cache where the text under the table says "
        "so; none of it in the TTFT). TTFT as above, median over repeats; ratio = median TTFT / "
        "median cold TTFT. A hit must report exactly N cached tokens, all from its tier, and generate "
        "exactly the cold output, else it is FAILED"
    ),
    "restore_gbs": (
        "restore GB/s: bytes restored (host hit: host to device; disk hit: read from disk) / restore "
        "seconds, both from the engine's cache counters. Restore seconds run from the admission that finds "
        "the hit (disk reads included) to the poll that finds the copies done: on a GPU that is the start "
        "of the next step, after the first forward (which waits on the copies), so the rate is a lower "
        "bound on the copy rate"
    ),
    "spec": (
        "speculative decoding, SYNTHETIC (forced acceptance): per run, C fresh prompts decode on the plain "
        "engine, then the same prompts on a second engine on the same weights that speculates at width k: "
        "the MTP head drafts (at its real cost) or a cost-free drafter proposes repeats of the last token, "
        "and each verify step accepts draft j with probability p given the ones before it were (a seeded "
        "truncated geometric count), whatever the target says, then adds the target's own greedy token. "
        "K/V, states and MTP extend are those of real speculation at that acceptance. Outputs are not "
        "compared with plain: the forced acceptance decides which drafts are kept, while the target still "
        "computes every verify forward and its own token. tok/s as [1]; speedup = median speculative / "
        "median plain"
    ),
    "spec_mean_accepted": (
        "measured mean accepted length: tokens a request gained per verify step (accepted drafts + the "
        "target's own token) = emitted / (emitted - accepted), from the change in the speculative engine's "
        "counters over the measured runs (warm-ups excluded; a request's last step counts in full even "
        "where max_tokens cuts it); p is set for 1 + p + ... + p^k. Every step drafts k tokens, so accepted "
        "/ drafted at draft position j is p^j"
    ),
    "spec_real": (
        "speculative decoding, REAL acceptance (not synthetic): per run, C code-edit prompts decode greedily "
        "on the plain engine, then on a second engine on the same weights with the n-gram drafter at width "
        "k; each verify step keeps the drafts while they equal the target's argmax, then adds the target's "
        "own token; nothing is forced. Every speculative output must equal its plain output token for "
        "token. tok/s as [1]; speedup = median speculative / median plain; prompt tokens: median over the "
        "measured runs' requests"
    ),
    "spec_real_mean_accepted": (
        "measured mean accepted length: tokens a request gained per verify step (accepted drafts + the "
        "target's own token) = emitted / (emitted - accepted), from the change in the speculative engine's "
        "counters over the measured runs (warm-ups excluded; a request's last step counts in full even "
        "where max_tokens cuts it); steps without a proposal decode plainly and are not verify steps. "
        "Accepted / drafted per draft position: drafts accepted at position j / drafts proposed there. "
        "Proposal rate: request-steps the drafter proposed for / request-steps it was asked for (each one "
        "target forward); decode tokens per step: the speculative requests' tokens after the first / "
        "those request-steps (plain decode: 1)"
    ),
}


_FOOTNOTES = (
    "per_request_tok_s",
    "aggregate_tok_s",
    "roofline",
    "mbu",
    "prefill_tok_s",
    "prefill_bound",
    "restore",
    "restore_gbs",
    "spec",
    "spec_mean_accepted",
    "spec_real",
    "spec_real_mean_accepted",
)


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-") or "bench"


def output_paths(out_dir: Path, date: str, label: str) -> Path:
    """`<date>-<label>.json`, or `-2`, `-3`, ... after it: a committed result is never overwritten."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{date}-{label}.json"
    n = 2
    while path.exists():
        path = out_dir / f"{date}-{label}-{n}.json"
        n += 1
    return path


def write_json(path: Path, result: dict[str, Any]) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(result, indent=2, default=str) + "\n")
    partial.replace(path)  # never a half-written result under the final name


def _num(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def _ms(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds * 1e3:,.0f}"


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value * 100:.1f}%"


def _count(n: float) -> str:
    return f"{n / 1e9:.3f} billion" if n >= 1e9 else f"{n / 1e6:.3f} million"


def _size(num_bytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{num_bytes:.0f} B"


def markdown(result: dict[str, Any]) -> str:
    """The report: what ran where, one table per workload, the roofline inputs, the definitions."""
    lines = _header(result)
    lines += _decode_table(result)
    lines += _prefill_table(result.get("prefill") or [])
    lines += _ttft_line(result.get("ttft"))
    lines += _turn_table(result.get("turn"))
    lines += _spec_table(result.get("spec"))
    lines += _restore_table(result.get("restore"))
    lines += profile_markdown(result.get("profile"))
    lines += _roofline_inputs(result.get("roofline") or {})
    notes = ["per_request_tok_s", "aggregate_tok_s", "roofline", "mbu", "prefill_tok_s", "prefill_bound"]
    notes += ["restore", "restore_gbs"] if result.get("restore") else []
    notes += ["spec", "spec_mean_accepted"] if _forced(result.get("spec")) else []
    notes += ["spec_real", "spec_real_mean_accepted"] if _real(result.get("spec")) else []
    # Fixed numbers (the tables cite them); a footnote ends in two spaces: a line break but the last.
    footnotes = [f"[{_FOOTNOTES.index(key) + 1}] {DEFINITIONS[key]}." for key in notes]
    lines += ["---", *(note + "  " for note in footnotes[:-1]), footnotes[-1]]
    return "\n".join([*lines, ""])


def _header(result: dict[str, Any]) -> list[str]:
    prov = result["provenance"]
    target = result["target"]
    commit = (prov.get("git_commit") or "unknown")[:12] + (" (dirty)" if prov.get("git_dirty") else "")
    device = prov.get("device_name") or target.get("device", "remote")
    versions = f"torch {prov.get('torch')} (CUDA {prov.get('cuda')}), triton {prov.get('triton')}"
    gpus = "".join(
        f"; {g['name']} (driver {g['driver_version']}, power limit {g['power_limit']})"
        for g in prov.get("gpus", [])
    )
    status = "" if result.get("status") == "complete" else f" Status: **{result.get('status')}**."
    return [
        f"# morion bench: {result['label']} ({result['date']})",
        "",
        f"`{prov.get('command', '')}`",
        "",
        f"Target: {target['target']}; model `{result['model']}`; device {device}. Commit `{commit}`, "
        f"{versions}, host {prov.get('hostname')}{gpus}. Raw runs in the JSON beside this file.{status}",
        "",
    ]


def _decode_table(result: dict[str, Any]) -> list[str]:
    baseline = result.get("baseline") or {}
    points = [*result.get("decode", []), *(baseline.get("decode") or [])]
    if not points and not baseline:
        return []
    settings = result["settings"]
    lines = [
        f"## Decode: {settings['output_tokens']} output tokens, greedy, EOS ignored "
        f"(median of {settings['repeats']} runs, {settings['warmup_runs']} warm-up per point)",
        "",
        "| engine | C | context | per-request tok/s [1] | bound [3] | aggregate tok/s [2] | bound [3] "
        "| MBU [4] | TTFT ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in points:
        bound, median = p.get("roofline") or {}, p["median"]
        cells = (
            p.get("engine", "morion"),
            str(p["concurrency"]),
            f"{p['context']:,}",
            _num(median["per_request_tok_s"]),
            _num(bound.get("per_request_tok_s"), 0),
            _num(median["aggregate_tok_s"]),
            _num(bound.get("aggregate_tok_s"), 0),
            _pct(p.get("mbu")),
            _ms(median["ttft_s"]),
        )
        lines.append("| " + " | ".join(cells) + " |")
    skipped = result.get("decode_skipped") or []
    if skipped:
        names = ", ".join(f"C{s['concurrency']} x {s['context']:,}" for s in skipped)
        lines += ["", f"Skipped (over --max-cell-prompt-tokens): {names}."]
    if baseline.get("error"):
        lines += ["", f"The transformers baseline failed: {baseline['error']}"]
    elif baseline:
        b = baseline["target"]
        lines += [
            "",
            f"transformers {b.get('transformers')}: `{b.get('model')}` ({b.get('model_class')}, random "
            f"weights, {b.get('dtype')}, {b.get('device')}), `generate` one request at a time; its bounds "
            "are its own model's.",
        ]
    return [*lines, ""]


def _prefill_table(points: list[dict[str, Any]]) -> list[str]:
    if not points:
        return []
    lines = [
        "## Cold prefill: one fresh prompt at a time, max_tokens 1",
        "",
        "| prompt tokens | TTFT ms | prefill tok/s [5] | bound tok/s [6] | MFU [6] |",
        "|---:|---:|---:|---:|---:|",
    ]
    for p in points:
        bound, median = p.get("roofline") or {}, p["median"]
        cells = (
            f"{p['prompt_tokens']:,}",
            _ms(median["ttft_s"]),
            _num(median["prefill_tok_s"], 0),
            _num(bound.get("tok_s"), 0),
            _pct(p.get("mfu")),
        )
        lines.append("| " + " | ".join(cells) + " |")
    return [*lines, "", *_engine_thread_lines(points), *_ttft_parts_lines(points)]


def _engine_thread_lines(points: list[dict[str, Any]]) -> list[str]:
    """Where the engine thread's prefill went, per prompt length (median of its runs), where the engine
    measured it (engine/thread_times.py)."""
    lines = []
    for p in points:
        runs = [run["engine_thread"] for run in p["runs"] if run.get("engine_thread")]
        if not runs:
            continue
        on_cpu, runqueue, off_cpu = (median_of(runs, key) for key in ("on_cpu_s", "runqueue_s", "off_cpu_s"))
        lines.append(
            f"- {p['prompt_tokens']:,} tokens: the engine thread on a CPU {_ms(on_cpu)} ms, runnable but "
            f"waiting for a CPU {_ms(runqueue)} ms, off CPU (the GIL, locks, waits for the GPU) "
            f"{_ms(off_cpu)} ms (medians)."
        )
    if not lines:
        return []
    return ["Engine thread during each prefill (Linux scheduler statistics):", "", *lines, ""]


# What each part of a time to first token is (bench/first_token_parts.py), for the reports.
PART_NAMES = {
    "prepare_s": "front end",
    "queue_s": "engine queue",
    "prefill_s": "engine prefill",
    "to_engine_s": "to the engine (pipe, loop)",
    "from_engine_s": "back to the front end (pipe, loops)",
    "handoff_s": "hand-over (pipes, loops)",  # both legs, as results written before their split hold it
}


def parts_sentence(parts: dict[str, float]) -> str:
    """ "front end 3 ms, engine queue 0 ms, ..." in the order the parts happen."""
    return ", ".join(f"{PART_NAMES[part]} {_ms(seconds)} ms" for part, seconds in parts.items())


def _ttft_parts_lines(points: list[dict[str, Any]]) -> list[str]:
    """Where each prompt length's time to first token went (medians of its runs), where the target tells."""
    lines = []
    for p in points:
        medians = median_parts([run.get("ttft_parts") for run in p["runs"]])
        if medians:
            lines.append(f"- {p['prompt_tokens']:,} tokens: {parts_sentence(medians)} (medians).")
    if not lines:
        return []
    return ["Time to first token by part (bench/first_token_parts.py):", "", *lines, ""]


def _ttft_line(point: dict[str, Any] | None) -> list[str]:
    if not point:
        return []
    runs = ", ".join(_ms(run["ttft_s"]) for run in point["runs"])
    return [
        f"## TTFT at {point['prompt_tokens']:,} prompt tokens",
        "",
        f"Median **{_ms(point['median']['ttft_s'])} ms** over {len(point['runs'])} runs ({runs} ms), one "
        "fresh prompt at a time, max_tokens 1.",
        "",
    ]


def _turn_table(section: dict[str, Any] | None) -> list[str]:
    if not section:
        return []
    median, runs = section["median"], section["runs"]
    prefix, new = section["prefix_tokens"], section["new_tokens"]
    cached = sorted({run["turn"]["cached_tokens"] for run in runs})
    checked = (
        f"every turn found the {prefix:,} conversation tokens cached"
        if section["page_size"] and not section["failures"]
        else "cached tokens as the server reported them (not checked: its page size is unknown)"
    )
    lines = [
        f"## Agent turn: {new:,} new tokens on a cached {prefix:,}-token conversation (+1 token), "
        f"max_tokens 1 (median of {len(runs)} repeats)",
        "",
        "| request | TTFT ms | cached tokens | computed tok/s |",
        "|---|---:|---:|---:|",
        f"| prime (cold conversation) | {_ms(median['prime_ttft_s'])} | 0 | "
        f"{_num(median['prime_tok_s'], 0)} |",
        f"| turn | **{_ms(median['turn_ttft_s'])}** | {', '.join(f'{n:,}' for n in cached)} | "
        f"{_num(median['turn_tok_s'], 0)} |",
        "",
        f"Turn TTFT / cold conversation TTFT: {_num(section['ratio_to_cold'], 3)}; {checked}.",
        "",
    ]
    parts = section.get("turn_parts")  # absent from results written before it was measured
    if parts:
        lines += [f"The turn's TTFT by part (medians): {parts_sentence(parts)}.", ""]
    lines += [f"- FAILED: {failure}" for failure in section["failures"]]
    return lines + ([""] if section["failures"] else [])


def _restore_table(section: dict[str, Any] | None) -> list[str]:
    if not section:
        return []
    medians, ratios, targets = section["median"], section["ratio_to_cold"], section["targets"]
    lines = [
        f"## Restore: a {section['conversation_tokens']:,}-token conversation + 1 new token, "
        f"{section['output_tokens']} greedy tokens (median of {medians['cold']['runs']} repeats) [7]",
        "",
        "| kind | TTFT ms | cached tokens | restore GB/s [8] | ratio to cold | target | met? | output |",
        "|---|---:|---:|---:|---:|---|---|---|",
    ]
    for kind in KINDS:
        median = medians[kind]
        target = targets.get(kind)
        failed = [run["repeat"] + 1 for run in section["runs"] if run.get(kind, {}).get("problems")]
        output = "reference" if kind == "cold" else "identical to cold"
        if failed:
            output = f"**FAILED** (run {', '.join(map(str, failed))})"
        met = "—" if not target or target["met"] is None else ("yes" if target["met"] else "**no**")
        cells = (
            KIND_NAMES[kind],
            _ms(median["ttft_s"]),
            "—" if median["cached_tokens"] is None else f"{median['cached_tokens']:,.0f}",
            _num(median["restore_gbs"], 2),
            "1" if kind == "cold" else _num(ratios.get(kind), 3),
            f"< {target['limit']:g}" if target else "—",
            met,
            output,
        )
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    failures = section.get("failures") or []
    lines += [f"- FAILED: {failure}" for failure in failures] + ([""] if failures else [])
    restart, disk = section.get("restart_median") or {}, section["disk"]
    fs = disk.get("filesystem") or {}
    page_cache = section.get("page_cache")  # absent from results made before --restore-page-cache
    io = "O_DIRECT writes" if disk["direct_io"] else "buffered (reads may come from the page cache)"
    if page_cache is not None:
        io = "O_DIRECT writes" if disk["direct_io"] else "buffered writes"
    ram = " (RAM, not a disk)" if fs.get("fstype") == "tmpfs" else ""
    lines += [
        "Restart (not in the TTFT): closing the engine (its disk writes finish) "
        f"{_num(restart.get('close_s'), 1)} s, building the new one {_num(restart.get('build_s'), 1)} s "
        f"(medians). Disk cache `{disk['dir']}` on {fs.get('fstype', 'unknown')}{ram} "
        f"({fs.get('device', '?')}), {io}; host tier {section['host_cache_gb']:g} GiB, "
        f"{section['host_cache_write_policy']}. Every request's raw values and cache-counter changes are in "
        "the JSON.",
        "",
    ]
    if page_cache is not None:
        lines += [_page_cache_text(section, fs.get("fstype") == "tmpfs"), ""]
    return lines


def _page_cache_text(section: dict[str, Any], tmpfs: bool) -> str:
    """What `--restore-page-cache` did to the disk directory's files before each disk hit."""
    runs = [run["page_cache"] for run in section["runs"] if "page_cache" in run]
    median = section.get("page_cache_median") or {}
    flag = f"`--restore-page-cache {section['page_cache']}`"
    resident = median.get("resident_bytes_after")
    if section["page_cache"] == "keep":
        text = (
            f"Page cache kept ({flag}): the disk directory's files were not evicted before the disk hit, "
            "so it may read them from memory, not the disk"
        )
        return text + (f" ({_mib(resident)} resident, median)." if resident is not None else ".")
    if not runs or not all(run["evicted"] for run in runs):
        reason = next((run["reason"] for run in runs if run.get("reason")), "not run yet")
        return f"Page cache **not evicted** ({flag}, but {reason}): the disk hit may read from memory."
    text = (
        f"Disk objects evicted from the page cache before the disk hit ({flag}; written back and dropped "
        "with posix_fadvise DONTNEED after the restart, not in the TTFT): "
        f"{median['files']:,.{0 if median['files'] == int(median['files']) else 1}f} files, "
        f"{_mib(median['bytes'])} (median per repeat)"
    )
    if resident is None:
        text += "; page-cache residency not measured"
    else:
        text += f"; resident before {_mib(median['resident_bytes_before'])}, after {_mib(resident)}"
        if resident and tmpfs:
            text += " (a tmpfs is the page cache: nothing leaves memory)"
        elif resident:
            text += " (not all dropped: the disk hit reads that part from memory)"
    errors = sum(run["errors"] for run in runs)
    if errors:
        text += f"; {errors} files failed, e.g. {next(run['first_error'] for run in runs if run['errors'])}"
    return text + "."


def _mib(num_bytes: float | None) -> str:
    return "—" if num_bytes is None else f"{num_bytes / 2**20:,.2f} MiB"


def _spec_table(section: dict[str, Any] | None) -> list[str]:
    if not section:
        return []
    if _real(section):
        return _spec_real_table(section)
    heading = (
        f"## Speculative decoding, SYNTHETIC ({section.get('method', 'oracle drafter')}): width "
        f"{section['width']}, p = {section['acceptance_p']:.3f}, set for {section['target_mean_accepted']:g} "
        "tokens per verify step"
    )
    if not _forced(section):
        return [
            heading,
            "",
            "Measured with the superseded oracle method (a drafter proposing the plain run's greedy output), "
            "which this report no longer renders; the JSON has every run and, under `definitions`, how it "
            "was measured.",
            "",
        ]
    cost = (
        "the model's MTP head drafts as it would (extend and chained draft steps, its K/V writes): its cost "
        "is in the speculative rate"
        if section["drafter"] == "mtp"
        else "repeats of the last token, no draft model runs: drafting costs nothing, so the speedup is an "
        "upper bound for this acceptance"
    )
    lines = [
        heading + " [9]",
        "",
        "**SYNTHETIC**: each verify step accepts each draft with probability p given the ones before it "
        "were, whatever the target says; the target still runs every verify forward and adds its own token. "
        "The numbers say what the engine does at this acceptance, nothing about a real drafter's. Drafter "
        f"`{section['drafter_name']}`: {cost}. Outputs are not compared with plain (the forced acceptance "
        f"decides which drafts are kept). {section['output_tokens']} greedy output tokens per request, EOS "
        f"ignored; median of {section['repeats']} runs, {section['warmup_runs']} warm-up per point.",
        "",
        "| C | context | plain tok/s [1] | speculative tok/s [1] | speedup | mean accepted [10] "
        "| accepted / drafted by position [10] | verify graph replays |",
        "|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for p in section["points"]:
        cells = (
            str(p["concurrency"]),
            f"{p['context']:,}",
            *_spec_rate_cells(p),
            f"{p['spec_stats']['verify_graph_replays']:,}",
        )
        lines.append("| " + " | ".join(cells) + " |")
    skipped = section.get("skipped") or []
    if skipped:
        names = ", ".join(f"C{s['concurrency']} x {s['context']:,}" for s in skipped)
        lines += ["", f"Skipped (over --max-cell-prompt-tokens): {names}."]
    return [*lines, ""]


def _spec_rate_cells(point: dict[str, Any]) -> tuple[str, ...]:
    """Both spec tables' plain and speculative rates, speedup, mean accepted length and per-position
    acceptance of one point."""
    median = point["median"]
    return (
        _num(median["plain_per_request_tok_s"]),
        _num(median["speculative_per_request_tok_s"]),
        "—" if point["speedup"] is None else f"{point['speedup']:.2f}x",
        _num(point["measured_mean_accepted"], 2),
        " / ".join(_num(rate, 2) for rate in point["acceptance_by_position"]) or "—",
    )


def _spec_real_table(section: dict[str, Any]) -> list[str]:
    """The real-acceptance mode (`--speculative ngram`): measured acceptance, outputs checked."""
    prompts = section["prompt_set"]
    low, high = section["ngram"]
    failures = section.get("failures") or []
    checked = sum(len(run["identical"]) for p in section["points"] for run in [*p["warmup_runs"], *p["runs"]])
    verdict = (
        f"all {checked} requests (warm-ups included) identical"
        if not failures
        else f"**FAILED**: {len(failures)} of {checked} requests differ (listed below)"
    )
    lines = [
        f"## Speculative decoding, REAL acceptance (not synthetic): `{section['drafter_name']}` drafter, "
        f"width {section['width']}, {prompts['name']} prompts [11]",
        "",
        f"**REAL**: the n-gram drafter (prompt lookup over each request's own tokens, n = {low}..{high}) "
        "proposes, and each verify step keeps the drafts while they equal the target's greedy token; no "
        f"acceptance is forced. Prompts `{prompts['name']}` ({prompts['format']}): {prompts['description']}; "
        f"made from the seed `{prompts['seed']}` and each request's key, the same on every machine. "
        f"Greedy outputs must equal plain token for token: {verdict}. {section['output_tokens']} greedy "
        f"output tokens per request, EOS ignored; median of {section['repeats']} runs, "
        f"{section['warmup_runs']} warm-up per point; {section['torch_threads']} torch threads.",
        "",
        "| C | prompt tokens | plain tok/s [1] | n-gram tok/s [1] | speedup | mean accepted [12] | accepted "
        "/ drafted by position [12] | proposal rate [12] | decode tokens per step [12] | outputs |",
        "|---:|---:|---:|---:|---:|---:|---|---:|---:|---|",
    ]
    for p in section["points"]:
        cells = (
            str(p["concurrency"]),
            f"{p['prompt_tokens']:,.0f} (≤ {p['context']:,})",
            *_spec_rate_cells(p),
            _pct(p["proposal_rate"]),
            _num(p["decode_tokens_per_step"], 2),
            "identical" if p["identical"] else "**FAILED**",
        )
        lines.append("| " + " | ".join(cells) + " |")
    skipped = section.get("skipped") or []
    if skipped:
        names = ", ".join(f"C{s['concurrency']} x {s['context']:,}" for s in skipped)
        lines += ["", f"Skipped (over --max-cell-prompt-tokens): {names}."]
    if failures:
        lines += ["", *(f"- FAILED: {failure}" for failure in failures)]
    return [*lines, ""]


def _forced(section: dict[str, Any] | None) -> bool:
    return bool(section) and section.get("method") == SPEC_METHOD


def _real(section: dict[str, Any] | None) -> bool:
    return bool(section) and section.get("method") == SPEC_METHOD_REAL


def _peak(value: float | None, unit: str) -> str:
    return "unknown" if value is None else f"{value:g} {unit}"


def _roofline_inputs(roof: dict[str, Any]) -> list[str]:
    cost = roof.get("model")
    if not cost:
        return ["## Roofline", "", roof.get("note", "No roofline: the model is unknown."), ""] if roof else []
    excluded = "; ".join(f"{why}: {_size(n)}" for why, n in cost["excluded_bytes"].items()) or "nothing"
    experts = ", ".join(f"E={e} k={k} {_size(b)} each" for e, k, b in cost["experts"]) or "none"
    origin = "the loaded model" if cost["source"] == "model" else "the config"
    return [
        "## Roofline inputs",
        "",
        f"Bandwidth {_peak(roof.get('bandwidth_gbs'), 'GB/s')}, "
        f"peak {_peak(roof.get('peak_tflops'), 'TFLOP/s')}"
        f"{' (' + roof['peaks_source'] + ')' if roof.get('peaks_source') else ''}. Model cost from "
        f"{origin} ({roof.get('model_source', '')}): dense weights {_size(cost['dense_bytes'])} per step; "
        f"{cost['moe_layers']} MoE layers, experts {experts}; per-request state "
        f"{_size(cost['state_bytes_per_request'])} (read and written every step); K/V "
        f"{cost['kv_bytes_per_token']:,} B per token; {_count(cost['active_params'])} active parameters. "
        f"Not read by a decode step, so not counted: {excluded}.",
        "",
    ]
