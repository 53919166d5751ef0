"""The engine's command-line flags, declared once.

Each `EngineFlag` names the `EngineConfig` field it sets and how argparse reads it. `add_engine_flags` adds
the table to a parser (`generate`, `serve`, `bench`; `serve --config` profiles take the same keys) and
`engine_options` reads the values back from the same table, so a flag cannot be parsed and then dropped
(`--spec-token-map` once was: it was missing from a second list of names). Every EngineConfig field is a
flag here or is named in `NOT_FLAGS` with the reason; `tests/test_engine_flags.py` checks both, and that
each flag's value reaches the config.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable
from typing import Any

from morion.config import (
    KV_CACHE_DTYPES,
    MOE_KERNELS,
    PDL_MODES,
    PLE_PLACEMENTS,
    QSA_PREFILL_KERNELS,
    SPECULATIVE_METHODS,
    WEIGHT_DTYPES,
    EngineConfig,
)


def bounded(kind: Callable[[str], float], minimum: float, name: str) -> Callable[[str], float]:
    """An argparse type: a finite number of `kind` that is at least `minimum`, with one-line errors."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{name} must be a finite number, got {text}")
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{name} must be >= {minimum}, got {text}")
        return value

    return parse


def token_counts(name: str) -> Callable[[str], tuple[int, ...]]:
    """An argparse type: comma-separated positive integers, as given (EngineConfig checks their order
    against each other and the chunk size), or `none` for no counts, with one-line errors."""
    count = bounded(int, 1, name)

    def parse(text: str) -> tuple[int, ...]:
        if text.strip().lower() == "none":
            return ()
        return tuple(int(count(part)) for part in text.split(",") if part.strip())

    return parse


@dataclasses.dataclass(frozen=True)
class EngineFlag:
    field: str  # the EngineConfig field it sets
    help: str
    option: str = ""  # "": the field's name with dashes (--page-size)
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)  # argparse's: type, choices, action
    aliases: tuple[str, ...] = ()  # further option strings (--tp)

    @property
    def name(self) -> str:
        return self.option or "--" + self.field.replace("_", "-")


def _number(field: str, kind: Callable[[str], float], minimum: float, help: str) -> EngineFlag:
    return EngineFlag(field, help, kwargs={"type": bounded(kind, minimum, "--" + field.replace("_", "-"))})


def _choice(field: str, choices: tuple[str, ...], help: str) -> EngineFlag:
    return EngineFlag(field, help, kwargs={"choices": choices})


def _switch(field: str, option: str, value: bool, help: str) -> EngineFlag:
    """A flag without a value that sets `field` to `value`; left out, the field keeps its default."""
    action = "store_true" if value else "store_false"
    return EngineFlag(field, help, option, {"action": action, "default": None})


# `info` takes only these (it loads the model and nothing else).
MODEL_FLAGS = (
    EngineFlag(
        "model", "model directory, .gguf file, known name or preset:NAME (default: smollm2-135m-instruct)"
    ),
    EngineFlag(
        "dtype", "auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16, float16", kwargs={"default": "auto"}
    ),
    EngineFlag("device", "auto, cpu, cuda, cuda:N", kwargs={"default": "auto"}),
)

ENGINE_FLAGS = (
    _number("page_size", int, 1, "tokens per KV page (default 16)"),
    _number("kv_cache_tokens", int, 1, "KV pool capacity in tokens"),
    _number(
        "kv_cache_gb",
        float,
        0.0,
        "KV pool size in GiB (default: 1 on CPU, --mem-fraction of free memory on CUDA)",
    ),
    _number("mem_fraction", float, 0.0, "share of free CUDA memory (0.85)"),
    _number(
        "max_model_len",
        int,
        1,
        "longest prompt + generation (default: the model's context, capped by the KV pool)",
    ),
    _number("chunk_size", int, 1, "token budget of one engine step (4096)"),
    _number("max_running_requests", int, 1, "batch size cap (64)"),
    _choice("load_format", ("auto", "dummy"), "dummy: random weights of the real shapes (benchmarks)"),
    _choice("state_dtype", ("float32", "bfloat16"), "Gated DeltaNet recurrent state (float32)"),
    _number("state_slots", int, 1, "per-request state slots (4 per running request)"),
    _number("host_cache_gb", float, 0.0, "host-RAM cache tier (off)"),
    _choice(
        "host_cache_write_policy",
        ("write_through", "write_back"),
        "write_through (default): every cached page; write_back: what the device evicts",
    ),
    _number("host_cache_state_fraction", float, 0.0, "share of --host-cache-gb for state snapshots (0.25)"),
    EngineFlag("disk_cache_dir", "disk cache tier root (needs --host-cache-gb)"),
    _number(
        "disk_cache_gb", float, 0.0, "disk tier budget (default: half of the free space + its own objects)"
    ),
    _switch(
        "disk_cache_direct_io",
        "--disk-cache-direct-io",
        True,
        "write disk cache objects with O_DIRECT (default: buffered: a restart reads the page cache)",
    ),
    _choice(
        "weight_dtype",
        WEIGHT_DTYPES,
        "fp8: store linear and expert weights in e4m3; nvfp4: the same, routed experts in 4-bit NVFP4 (auto)",
    ),
    _choice("kv_cache_dtype", KV_CACHE_DTYPES, "K/V pool dtype (auto: the model dtype)"),
    _switch("cuda_graph", "--no-cuda-graph", False, "run decode steps eagerly (debugging)"),
    _number("cuda_graph_max_batch", int, 1, "largest decode batch captured in a CUDA graph (64)"),
    EngineFlag(
        "prefill_graph_tokens",
        "token buckets of piecewise prefill CUDA graphs, or none: prefill eager (256,512,1024,2048 and the "
        "chunk size)",
        kwargs={"type": token_counts("--prefill-graph-tokens"), "metavar": "N,N,...|none"},
    ),
    _number(
        "activation_reserve_gb",
        float,
        0.0,
        "CUDA memory kept free for activations (default: measured by a warm-up forward)",
    ),
    _choice(
        "moe_kernel",
        MOE_KERNELS,
        "routed experts on CUDA: fused Triton kernels to 64 tokens, then grouped GEMMs (auto); the fused "
        "kernels at every size, their grouped mode past 1,024 (token, expert) pairs (triton); grouped GEMMs "
        "(grouped)",
    ),
    _choice(
        "pdl",
        PDL_MODES,
        "programmatic dependent launch of the Triton kernels (Hopper on): each launched while the one "
        "before it drains (launch), and the skinny linears' weights sent to L2 meanwhile (prefetch); "
        "auto: prefetch where the GPU has it, else off",
    ),
    _choice(
        "qsa_prefill",
        QSA_PREFILL_KERNELS,
        "Qwen3.8-Flash-Next's long prefill pieces on CUDA: QSA's split-KV kernel, each query row alone "
        "(split), or its selected-blocks kernel, a tile of queries on tensor cores, up to a context of 8 "
        "budgets (selected; H200: +23 %% prefill at 8K, +5 %% at 32K; not yet qualified through the server)",
    ),
    _choice(
        "speculative",
        SPECULATIVE_METHODS,
        "speculative decoding: mtp (the model's own draft head) or ngram (lookups in the conversation)",
    ),
    EngineFlag(
        "spec_token_map", "FR-Spec draft vocabulary for mtp (morion frspec build)", kwargs={"metavar": "FILE"}
    ),
    EngineFlag("spec_policy", "draft width policy, JSON (docs/speculative.md)", kwargs={"metavar": "FILE"}),
    _number("spec_width", int, 1, "a fixed draft width instead of the policy"),
    _choice(
        "ple_placement",
        PLE_PLACEMENTS,
        "Qwen3.8-Flash-Next's n-gram table: host RAM, pinned on CUDA (ram), or memory-mapped files",
    ),
    _switch("enable_prefix_cache", "--no-prefix-cache", False, "do not reuse cached prompt prefixes"),
    _switch(
        "overlap_decode",
        "--overlap-decode",
        True,
        "launch each decode step before the previous step's tokens reach the host (requests without "
        "penalties, logit bias, grammar or logprobs; one rank, no speculative decoding; outputs arrive a "
        "step later; H200: no gain on the 80B, whose decode step is the device's time)",
    ),
    _switch(
        "merge_projections",
        "--no-merged-projections",
        False,
        "CUDA: one decode launch per linear layer, not one per group of layers of one input (A/B runs)",
    ),
    EngineFlag(
        "tensor_parallel_size",
        "split the model over N ranks: one process and device each, NCCL on CUDA, gloo on the CPU (1)",
        aliases=("--tp",),
        kwargs={"type": bounded(int, 1, "--tensor-parallel-size"), "metavar": "N"},
    ),
)

# EngineConfig fields that no flag sets, and why.
NOT_FLAGS = {
    "seed": "the random-weights seed: the command line always draws seed 0 (generate's --seed samples)",
}


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    for flag in MODEL_FLAGS:
        parser.add_argument(flag.name, dest=flag.field, help=flag.help, **flag.kwargs)


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """The model flags and the engine's; a flag left out keeps EngineConfig's default."""
    add_model_flags(parser)
    for flag in ENGINE_FLAGS:
        parser.add_argument(flag.name, *flag.aliases, dest=flag.field, help=flag.help, **flag.kwargs)


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig fields the flags set, all but the model (`EngineConfig(model=args.model, **...)`)."""
    return {
        flag.field: value
        for flag in (*MODEL_FLAGS, *ENGINE_FLAGS)
        if flag.field != "model" and (value := getattr(args, flag.field, None)) is not None
    }


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(model=args.model, **engine_options(args))
