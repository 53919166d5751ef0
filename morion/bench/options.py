"""`morion bench` flags (beyond the engine's) and their validation into one frozen `BenchOptions`.

Lists and numbers are parsed here rather than by argparse so that a bad value ends in the CLI's usual
`morion: error: ...` line. This module imports nothing heavy: `morion --help` builds every parser.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass

from morion.errors import MorionError

WORKLOADS = ("decode", "prefill", "ttft", "turn", "spec", "restore")
# turn, restore and spec are only run when asked: turn and restore need long prompts (and restore the
# cache tiers' flags), spec a draft width.
DEFAULT_WORKLOADS = ("decode", "prefill", "ttft")
# What --profile profiles (bench/profile.py).
PROFILED_WORKLOADS = ("decode", "prefill", "ttft", "turn", "spec")
BASELINES = ("hf",)
RESTORE_PAGE_CACHE = ("evict", "keep")  # restore: the disk directory's files before the disk hit
# Measured peaks of the devices the roofline knows by name: (memory GB/s, dense bf16 TFLOP/s). H200:
# device-to-device copy and dense GEMM (performance-anchors.md). Any other device's bound is unknown
# unless --bandwidth-gbs and --peak-tflops say it.
KNOWN_DEVICE_PEAKS = {"H200": (4300.0, 790.0)}


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """The bench flags; the engine flags come from cli._add_engine_arguments."""
    target = parser.add_argument_group("target (default: an in-process engine built from the engine flags)")
    target.add_argument("--url", help="benchmark a running OpenAI-compatible server at this base URL")
    target.add_argument("--served-model", help="--url: the model name to send (default: the first listed)")
    target.add_argument("--api-key", help="--url: bearer key (default: $MORION_API_KEY or $OPENAI_API_KEY)")
    target.add_argument("--request-timeout", default="3600", help="--url: seconds per request (3600)")

    work = parser.add_argument_group("workloads")
    work.add_argument(
        "--workloads",
        default=",".join(DEFAULT_WORKLOADS),
        help="any of decode,prefill,ttft,turn,spec,restore (default decode,prefill,ttft)",
    )
    work.add_argument("--concurrency", default="1,2,4,8", help="decode: concurrent requests (1,2,4,8)")
    work.add_argument("--contexts", default="1024,32768", help="decode: prompt tokens (1024,32768)")
    work.add_argument("--output-tokens", default="1024", help="decode: tokens per request (1024)")
    work.add_argument(
        "--logprobs",
        help="decode: every request also asks for its tokens' logprobs and N alternatives (default: none). "
        "A server without a tokenizer is timed through `logprobs: 0`: --logprobs 0 gives the offline engine "
        "the same work",
    )
    work.add_argument("--repeats", default="3", help="measured runs per point; medians are over these (3)")
    work.add_argument(
        "--warmup-runs", default="1", help="decode: unmeasured runs per point, at most 32 output tokens (1)"
    )
    work.add_argument(
        "--max-cell-prompt-tokens",
        default="0",
        help="decode: skip points whose concurrency x context exceeds this (0: run every point)",
    )
    work.add_argument(
        "--prefill-lengths", default="1024,8192,32768,65536", help="prefill: prompt tokens, max_tokens 1"
    )
    work.add_argument("--ttft-length", default="1024", help="ttft: prompt tokens (1024)")
    work.add_argument(
        "--turn-prefix",
        default="32768",
        help="turn: tokens of the cached conversation, a multiple of the page size (+1 token) (32768)",
    )
    work.add_argument("--turn-new", default="1024", help="turn: new tokens the turn appends (1024)")
    work.add_argument(
        "--spec-mean-accepted",
        default="2.58",
        help="spec: tokens per verify step the forced acceptance is set for, the target's own included, "
        "at --spec-width (2.58)",
    )
    work.add_argument(
        "--restore-length",
        default="65536",
        help="restore: conversation tokens, a multiple of the page size; the prompt adds 1 new token (65536)",
    )
    work.add_argument(
        "--restore-repeats", default="3", help="restore: conversations (cold, device, host, disk each) (3)"
    )
    work.add_argument(
        "--restore-page-cache",
        default="evict",
        help="restore: evict|keep the disk cache directory's files in the OS page cache before the disk "
        "hit (evict: posix_fadvise DONTNEED after the restart, not in the TTFT, so the hit reads the disk) "
        "(evict)",
    )

    roof = parser.add_argument_group("roofline")
    roof.add_argument(
        "--bandwidth-gbs",
        help="memory GB/s (default: a known device's, H200 4300; else the bound is unknown)",
    )
    roof.add_argument(
        "--peak-tflops", help="dense TFLOP/s (default: a known device's, H200 790; else unknown)"
    )
    roof.add_argument(
        "--roofline-config",
        help="--url: preset:NAME, config.json or model dir for the roofline (default: --model, else the "
        "model a morion server reports); offline uses the loaded model",
    )

    prof = parser.add_argument_group("profile (offline only; docs/bench.md)")
    prof.add_argument(
        "--profile",
        action="store_true",
        help="after the measured runs, profile extra runs of each decode, prefill, ttft and spec point with "
        "torch.profiler: time by module, kernels per step, host gaps (a section of the report)",
    )
    prof.add_argument(
        "--profile-trace",
        metavar="PATH",
        help="also write the profiled runs' Chrome trace there (.json, or .json.gz compressed); implies "
        "--profile",
    )

    out = parser.add_argument_group("baseline and output")
    out.add_argument("--baseline", help="hf: the decode workload at C1 with transformers, random weights")
    out.add_argument("--baseline-model", help="model or preset for --baseline (default: --model)")
    out.add_argument("--out", default="results", help="directory for <date>-<label>.json/.md/.png")
    out.add_argument("--label", help="file label (default: device and model)")
    out.add_argument("--plot", metavar="FILE.json", help="only regenerate the Markdown and PNG of a result")


@dataclass(frozen=True)
class BenchOptions:
    url: str | None
    served_model: str | None
    api_key: str | None
    request_timeout_s: float
    workloads: tuple[str, ...]
    concurrency: tuple[int, ...]
    contexts: tuple[int, ...]
    output_tokens: int
    logprobs: int | None  # decode requests' `logprobs`; None: not asked
    repeats: int
    warmup_runs: int
    max_cell_prompt_tokens: int
    prefill_lengths: tuple[int, ...]
    ttft_length: int
    turn_prefix: int
    turn_new: int
    spec_mean_accepted: float
    restore_length: int
    restore_repeats: int
    restore_page_cache: str
    bandwidth_gbs: float | None  # None: the device's, when it is known (resolved by run.py)
    peak_tflops: float | None
    roofline_config: str | None
    profile: bool  # profile extra runs after the measured ones (bench/profile.py)
    profile_trace: str | None  # where their Chrome trace goes
    baseline: str | None
    baseline_model: str | None
    out: str
    label: str | None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> BenchOptions:
        workloads = _names(args.workloads, "--workloads", WORKLOADS)
        baseline = args.baseline
        if baseline is not None and baseline not in BASELINES:
            raise MorionError(f"--baseline must be one of {', '.join(BASELINES)}, got {baseline!r}")
        if baseline is not None and "decode" not in workloads:
            raise MorionError("--baseline runs the decode workload: include decode in --workloads")
        url = args.url.rstrip("/") if args.url else None
        if url is not None and not url.startswith(("http://", "https://")):
            raise MorionError(f"--url must start with http:// or https://, got {args.url!r}")
        if url is not None and "restore" in workloads:
            raise MorionError(
                "--workloads restore needs the offline engine (it evicts the device cache and restarts the "
                "engine): leave out --url"
            )
        if url is not None and "spec" in workloads:
            raise MorionError(
                "--workloads spec needs the offline engine (a speculative engine on the same weights): "
                "leave out --url"
            )
        if args.restore_page_cache not in RESTORE_PAGE_CACHE:
            raise MorionError(
                f"--restore-page-cache must be one of {', '.join(RESTORE_PAGE_CACHE)}, "
                f"got {args.restore_page_cache!r}"
            )
        profile = bool(args.profile or args.profile_trace)
        if profile and url is not None:
            raise MorionError(
                "--profile needs the offline engine (it profiles the engine in-process): leave out --url"
            )
        if profile and not set(workloads) & set(PROFILED_WORKLOADS):
            profiled = ", ".join(PROFILED_WORKLOADS)
            raise MorionError(f"--profile profiles the {profiled} workloads: include one in --workloads")
        api_key = args.api_key or os.environ.get("MORION_API_KEY") or os.environ.get("OPENAI_API_KEY")
        return cls(
            url=url,
            served_model=args.served_model,
            api_key=api_key if url else None,
            request_timeout_s=_number(args.request_timeout, "--request-timeout", float, 1),
            workloads=workloads,
            concurrency=_int_list(args.concurrency, "--concurrency"),
            contexts=_int_list(args.contexts, "--contexts"),
            output_tokens=_number(args.output_tokens, "--output-tokens", int, 1),
            logprobs=None if args.logprobs is None else _number(args.logprobs, "--logprobs", int, 0),
            repeats=_number(args.repeats, "--repeats", int, 1),
            warmup_runs=_number(args.warmup_runs, "--warmup-runs", int, 0),
            max_cell_prompt_tokens=_number(args.max_cell_prompt_tokens, "--max-cell-prompt-tokens", int, 0),
            prefill_lengths=_int_list(args.prefill_lengths, "--prefill-lengths"),
            ttft_length=_number(args.ttft_length, "--ttft-length", int, 1),
            turn_prefix=_number(args.turn_prefix, "--turn-prefix", int, 1),
            turn_new=_number(args.turn_new, "--turn-new", int, 1),
            spec_mean_accepted=_number(args.spec_mean_accepted, "--spec-mean-accepted", float, 1),
            restore_length=_number(args.restore_length, "--restore-length", int, 1),
            restore_repeats=_number(args.restore_repeats, "--restore-repeats", int, 1),
            restore_page_cache=args.restore_page_cache,
            bandwidth_gbs=_optional(args.bandwidth_gbs, "--bandwidth-gbs"),
            peak_tflops=_optional(args.peak_tflops, "--peak-tflops"),
            roofline_config=args.roofline_config,
            profile=profile,
            profile_trace=args.profile_trace,
            baseline=baseline,
            baseline_model=args.baseline_model,
            out=args.out,
            label=args.label,
        )


def _number(text: str, flag: str, kind: Callable[[str], float], minimum: float):
    try:
        value = kind(text)
    except (TypeError, ValueError):
        raise MorionError(f"{flag} must be a number, got {text!r}") from None
    if not value >= minimum:  # also rejects NaN
        raise MorionError(f"{flag} must be >= {minimum:g}, got {text!r}")
    return value


def _optional(text: str | None, flag: str) -> float | None:
    return None if text is None else _number(text, flag, float, 1e-9)


def device_peaks(options: BenchOptions, device_name: str | None) -> tuple[float | None, float | None, str]:
    """The roofline's bandwidth and peak: the flags, else a known device's, else None (unknown); and
    where they come from."""
    known = next(
        (peaks for name, peaks in KNOWN_DEVICE_PEAKS.items() if device_name and name in device_name), None
    )
    bandwidth = options.bandwidth_gbs if options.bandwidth_gbs is not None else known and known[0]
    peak = options.peak_tflops if options.peak_tflops is not None else known and known[1]
    if options.bandwidth_gbs is not None or options.peak_tflops is not None:
        source = "the command line" + (f" and the measured peaks of {device_name}" if known else "")
    elif known:
        source = f"the measured peaks of {device_name}"
    else:
        source = f"unknown for {device_name or 'this device'}: pass --bandwidth-gbs and --peak-tflops"
    return bandwidth or None, peak or None, source


def _int_list(text: str, flag: str) -> tuple[int, ...]:
    items = [item.strip() for item in str(text).split(",") if item.strip()]
    if not items:
        raise MorionError(f"{flag} needs at least one value, got {text!r}")
    values = []
    for item in items:
        try:
            value = int(item)
        except ValueError:
            raise MorionError(f"{flag} must be comma-separated integers, got {item!r}") from None
        if value <= 0:
            raise MorionError(f"{flag} values must be >= 1, got {value}")
        values.append(value)
    return tuple(dict.fromkeys(values))  # in the order given, without repeats


def _names(text: str, flag: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    names = [item.strip() for item in str(text).split(",") if item.strip()]
    if not names:
        raise MorionError(f"{flag} needs at least one of {', '.join(allowed)}")
    for name in names:
        if name not in allowed:
            raise MorionError(f"unknown workload {name!r} in {flag} (choose from {', '.join(allowed)})")
    return tuple(dict.fromkeys(names))
