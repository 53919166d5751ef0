"""The speculative decoding workload (`--workloads spec`): decode speed with and without speculation at a
chosen mean accepted length, on the same weights. Its numbers are SYNTHETIC.

A random-weight model gives a real drafter nothing to predict, so the speculative engine runs with
forced acceptance (`morion/spec/forced.py`): each verify step accepts draft j with probability p given
the drafts before it were (a truncated geometric count from one seeded generator), whatever the target
says, then adds the target's own greedy token at the first position not accepted; p is solved from
`--spec-mean-accepted` at `--spec-width` (`acceptance_for_mean_accepted`). The engine's K/V, hybrid
states, MTP extend and bookkeeping are exactly those of real speculation at that acceptance. Each run of
a point (context L, concurrency C) is two runs on the same C fresh prompts:

1. plain: the bench's engine, the engine flags' config with speculation off;
2. speculative: a second engine built from the engine flags' config on the same loaded weights, with
   forced acceptance. `--speculative` names what drafts. mtp: the model's MTP head (drafter None, the
   engine builds it), so its cost (extend and chained draft steps, K/V writes) and its drafts are real.
   Left out (off): `CostFreeDrafter`, `width` repeats of the last token from the token ids alone, so
   drafting costs nothing and the speedup is the most a drafter at this acceptance could reach.

Outputs are not compared. The forced acceptance decides which drafts are kept, so the speculative text
is not the target's greedy continuation (accepted drafts are whatever was proposed); the target still
computes every verify forward over all drafts and its own token after the accepted ones, which is the
work being timed. (The oracle method this replaces, a drafter proposing the plain run's greedy output,
failed on random BF16 weights: near-tied logits make greedy tokens follow kernel rounding, the verify
forward rounds differently from a decode step, outputs split within a token or two and acceptance
collapsed.) That greedy speculation reproduces the plain output is what the engine tests check.

Per point: the per-request post-first-token rate of both (median over runs of each run's median), their
ratio, and the mean accepted length and per-position acceptance from the change in the speculative
engine's `SpecStats` over the measured runs only (warm-ups are excluded), with its verify CUDA graph
replays. Every verify step drafts `width` tokens, so accepted / drafted at position j is p^j.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from morion.bench.offline import EngineTarget, generate
from morion.bench.report import SPEC_METHOD
from morion.bench.roofline import read_hf_config
from morion.bench.timing import GroupResult, median_of
from morion.bench.workloads import WARMUP_MAX_TOKENS, grid, rate_text
from morion.engine.engine import Engine
from morion.errors import MorionError
from morion.loader import LoadedModel
from morion.spec.drafter import DraftRequest, Drafts
from morion.spec.forced import ForcedAcceptance
from morion.spec.synthetic import acceptance_for_mean_accepted

if TYPE_CHECKING:
    from morion.bench.options import BenchOptions
    from morion.bench.workloads import Workbench
    from morion.config import EngineConfig

# SpecStats counters whose change over a run is recorded with it (besides the per-position lists).
COUNTERS = ("verify_steps", "drafted_tokens", "accepted_tokens", "emitted_tokens")
POSITIONS = ("drafted_by_position", "accepted_by_position")
# What drafts for each --speculative the workload takes (ngram proposes only where it finds a match).
DRAFTERS = {"off": "cost-free", "mtp": "mtp"}


class CostFreeDrafter:
    """The speculative engine's drafter without `--speculative`: `width` repeats of each request's last
    token, read from its token ids (no model runs), so drafting costs next to nothing. Benchmarks only:
    under forced acceptance what it proposes does not matter, only that it proposes `width` tokens."""

    name = DRAFTERS["off"]

    def propose(self, requests: Sequence[DraftRequest], width: int) -> Drafts:
        tokens = [[int(r.token_ids[-1])] * width for r in requests]
        return Drafts(tokens=tokens, probs=[None] * len(tokens))

    def release(self, request_id: str) -> None:
        pass


def check_flags(config: EngineConfig, options: BenchOptions) -> None:
    """The engine flags the workload needs, checked before any engine is built."""
    if config.speculative not in DRAFTERS:
        raise MorionError(
            f"--workloads spec forces the acceptance of full-width drafts, and --speculative "
            f"{config.speculative} proposes only where it finds a match: use --speculative mtp (the MTP "
            "head drafts, at its real cost) or leave it out (a cost-free drafter)"
        )
    width, mean = config.spec_width, options.spec_mean_accepted
    if width is None:
        raise MorionError(
            "--workloads spec needs --spec-width N, the draft width: e.g. --spec-width 3 "
            "--spec-mean-accepted 2.58"
        )
    if mean > width + 1:
        raise MorionError(
            f"--spec-mean-accepted {mean:g} must be in [1, {width + 1}] at --spec-width {width} (the drafts "
            "and the target's own token)"
        )
    if config.host_cache_gb is not None:
        raise MorionError(
            "--workloads spec compares two engines without cache tiers (backups would slow one of them): "
            "leave out --host-cache-gb and --disk-cache-dir, and run restore on its own"
        )
    sized = config.kv_cache_tokens is not None or config.kv_cache_gb is not None
    if config.torch_device.type == "cuda" and not sized:
        raise MorionError(
            "--workloads spec builds a second engine beside the first, and a pool sized from the free "
            "memory would leave it none: give --kv-cache-tokens (e.g. 65536) or --kv-cache-gb"
        )


def plain_config(config: EngineConfig) -> EngineConfig:
    """The bench engine's config when the workload runs: the plain engine, without speculation."""
    return dataclasses.replace(config, speculative="off", spec_token_map=None)


class _EnginePair:
    """The plain engine and a speculative one built from `config` on the same weights, with forced
    acceptance `acceptance` from one generator seeded by `seed` for the engine's whole life."""

    def __init__(self, plain: Engine, config: EngineConfig, acceptance: float, seed: int) -> None:
        self.plain = plain
        drafter = None if config.speculative == "mtp" else CostFreeDrafter()  # None: the engine's MTP
        forced = ForcedAcceptance(acceptance, seed)
        self.speculative = Engine(config, _same_weights(plain), drafter=drafter, forced_acceptance=forced)

    def run(self, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
        """Both engines on `prompts`, plain first; their outputs are not compared (the module doc says
        why)."""
        plain_timings, _ = generate(self.plain, prompts, max_tokens)
        before = _counters(self.speculative)
        timings, _ = generate(self.speculative, prompts, max_tokens)
        change = _add(_counters(self.speculative), before, sign=-1)
        return {
            "plain": GroupResult(plain_timings).sample(),
            "speculative": GroupResult(timings).sample(),
            "spec_stats": change,
            "mean_accepted": _mean_accepted(change),
        }

    def close(self) -> None:
        self.speculative.close()


def run_spec(
    bench: Workbench,
    target: EngineTarget,
    config: EngineConfig,
    options: BenchOptions,
    on_update: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Runs the workload with `target`'s engine as the plain one and a speculative engine built from
    `config` (the engine flags); returns the `spec` section of the results, which `on_update` also
    receives after every point."""
    width, mean = config.spec_width, options.spec_mean_accepted
    acceptance = acceptance_for_mean_accepted(mean, width)
    seed = bench.prompts.salt
    pair = _EnginePair(target.engine, config, acceptance, seed)
    section: dict[str, Any] = {
        "engine": bench.label,
        "synthetic": True,
        "method": SPEC_METHOD,
        "acceptance": "forced: each verify step accepts draft j with probability acceptance_p given the ones "
        "before it were, whatever the target says, then adds the target's own greedy token",
        "drafter": DRAFTERS[config.speculative],  # cost-free: no draft model runs; mtp: the MTP head drafts
        "drafter_name": pair.speculative.speculative.drafter.name,  # as the engine reports it
        "width": width,
        "target_mean_accepted": mean,
        "acceptance_p": acceptance,
        "acceptance_seed": seed,  # one generator for the engine's life, warm-ups included
        "output_tokens": options.output_tokens,
        "repeats": options.repeats,
        "warmup_runs": options.warmup_runs,
        "points": [],
        "skipped": [],
    }
    limit = options.max_cell_prompt_tokens
    try:
        for concurrency, context in grid(
            bench, "spec", options.concurrency, options.contexts, limit, section["skipped"]
        ):
            section["points"].append(_point(bench, pair, concurrency, context, options))
            if on_update is not None:
                on_update(section)
    finally:
        pair.close()
    return section


def _point(
    bench: Workbench, pair: _EnginePair, concurrency: int, context: int, options: BenchOptions
) -> dict[str, Any]:
    name = f"{bench.label} spec C={concurrency} ctx={context}"
    key = f"{bench.label}:spec:{concurrency}:{context}"

    def run(run_key: str, max_tokens: int) -> dict[str, Any]:
        prompts = [bench.prompts.make(f"{run_key}:{i}", context) for i in range(concurrency)]
        return {"prompt_key": run_key, **pair.run(prompts, max_tokens)}

    point: dict[str, Any] = {"concurrency": concurrency, "context": context, "warmup_runs": [], "runs": []}
    for w in range(options.warmup_runs):
        bench.say(f"{name}: warm-up {w + 1}/{options.warmup_runs}")
        point["warmup_runs"].append(run(f"{key}:warmup{w}", min(options.output_tokens, WARMUP_MAX_TOKENS)))
    for r in range(options.repeats):
        point["runs"].append(run(f"{key}:{r}", options.output_tokens))
        bench.say(f"{name}: run {r + 1}/{options.repeats}: {_progress(point['runs'][-1])}")
    _summarize(point)
    bench.say(f"{name}: {_summary_line(point)}")
    return point


def _same_weights(engine: Engine) -> LoadedModel:
    """`engine`'s model as a `LoadedModel`, for a second engine on the same weights. An engine keeps the
    model, tokenizer and path but not the HF config, which is read again (only a disk tier reads it)."""
    hf_config = read_hf_config(str(engine.model_path))
    return LoadedModel(engine.model, engine.tokenizer, hf_config, engine.model_path)


def _counters(engine: Engine) -> dict[str, Any]:
    stats = engine.speculative.stats
    return {
        **{name: getattr(stats, name) for name in COUNTERS},
        **{name: list(getattr(stats, name)) for name in POSITIONS},
        "verify_graph_replays": sum(runner.replays for runner in engine.verify_graphs.values()),
    }


def _add(a: dict[str, Any], b: dict[str, Any], sign: int = 1) -> dict[str, Any]:
    """a + sign * b, key by key; per-position lists are padded with zeros to the longer one."""
    total: dict[str, Any] = {}
    for key, value in a.items():
        other = b[key]
        if isinstance(value, list):
            size = max(len(value), len(other))
            value, other = value + [0] * (size - len(value)), other + [0] * (size - len(other))
            total[key] = [x + sign * y for x, y in zip(value, other, strict=True)]
        else:
            total[key] = value + sign * other
    return total


def _mean_accepted(change: dict[str, Any]) -> float | None:
    """Tokens a request gained per verify step: emitted / request-steps, where every request-step emits
    its accepted drafts and one token of the target's own."""
    steps = change["emitted_tokens"] - change["accepted_tokens"]
    return change["emitted_tokens"] / steps if steps else None


def _summarize(point: dict[str, Any]) -> None:
    """Medians, speedup, and the SpecStats change summed over the measured runs."""
    runs = point["runs"]
    plain = median_of([run["plain"] for run in runs], "per_request_tok_s")
    fast = median_of([run["speculative"] for run in runs], "per_request_tok_s")
    point["median"] = {"plain_per_request_tok_s": plain, "speculative_per_request_tok_s": fast}
    point["speedup"] = fast / plain if plain and fast is not None else None
    change = functools.reduce(_add, [run["spec_stats"] for run in runs])
    point["spec_stats"] = change
    point["measured_mean_accepted"] = _mean_accepted(change)
    point["acceptance_by_position"] = [
        accepted / drafted if drafted else None
        for accepted, drafted in zip(
            change["accepted_by_position"], change["drafted_by_position"], strict=True
        )
    ]


def _progress(run: dict[str, Any]) -> str:
    plain, fast = run["plain"]["per_request_tok_s"], run["speculative"]["per_request_tok_s"]
    ratio = f" ({fast / plain:.2f}x)" if plain and fast else ""
    mean = run["mean_accepted"]
    return (
        f"plain {rate_text(plain)} tok/s, speculative {rate_text(fast)} tok/s{ratio}, mean accepted "
        f"{'n/a' if mean is None else f'{mean:.2f}'}"
    )


def _summary_line(point: dict[str, Any]) -> str:
    median, speedup, mean = point["median"], point["speedup"], point["measured_mean_accepted"]
    line = (
        f"median per-request plain {rate_text(median['plain_per_request_tok_s'])} tok/s, speculative "
        f"{rate_text(median['speculative_per_request_tok_s'])} tok/s"
    )
    line += f" ({speedup:.2f}x)" if speedup is not None else ""
    return line + (f", measured mean accepted {mean:.2f}" if mean is not None else "")
