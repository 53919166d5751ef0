"""How many draft tokens to verify per step: the width policy (`--spec-policy FILE`).

The file maps batch-size floors to candidate widths (width 0: speculation off at that batch size):

    {"rules": [{"min_batch": 1, "widths": [1, 2, 3, 4]},
               {"min_batch": 8, "widths": [1, 2], "cost_per_token": 0.15},
               {"min_batch": 32, "widths": [0]}],
     "ema": 0.9, "hysteresis": 0.05, "cost_per_token": 0.07, "forget": 0.01}

A batch of b requests uses the rule with the largest `min_batch` <= b (the first rule must have
`min_batch` 1). Keys starting with "_" are comments; any other unknown key is an error.

The rule. The goal is tokens per unit time. A verify step of width k costs `1 + c*k` plain decode steps
(c = `cost_per_token`: the verify forward's extra tokens plus drafting them; Pennyroyal measured
`9.74 + 0.70*k` ms on Flash-Next, c ~ 0.07; MoE layers make c grow with the batch, hence the per-rule
override). It yields 1 + A tokens, A the accepted drafts. The policy estimates, per draft position j,
the conditional acceptance r_j = P(A >= j | A >= j-1) (an EMA with weight `ema` on the past, one
update per step from the step's requests), so that at any width k

    tokens(k) = 1 + sum_{j=1..k} prod_{i<=j} r_i,      throughput(k) = tokens(k) / (1 + c*k)

and picks the candidate with the highest throughput. The estimates are per position because a narrower
width k' < k would have accepted exactly min(A, k') drafts: narrowing is judged on what was observed,
not on a model. Positions beyond any width used so far take the deepest known r_j (a geometric
extrapolation), so when the current width is nearly always fully accepted, r_k ~ 1 predicts more tokens
from a wider step and the policy grows; when acceptance is low, the extra positions do not pay for
their cost and it shrinks.

Hysteresis: the policy leaves its current width w for the best candidate b only when throughput(b) >
(1 + `hysteresis`) * throughput(w). Staying is then never predicted to lose more than that fraction,
and going back and forth near a crossover needs the estimates to move the throughput ratio by
2 * `hysteresis`, which noise in a stationary EMA does not (at batch 1 an estimate's standard deviation
is ~0.1, moving the ratio by ~2%; the default margin is 5%).

Memory and exploration: estimates for positions beyond the current width keep their last value (so a
width that proved too wide stays rejected instead of being re-extrapolated every step) but relax toward
the deepest current estimate by `forget` per step, so a workload that turned repetitive is eventually
tried wider again (default 0.01: a half-life of about 70 steps).

Each rule starts at its widest candidate, which observes every position the rule could choose, and
keeps it until position 1 has been observed for one EMA window (`1 / (1 - ema)` steps: 10 at 0.9);
estimates are plain averages until their window fills, so early steps are not over-weighted. Width 0
must be a rule's only candidate: a step without drafts observes nothing, so a policy that chose 0 could
never learn to turn speculation back on; turn it off under load with a rule whose widths are [0].
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from morion.errors import MorionError
from morion.json_file import read_json_file

DEFAULT_POLICY: dict[str, Any] = {
    "rules": [
        {"min_batch": 1, "widths": [1, 2, 3, 4]},
        {"min_batch": 8, "widths": [1, 2]},
        {"min_batch": 32, "widths": [1]},
        {"min_batch": 64, "widths": [0]},
    ],
}
_DEFAULTS = {"ema": 0.9, "hysteresis": 0.05, "cost_per_token": 0.07, "forget": 0.01}
_RULE_KEYS = ("min_batch", "widths", "cost_per_token")


@dataclass(frozen=True)
class WidthRule:
    min_batch: int
    widths: tuple[int, ...]  # distinct, ascending; (0,) or all > 0
    cost_per_token: float


@dataclass(frozen=True)
class PolicyConfig:
    rules: tuple[WidthRule, ...]  # min_batch strictly increasing from 1
    ema: float
    hysteresis: float
    forget: float

    @classmethod
    def from_dict(cls, data: Any, source: str) -> PolicyConfig:
        """Validates `data` (a parsed policy file); errors are one line naming `source` and the field."""
        if not isinstance(data, dict):
            raise MorionError(f"{source}: must be a JSON object, got {type(data).__name__}")
        _reject_unknown(data, ("rules", *_DEFAULTS), source, "")
        values = {name: _number(data, name, default, source, "") for name, default in _DEFAULTS.items()}
        _check(values["ema"] < 1.0, source, "ema", "must be in [0, 1)", values["ema"])
        _check(values["forget"] <= 1.0, source, "forget", "must be in [0, 1]", values["forget"])
        rules = data.get("rules")
        _check(isinstance(rules, list) and len(rules) > 0, source, "rules", "must be a non-empty list", rules)
        parsed = tuple(
            _rule(rule, f"rules[{i}]", values["cost_per_token"], source) for i, rule in enumerate(rules)
        )
        _check(parsed[0].min_batch == 1, source, "rules[0].min_batch", "must be 1", parsed[0].min_batch)
        for i in range(1, len(parsed)):
            field = f"rules[{i}].min_batch"
            minimum = parsed[i - 1].min_batch
            _check(parsed[i].min_batch > minimum, source, field, f"must be > {minimum}", parsed[i].min_batch)
        return cls(parsed, values["ema"], values["hysteresis"], values["forget"])


class WidthPolicy:
    """Chooses the draft width per step (see the module doc for the rule); not thread-safe."""

    def __init__(self, config: PolicyConfig) -> None:
        self.config = config
        self.max_width = max(w for rule in config.rules for w in rule.widths)
        self._current = [max(rule.widths) for rule in config.rules]  # per rule, the hysteresis state
        # r_1..r_W and how many steps updated each; updated positions always form a prefix.
        self._acceptance = [0.0] * self.max_width
        self._updates = [0] * self.max_width
        self._warmup = math.ceil(1.0 / (1.0 - config.ema))  # one EMA window
        self.active_width = self._current[0]

    @property
    def candidate_widths(self) -> tuple[int, ...]:
        """Every width > 0 some rule may choose (the engine captures a verify CUDA graph for each)."""
        return tuple(sorted({w for rule in self.config.rules for w in rule.widths if w > 0}))

    @property
    def acceptance(self) -> tuple[float | None, ...]:
        """Estimated conditional acceptance per draft position (None: never observed), for metrics."""
        return tuple(r if n else None for r, n in zip(self._acceptance, self._updates, strict=True))

    def width(self, batch_size: int) -> int:
        """The width for a step of `batch_size` requests; becomes `active_width`."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        index = max(i for i, rule in enumerate(self.config.rules) if rule.min_batch <= batch_size)
        rule, current = self.config.rules[index], self._current[index]
        if rule.widths != (0,) and self._updates[0] >= self._warmup:
            # Ties go to the narrower width: the same predicted throughput for less work.
            best = max(rule.widths, key=lambda w: (self.throughput(w, rule.cost_per_token), -w))
            margin = 1.0 + self.config.hysteresis
            if self.throughput(best, rule.cost_per_token) > margin * self.throughput(
                current, rule.cost_per_token
            ):
                current = self._current[index] = best
        self.active_width = current
        return current

    def observe(self, batch_size: int, width: int, accepted_per_request: Sequence[int]) -> None:
        """A verify step of `width` drafts per request accepted these many per request.

        A request given fewer than `width` drafts counts as rejecting the first missing one: what the
        policy weighs is the tokens a verify step of this width yields. `batch_size` is part of the
        engine's report; the estimates are shared by all rules (acceptance is a property of the drafter
        and the text, not of the batch size).
        """
        if width == 0 or not accepted_per_request:
            return
        if not 1 <= width <= self.max_width:
            raise ValueError(f"width {width} is not in [1, {self.max_width}] (the policy's widest)")
        if any(not 0 <= a <= width for a in accepted_per_request):
            raise ValueError(f"accepted counts {list(accepted_per_request)} must be in [0, {width}]")
        for j in range(width):
            trials = sum(1 for a in accepted_per_request if a >= j)
            if trials == 0:
                break  # no request reached position j + 1, nor any later one
            rate = sum(1 for a in accepted_per_request if a > j) / trials
            # A plain average until the EMA window fills: the first steps are not over-weighted.
            keep = min(self.config.ema, self._updates[j] / (self._updates[j] + 1))
            self._acceptance[j] = keep * self._acceptance[j] + (1.0 - keep) * rate
            self._updates[j] += 1
        deepest = self._estimate(width)
        for j in range(width, self.max_width):
            if self._updates[j]:
                self._acceptance[j] += self.config.forget * (deepest - self._acceptance[j])

    def throughput(self, width: int, cost_per_token: float) -> float:
        """Predicted tokens per plain-decode-step time at `width` (needs one observation first)."""
        tokens, reach = 1.0, 1.0
        for j in range(1, width + 1):
            reach *= self._estimate(j)
            tokens += reach
        return tokens / (1.0 + cost_per_token * width)

    def _estimate(self, position: int) -> float:
        """r_position, or the deepest observed one before it (a geometric extrapolation)."""
        observed = [r for r, n in zip(self._acceptance[:position], self._updates, strict=False) if n]
        if not observed:
            raise RuntimeError("no acceptance observed yet")
        return observed[-1]


def load_width_policy(path: str | Path | None) -> WidthPolicy:
    """The policy in `path` (JSON, see the module doc), or `DEFAULT_POLICY` when None."""
    if path is None:
        return WidthPolicy(PolicyConfig.from_dict(DEFAULT_POLICY, "default spec policy"))
    return WidthPolicy(PolicyConfig.from_dict(read_json_file(path, "spec policy"), str(path)))


def fixed_width_policy(width: int) -> WidthPolicy:
    """A policy that always answers `width` (one rule, one candidate), e.g. for `--spec-width`."""
    return WidthPolicy(PolicyConfig.from_dict({"rules": [{"min_batch": 1, "widths": [width]}]}, "spec width"))


def _rule(data: Any, where: str, default_cost: float, source: str) -> WidthRule:
    _check(isinstance(data, dict), source, where, "must be an object", data)
    _reject_unknown(data, _RULE_KEYS, source, f"{where}.")
    min_batch = data.get("min_batch")
    _check(
        _is_int(min_batch) and min_batch >= 1,
        source,
        f"{where}.min_batch",
        "must be an integer >= 1",
        min_batch,
    )
    widths = data.get("widths")
    valid = isinstance(widths, list) and widths and all(_is_int(w) and w >= 0 for w in widths)
    field = f"{where}.widths"
    _check(valid and len(set(widths)) == len(widths), source, field, "must be distinct integers >= 0", widths)
    _check(
        0 not in widths or widths == [0], source, field, "0 (off) must be the only width of its rule", widths
    )
    cost = _number(data, "cost_per_token", default_cost, source, f"{where}.")
    return WidthRule(min_batch, tuple(sorted(widths)), cost)


def _number(data: dict, name: str, default: float, source: str, prefix: str) -> float:
    value = data.get(name, default)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < math.inf
    _check(ok, source, prefix + name, "must be a finite number >= 0", value)
    return float(value)


def _reject_unknown(data: dict, known: Sequence[str], source: str, prefix: str) -> None:
    for key in data:
        if key not in known and not key.startswith("_"):
            raise MorionError(f"{source}: unknown field {prefix}{key} (known: {', '.join(known)})")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check(ok: Any, source: str, field: str, requirement: str, value: Any) -> None:
    if not ok:
        raise MorionError(f"{source}: {field} {requirement}, got {json.dumps(value)}")
