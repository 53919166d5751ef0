"""What the engine reports: per-step deltas for streaming, and the finished request."""

from __future__ import annotations

from typing import NamedTuple


class Usage(NamedTuple):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens whose K/V came from the prefix cache
    image_tokens: int = 0  # prompt tokens that are images' tokens


class PromptLogprob(NamedTuple):
    logprob: float  # of the prompt token, given the tokens before it
    rank: int  # 1 + how many tokens were more likely there
    top: list[tuple[int, float]]  # the most likely tokens there, highest first


class RequestOutput(NamedTuple):
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None  # "stop", "length", "abort", or "error"
    usage: Usage
    logprobs: list[float] | None = None  # per generated token, when requested
    top_logprobs: list[list[tuple[int, float]]] | None = None
    error: str | None = None  # set with finish_reason "error"
    prompt_logprobs: list[PromptLogprob | None] | None = None  # with params.prompt_logprobs (request.py)
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it (None: EOS)


class FirstTokenTimes(NamedTuple):
    """Where a request's time to its first token went inside the engine (perf_counter seconds):
    `queued_s` from `Engine.add_request` to its first admission (behind other requests, or waiting for
    pages or a disk prefetch), `prefill_s` from there to the step that sampled its first token (its
    prompt's forwards, with whatever else those steps ran). `added_at`: when `Engine.add_request` was
    called (perf_counter seconds: CLOCK_MONOTONIC on Linux, one clock for every process of the machine,
    so the server's front end places the request's arrival in the engine on its own timeline).

    Of `prefill_s`, the thread that steps the engine spent `prefill_on_cpu_s` on a CPU and
    `prefill_runqueue_s` runnable but waiting for one (engine/thread_times.py; None off Linux); the rest
    it was off a CPU (the GIL, a lock, a wait for the GPU). On a GPU a host-bound prefill is on a CPU for
    nearly all of it; another thread of the process holding the GIL shows as time off it."""

    queued_s: float
    prefill_s: float
    added_at: float
    prefill_on_cpu_s: float | None = None
    prefill_runqueue_s: float | None = None


class StepOutput(NamedTuple):
    """What one request gained in one step: everything a client is sent for it (the server's deltas are
    made of these alone)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    final: RequestOutput | None  # set once finished: finish reason, usage, the whole answer
    # With params.logprobs: one per new token (empty for an output that adds none); None otherwise.
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # With params.prompt_logprobs: on the request's first output only.
    prompt_logprobs: list[PromptLogprob | None] | None = None
    # On the request's first output with a token only.
    first_token_times: FirstTokenTimes | None = None


class EngineLoad(NamedTuple):
    """Requests and pages at one moment (`Engine.load`). Invariant: pages_free + pages_cached + pages_held
    == the pool's pages, less the runner's scratch page; pages_held are owned by running requests (not
    yet in the prefix cache)."""

    running: int
    waiting: int
    pages_free: int
    pages_cached: int
    pages_held: int
    retractions: int  # since the engine started


def internal_error(request_id: str) -> str:
    """What a client is told about an unexpected error on its request: no exception text (it may show
    paths, shapes or values of other requests), only where the operator finds the traceback."""
    return f"an internal error; the server log has its traceback (request {request_id})"
