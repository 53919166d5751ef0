"""The speculative decoding workload (`--workloads spec`): decode speed with and without speculation on the
same weights, in one of two modes chosen by `--speculative`.

- off or mtp: at a chosen mean accepted length, with forced acceptance. Its numbers are SYNTHETIC (below).
- ngram: with REAL acceptance (`_RealPair`, after the synthetic mode): the engine's n-gram drafter
  (`morion/spec/ngram.py`) proposes from each request's own tokens and the target's greedy verdict keeps
  what it agrees with, on code-edit prompts (`morion/bench/prompts.py`: a Python module and an
  instruction to return it whole with one change, answers that copy long spans of their prompt). Greedy
  speculation must reproduce the plain output token for token: each request records `identical`, and a
  difference fails the run (every point still runs; the results are written, then the bench exits with
  an error, `failure_message`).

The synthetic mode:

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
import hashlib
import statistics
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from morion.bench.offline import EngineTarget, generate
from morion.bench.profile import ProfileSession, decode_point
from morion.bench.prompts import CODE_EDIT, CODE_EDIT_SEED, CodeEditPrompts, PromptFactory
from morion.bench.report import SPEC_METHOD, SPEC_METHOD_REAL
from morion.bench.roofline import read_hf_config
from morion.bench.timing import GroupResult, median_of
from morion.bench.workloads import WARMUP_MAX_TOKENS, grid, rate_text
from morion.engine.engine import Engine
from morion.errors import MorionError
from morion.loader import LoadedModel
from morion.spec.drafter import Drafter, DraftRequest, Drafts
from morion.spec.forced import ForcedAcceptance
from morion.spec.synthetic import acceptance_for_mean_accepted

if TYPE_CHECKING:
    from morion.bench.options import BenchOptions
    from morion.bench.workloads import Workbench
    from morion.config import EngineConfig

# SpecStats counters whose change over a run is recorded with it (besides the per-position lists).
COUNTERS = ("verify_steps", "drafted_tokens", "accepted_tokens", "emitted_tokens")
POSITIONS = ("drafted_by_position", "accepted_by_position")
# What drafts for each --speculative of the synthetic mode (forced acceptance).
DRAFTERS = {"off": "cost-free", "mtp": "mtp"}
# The --speculative of the real mode: a model-free drafter, verified by the target's own greedy verdict.
REAL = "ngram"


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
    real = config.speculative == REAL  # else off or mtp (EngineConfig allows nothing else)
    width, mean = config.spec_width, options.spec_mean_accepted
    if width is None:
        example = "--spec-width 4" if real else "--spec-width 3 --spec-mean-accepted 2.58"
        raise MorionError(f"--workloads spec needs --spec-width N, the draft width: e.g. {example}")
    if not real and mean > width + 1:
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
    acceptance `acceptance` from one generator seeded by `seed` for the engine's whole life; prompts of
    random ids from `prompts`."""

    def __init__(
        self, plain: Engine, config: EngineConfig, acceptance: float, seed: int, prompts: PromptFactory
    ) -> None:
        self.plain = plain
        self.prompts = prompts
        drafter = None if config.speculative == "mtp" else CostFreeDrafter()  # None: the engine's MTP
        forced = ForcedAcceptance(acceptance, seed)
        self.speculative = Engine(config, _same_weights(plain), drafter=drafter, forced_acceptance=forced)

    def run(self, keys: list[str], context: int, max_tokens: int) -> dict[str, Any]:
        """Both engines on the prompts of `keys` (`context` ids each), plain first; their outputs are not
        compared (the module doc says why)."""
        prompts = [self.prompts.make(key, context) for key in keys]
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

    def prompt(self, key: str, length: int) -> list[int]:
        return self.prompts.make(key, length)

    def close(self) -> None:
        self.speculative.close()


class _CountingDrafter:
    """The engine's drafter, counting the request-steps it is asked to draft for (`asked`: one target
    forward each, a verify step or, without a proposal, a plain decode step) and those it proposed at
    least one token for (`proposed`)."""

    def __init__(self, drafter: Drafter) -> None:
        self.drafter = drafter
        self.name = drafter.name
        self.asked = 0
        self.proposed = 0

    def propose(self, requests: Sequence[DraftRequest], width: int) -> Drafts:
        drafts = self.drafter.propose(requests, width)
        self.asked += len(requests)
        self.proposed += sum(1 for tokens in drafts.tokens if tokens)
        return drafts

    def release(self, request_id: str) -> None:
        self.drafter.release(request_id)


class _RealPair:
    """The plain engine and a speculative one built from `config` (`--speculative ngram`: the engine's own
    n-gram drafter) on the same weights, without forced acceptance; code-edit prompts from the model's
    tokenizer. Greedy outputs are compared request by request."""

    def __init__(self, plain: Engine, config: EngineConfig) -> None:
        if plain.tokenizer is None:
            raise MorionError(
                f"--workloads spec --speculative {REAL} builds {CODE_EDIT} prompts with the model's "
                f"tokenizer, and {plain.model_path} has none"
            )
        self.plain = plain
        self.prompts = CodeEditPrompts(plain.tokenizer)
        self.speculative = Engine(config, _same_weights(plain))
        speculation = self.speculative.speculative
        self.ngram = [speculation.drafter.min_ngram, speculation.drafter.max_ngram]
        self.counter = _CountingDrafter(speculation.drafter)
        speculation.drafter = self.counter

    def counters(self) -> dict[str, Any]:
        return {
            **_counters(self.speculative),
            "drafter_asked": self.counter.asked,
            "drafter_proposed": self.counter.proposed,
        }

    def run(self, keys: list[str], context: int, max_tokens: int) -> dict[str, Any]:
        """Both engines on the code-edit prompts of `keys` (at most `context` tokens each), plain first;
        each request's speculative output must equal its plain output."""
        made = [self.prompts.make(key, context) for key in keys]
        prompts = [prompt.token_ids for prompt in made]
        plain_timings, expected = generate(self.plain, prompts, max_tokens)
        before = self.counters()
        timings, outputs = generate(self.speculative, prompts, max_tokens)
        change = _add(self.counters(), before, sign=-1)
        differences = [
            _first_difference(mine, theirs) for mine, theirs in zip(outputs, expected, strict=True)
        ]
        tokenizer = self.plain.tokenizer
        return {
            "prompts": [
                {
                    "task": prompt.task,
                    "instruction": prompt.instruction,
                    "functions": prompt.functions,
                    "prompt_tokens": len(prompt.token_ids),
                    "prompt_sha256": hashlib.sha256(prompt.text.encode()).hexdigest(),
                    "text": prompt.text,
                }
                for prompt in made
            ],
            "plain": GroupResult(plain_timings).sample(),
            "speculative": GroupResult(timings).sample(),
            "identical": [difference is None for difference in differences],
            "first_difference": differences,  # per request: the first token index that differs, or None
            "plain_output_token_ids": expected,
            "plain_output_text": [tokenizer.decode(ids, skip_special_tokens=False) for ids in expected],
            # Only where they differ (else they are the plain ones).
            "speculative_output_token_ids": [
                None if difference is None else ids
                for ids, difference in zip(outputs, differences, strict=True)
            ],
            "spec_stats": change,
            "mean_accepted": _mean_accepted(change),
        }

    def prompt(self, key: str, length: int) -> list[int]:
        """A code-edit prompt of at most `length` tokens."""
        return self.prompts.make(key, length).token_ids

    def close(self) -> None:
        self.speculative.close()


def run_spec(
    bench: Workbench,
    target: EngineTarget,
    config: EngineConfig,
    options: BenchOptions,
    on_update: Callable[[dict[str, Any]], None] | None = None,
    profile: ProfileSession | None = None,
) -> dict[str, Any]:
    """Runs the workload with `target`'s engine as the plain one and a speculative engine built from
    `config` (the engine flags); returns the `spec` section of the results, which `on_update` also
    receives after every point. With `profile` (--profile), each measured point is then profiled on the
    speculative engine (bench/profile.py). With `--speculative ngram`, outputs that differ from plain are
    listed in the section's `failures` (`failure_message`): the run fails once the results are written."""
    if config.speculative == REAL:
        pair: _EnginePair | _RealPair = _RealPair(target.engine, config)
        section = _real_section(bench, pair, config, options)
    else:
        width, mean = config.spec_width, options.spec_mean_accepted
        acceptance = acceptance_for_mean_accepted(mean, width)
        seed = bench.prompts.salt
        pair = _EnginePair(target.engine, config, acceptance, seed, bench.prompts)
        section = {
            "engine": bench.label,
            "synthetic": True,
            "method": SPEC_METHOD,
            "acceptance": "forced: each verify step accepts draft j with probability acceptance_p given the "
            "ones before it were, whatever the target says, then adds the target's own greedy token",
            "drafter": DRAFTERS[config.speculative],  # cost-free: no draft model runs; mtp: the MTP head
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
            point = _point(bench, pair, concurrency, context, options)
            section["points"].append(point)
            if "failures" in section:
                section["failures"] += _failures(point)
            if on_update is not None:
                on_update(section)
        for point in section["points"] if profile is not None else ():
            shape = decode_point("spec", point["concurrency"], point["context"], options)
            profile.profile(bench, pair.speculative, shape, pair.prompt, None)
    finally:
        pair.close()
    return section  # differing outputs are in section["failures"]: the run fails once they are written


def failure_message(section: dict[str, Any] | None) -> str | None:
    """The one error line of a real-acceptance section whose outputs differed from plain; else None."""
    failures = (section or {}).get("failures")
    if not failures:
        return None
    return (
        f"spec FAILED: greedy output with --speculative {REAL} differs from plain: {failures[0]} "
        f"({len(failures)} differing outputs in all)"
    )


def _real_section(
    bench: Workbench, pair: _RealPair, config: EngineConfig, options: BenchOptions
) -> dict[str, Any]:
    return {
        "engine": bench.label,
        "synthetic": False,
        "method": SPEC_METHOD_REAL,
        "acceptance": "real: the target's greedy verdict on the drafter's proposals (drafts kept while they "
        "equal the target's argmax, then the target's own token); nothing is forced",
        "drafter": REAL,
        "drafter_name": pair.counter.name,  # as the engine reports it
        "ngram": pair.ngram,  # [min, max] n of the lookup
        "width": config.spec_width,
        "prompt_set": {
            "name": CODE_EDIT,
            "seed": CODE_EDIT_SEED,  # with each request's prompt_key + index; not the salt
            "format": "chat template" if pair.prompts.chat else "plain text",
            "description": "a Python module of generated helper functions (as many as fit the context) and "
            "an instruction to return it whole with one change: rename a function, change a constant, add "
            "type hints, or replace print with logging",
        },
        "outputs_must_match": True,
        "torch_threads": torch.get_num_threads(),  # intra-op threads of CPU kernels (OMP_NUM_THREADS)
        "output_tokens": options.output_tokens,
        "repeats": options.repeats,
        "warmup_runs": options.warmup_runs,
        "points": [],
        "skipped": [],
        "failures": [],
    }


def _point(
    bench: Workbench, pair: _EnginePair | _RealPair, concurrency: int, context: int, options: BenchOptions
) -> dict[str, Any]:
    name = f"{bench.label} spec C={concurrency} ctx={context}"
    key = f"{bench.label}:spec:{concurrency}:{context}"

    def run(run_key: str, max_tokens: int) -> dict[str, Any]:
        keys = [f"{run_key}:{i}" for i in range(concurrency)]
        return {"prompt_key": run_key, **pair.run(keys, context, max_tokens)}

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


def _first_difference(mine: list[int], theirs: list[int]) -> int | None:
    """The first token index where two outputs differ (the shorter one's length if one is a prefix of the
    other), or None where they are equal."""
    if mine == theirs:
        return None
    return next(
        (j for j, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b), min(len(mine), len(theirs))
    )


def _summarize(point: dict[str, Any]) -> None:
    """Medians, speedup, and the SpecStats change summed over the measured runs; with real acceptance also
    the drafter's proposal rate, decode tokens per request-step and whether every output was identical."""
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
    if "identical" not in runs[0]:
        return
    asked = change["drafter_asked"]
    point["proposal_rate"] = change["drafter_proposed"] / asked if asked else None
    decoded = sum(r["completion_tokens"] - 1 for run in runs for r in run["speculative"]["requests"])
    point["decode_tokens_per_step"] = decoded / asked if asked else None
    point["prompt_tokens"] = statistics.median(p["prompt_tokens"] for run in runs for p in run["prompts"])
    point["identical"] = all(all(run["identical"]) for run in [*point["warmup_runs"], *runs])


def _failures(point: dict[str, Any]) -> list[str]:
    """One line per request whose speculative output differs from its plain one."""
    where = f"C{point['concurrency']} ctx {point['context']:,}"
    failures = []
    for kind, runs in (("warm-up", point["warmup_runs"]), ("run", point["runs"])):
        for index, run in enumerate(runs):
            for request, token in enumerate(run["first_difference"]):
                if token is not None:
                    at = f"request {request} from token {token}"
                    failures.append(f"{where}, {kind} {index + 1}: output differs from plain at {at}")
    return failures


def _progress(run: dict[str, Any]) -> str:
    plain, fast = run["plain"]["per_request_tok_s"], run["speculative"]["per_request_tok_s"]
    ratio = f" ({fast / plain:.2f}x)" if plain and fast else ""
    mean = run["mean_accepted"]
    line = (
        f"plain {rate_text(plain)} tok/s, speculative {rate_text(fast)} tok/s{ratio}, mean accepted "
        f"{'n/a' if mean is None else f'{mean:.2f}'}"
    )
    if "identical" in run:
        differ = [str(i) for i, same in enumerate(run["identical"]) if not same]
        line += (
            ", outputs identical" if not differ else f", output FAILED: request {', '.join(differ)} differs"
        )
    return line


def _summary_line(point: dict[str, Any]) -> str:
    median, speedup, mean = point["median"], point["speedup"], point["measured_mean_accepted"]
    line = (
        f"median per-request plain {rate_text(median['plain_per_request_tok_s'])} tok/s, speculative "
        f"{rate_text(median['speculative_per_request_tok_s'])} tok/s"
    )
    line += f" ({speedup:.2f}x)" if speedup is not None else ""
    line += f", measured mean accepted {mean:.2f}" if mean is not None else ""
    if "identical" in point:
        rate = point["proposal_rate"]
        line += f", drafts proposed at {rate:.0%} of steps" if rate is not None else ""
        line += ", outputs identical" if point["identical"] else ", outputs FAILED (differ from plain)"
    return line
