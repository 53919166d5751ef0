"""Measured points set against the roofline: bounds, MBU for decode points, MFU for prefill points."""

from __future__ import annotations

from typing import Any

from morion.bench import roofline
from morion.bench.roofline import ModelCost


def decode_context(point: dict[str, Any]) -> float:
    """The mean context over a request's decode steps: the prompt plus half of what it generates."""
    return point["context"] + (point["output_tokens"] - 1) / 2


def annotate_decode(point: dict[str, Any], cost: ModelCost | None, bandwidth_gbs: float | None) -> None:
    """Adds `roofline` (bytes, floor step, per-request and aggregate bounds) and `mbu` to a decode point;
    None for both where the model or the device's bandwidth is unknown."""
    if cost is None or bandwidth_gbs is None:
        point["roofline"] = point["mbu"] = None
        return
    batch, context = point["concurrency"], decode_context(point)
    bound = roofline.decode_bound(cost, batch, context, bandwidth_gbs)
    point["roofline"] = {
        "context_avg": context,
        "bytes_per_step": bound.bytes_per_step,
        "floor_step_s": bound.floor_step_s,
        "per_request_tok_s": bound.per_request_tok_s,
        "aggregate_tok_s": bound.aggregate_tok_s,
        "distinct_experts": [
            roofline.distinct_experts(batch, layer.num_experts, layer.top_k) for layer in cost.moe_layers[:1]
        ],
    }
    step_s = point["median"]["step_s"]
    point["mbu"] = None if step_s is None else roofline.mbu(cost, batch, context, step_s, bandwidth_gbs)


def annotate_prefill(point: dict[str, Any], cost: ModelCost | None, peak_tflops: float | None) -> None:
    """Adds `roofline` (FLOPs per token, FLOP-bound tok/s) and `mfu` to a prefill or TTFT point; None
    for both where the model or the device's peak is unknown."""
    if cost is None or peak_tflops is None:
        point["roofline"] = point["mfu"] = None
        return
    bound = roofline.prefill_bound(cost, point["prompt_tokens"], peak_tflops)
    point["roofline"] = {"flops_per_token": bound.flops_per_token, "tok_s": bound.tok_s}
    measured = point["median"]["prefill_tok_s"]
    point["mfu"] = None if measured is None else measured / bound.tok_s
