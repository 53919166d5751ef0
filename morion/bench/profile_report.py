"""The profile section of the bench's Markdown report (`morion bench --profile`), from the results JSON
alone (bench/profile.py writes it)."""

from __future__ import annotations

from typing import Any

TOP_OPS_SHOWN = 8


def profile_markdown(section: dict[str, Any] | None) -> list[str]:
    if not section:
        return []
    lines = [
        "## Profile: where a step's time goes",
        "",
        section["note"],
        "",
    ]
    if not section["device_timeline"]:
        lines += [
            f'On {section["device"]} the ops run on the host as they are called: the "kernels" are the '
            "outermost CPU ops, and the device's idle time between kernels is measured on CUDA only.",
            "",
        ]
    for point in section["points"]:
        lines += _point(point)
    if section.get("trace"):
        lines += [f"Chrome trace of the profiled runs: `{section['trace']}`.", ""]
    return lines


def _point(point: dict[str, Any]) -> list[str]:
    by_module, as_served = point["by_module"], point["as_served"] or point["by_module"]
    what = f"{point['workload']} C={point['concurrency']} ctx={point['prompt_tokens']:,}"
    if point["workload"] not in ("decode", "spec"):
        what = f"{point['workload']} {point['prompt_tokens']:,} tokens"
    if point.get("cached_tokens"):
        new, cached = point["prompt_tokens"], point["cached_tokens"]
        what = f"{point['workload']}: {new:,} new tokens on {cached:,} cached"
    if by_module is None:
        return [f"### {what}", "", f"No {point['step_kind']} step ran.", ""]
    kind = by_module["step_kind"]
    lines = [
        f"### {what}: {by_module['steps']} {kind} steps",
        "",
        f"By module (eager forwards, {by_module['step_ms']:.2f} ms per {kind} step under the profiler): "
        "a part's own time, without the parts inside it.",
        "",
        "| part | host ms/step | device ms/step | ops/step |",
        "|---|---:|---:|---:|",
    ]
    for part in by_module["by_part"]:
        device = "—" if part["device_ms"] is None else f"{part['device_ms']:.3f}"
        lines.append(f"| {part['part']} | {part['host_ms']:.3f} | {device} | {part['ops']:.0f} |")
    experts = point.get("experts")  # absent from a JSON written before it was measured (`--plot`)
    if experts:
        lines += [
            "",
            f"MoE experts: {experts['weight_bytes_per_step'] / 1e9:.3f} GB of expert weights a step (the "
            f"distinct experts {point['concurrency']} independently routed tokens are expected to read, "
            f"and a shared expert stacked with them) in {experts['device_ms_per_step']:.3f} ms of their "
            f"eager kernels: **{experts['tb_per_s']:.2f} TB/s**.",
        ]
    served = "the same run"
    if point["cuda_graphs"]:
        graphs = "CUDA graphs" if kind == "decode" else "piecewise prefill CUDA graphs"
        served = f"{graphs} as the engine replays them"
    lines += [
        "",
        f"As served ({served}, {as_served['step_ms']:.2f} ms per step): {as_served['ops_per_step']:.0f} "
        f"{as_served['ops_are']} per step, {as_served['op_ms_per_step']:.3f} ms of them per step; host time "
        f"outside the forward {as_served['host']['outside_forward_ms']:.3f} ms per step.",
        "",
    ]
    idle = as_served["host"]["device_idle"]
    if idle is not None:
        parts = ", ".join(f"{p['part']} {p['ms']:.3f}" for p in idle["by_part"][:4])
        lines += [
            f"Device idle {idle['idle_ms']:.3f} ms per step (busy {idle['busy_ms']:.3f}): "
            f"{idle['before_first_ms']:.3f} before its first kernel, {idle['between_ms']:.3f} between "
            f"kernels, {idle['after_last_ms']:.3f} after its last; while the host ran: {parts}.",
            "",
        ]
    lines += [
        "Top ops by their own device time: from an op's start, or the end of the ops before it if later, to "
        "its end (with programmatic dependent launch a kernel starts while the one before it runs and waits "
        "for it: its span counts that time again; own times add up to the busy time).",
        "",
        "| top ops (as served) | per step | own ms/step | span ms/step |",
        "|---|---:|---:|---:|",
    ]
    lines += [
        f"| `{op['name']}` | {op['per_step']:.1f} | {_own_ms(op)} | {op['ms_per_step']:.3f} |"
        for op in as_served["top_ops"][:TOP_OPS_SHOWN]
    ]
    return [*lines, ""]


def _own_ms(op: dict) -> str:
    """An op's own ms a step; a JSON written before own times were measured has none (`--plot`)."""
    own = op.get("own_ms_per_step")
    return "—" if own is None else f"{own:.3f}"
