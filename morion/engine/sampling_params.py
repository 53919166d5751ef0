"""Per-request sampling parameters, validated once at the edge."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from morion.engine.grammar import CompiledGrammar
from morion.errors import InvalidRequestError

_MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed accepts [0, 2**64)
MAX_CACHE_SALT_CHARS = 256  # a tenant's or a test's label; anything longer is a client bug
# Temperatures below this sample greedily (vLLM's bound too): dividing logits by 1e-300 underflows the fp32
# temperature to 0, and 0 / 0 makes the whole distribution NaN.
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens.

    `top_k == 0` turns top-k off (and a top_k above the vocabulary keeps all of it); a temperature below
    `GREEDY_TEMPERATURE` is greedy. `logprobs` is the number of top logprobs returned per generated token
    (0 returns only the chosen token's logprob; None returns none). `stop` and `stop_token_ids` accept any
    sequence (a lone string is one stop string) and are stored as tuples. `grammar` constrains the output
    (compile it with `morion.engine.grammar.GrammarCompilerCache`). `logit_bias` adds (token id, bias)
    pairs to the logits before sampling (OpenAI's, biases in [-100, 100]). `prompt_logprobs` returns, for
    every prompt token after the first, its logprob and that many top alternatives (0: its own only); such
    a request computes its whole prompt (no prefix-cache hit: a cached prefix has no logits).
    `cache_salt` (vLLM's) picks nothing: it keys the prefix cache, so a request shares cached pages (on
    every tier) only with requests of the same salt; None shares with every unsalted request.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    grammar: CompiledGrammar | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    prompt_logprobs: int | None = None
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        object.__setattr__(self, "stop", _as_tuple("stop", stop))
        object.__setattr__(self, "stop_token_ids", _as_tuple("stop_token_ids", self.stop_token_ids))

        _check_int("max_tokens", self.max_tokens, low=1)
        _check_float("temperature", self.temperature, ">= 0", lambda v: v >= 0)
        _check_float("top_p", self.top_p, "in (0, 1]", lambda v: 0 < v <= 1)
        _check_int("top_k", self.top_k, low=0)
        _check_float("min_p", self.min_p, "in [0, 1]", lambda v: 0 <= v <= 1)
        _check_float("repetition_penalty", self.repetition_penalty, "> 0", lambda v: v > 0)
        _check_float("presence_penalty", self.presence_penalty, "in [-2, 2]", lambda v: -2 <= v <= 2)
        _check_float("frequency_penalty", self.frequency_penalty, "in [-2, 2]", lambda v: -2 <= v <= 2)
        if self.seed is not None:
            _check_int("seed", self.seed, low=0, high=_MAX_SEED)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequestError(f"stop must hold non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids entry", t, low=0)
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0)
        object.__setattr__(self, "logit_bias", _as_tuple("logit_bias", self.logit_bias))
        for entry in self.logit_bias:
            if not (isinstance(entry, tuple) and len(entry) == 2):
                raise InvalidRequestError(f"logit_bias entries must be (token id, bias) pairs, got {entry!r}")
            _check_int("logit_bias token id", entry[0], low=0)
            _check_float("logit_bias value", entry[1], "in [-100, 100]", lambda v: -100 <= v <= 100)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, low=0)
        if self.cache_salt is not None and not (
            isinstance(self.cache_salt, str) and 0 < len(self.cache_salt) <= MAX_CACHE_SALT_CHARS
        ):
            raise InvalidRequestError(
                f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters, "
                f"got {_short(self.cache_salt)}"
            )
        if self.grammar is not None and not isinstance(self.grammar, CompiledGrammar):
            raise InvalidRequestError(f"grammar must be a CompiledGrammar, got {type(self.grammar).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _as_tuple(name: str, value: object) -> tuple:
    if isinstance(value, tuple):
        return value
    if isinstance(value, list):
        return tuple(value)
    raise InvalidRequestError(f"{name} must be a list or tuple, got {value!r}")


def _check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    # bool is an int subclass; True as max_tokens is a client bug, not a 1.
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be an integer, got {value!r}")
    if value < low:
        raise InvalidRequestError(f"{name} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise InvalidRequestError(f"{name} must be <= {high}, got {value}")


def _check_float(name: str, value: object, rule: str, ok: Callable[[float], bool]) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or not ok(value):
        raise InvalidRequestError(f"{name} must be {rule}, got {value!r}")
