"""What the HTTP front end and the engine process say to each other (pickled over pipes).

This module holds no model code: the front end imports it on its hot path. Every
message the engine sends after `EngineInfo` is one `EngineOutputs` per engine step (or per batch of
inbox messages handled while idle), so the front end wakes once per step, not once per token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from morion.cache.tier_stats import CacheStats
from morion.config import EngineConfig
from morion.engine.outputs import FirstTokenTimes, PromptLogprob, Usage
from morion.engine.sampling_params import SamplingParams
from morion.engine.step_timing import StepTimes
from morion.multimodal.image_decode import PreparedImage
from morion.multimodal.processing import ImageProcessing

# ---------------------------------------------------------------- front end -> engine


class AddRequest(NamedTuple):
    request_id: str
    # Token ids as signed 64-bit machine integers (`array("q")`, or any sequence of ints): pickled as one
    # buffer, where a list pickles id by id (an agent's 33K-token prompt: 1.2 ms through the pipe as a list).
    prompt_token_ids: Sequence[int]
    params: SamplingParams
    images: tuple[PreparedImage, ...] = ()  # whose tokens the prompt holds (models with a vision tower)
    # Whether the front end had more generation requests read and not yet handed over when it sent this
    # one (or more choices of this one follow): an idle engine waits for them briefly (server/arrivals.py).
    more_coming: bool = False


class AbortRequest(NamedTuple):
    request_id: str


class Shutdown(NamedTuple):
    """Abort whatever is still running and exit (the front end has drained what it wanted finished)."""

    reason: str = "shutdown"


class EvictDeviceCache(NamedTuple):
    """Drop the device prefix cache's unused pages and snapshots (`POST /v1/cache/evict_device`): a cached
    conversation is then served from the host or disk tier, or recomputed. Answered by `CacheEvicted`."""

    reply_id: str


InboxMessage = AddRequest | AbortRequest | Shutdown | EvictDeviceCache

# ---------------------------------------------------------------- engine -> front end


class ImageInputs(NamedTuple):
    """How a model with a vision tower takes images: the processor's settings (how the front end resizes
    them, and how many tokens each becomes) and the token id that stands for one image token."""

    processing: ImageProcessing
    image_token_id: int


class EngineInfo(NamedTuple):
    """Sent once, when the model is loaded and the pool sized: the resolved configuration."""

    config: EngineConfig
    model_path: str
    model_type: str
    device: str  # resolved (never "auto")
    dtype: str  # resolved (never "auto")
    context_length: int  # the model's own max_position_embeddings
    vocab_size: int
    max_model_len: int  # min(context, pool tokens, --max-model-len)
    max_model_len_limit: str  # which of those it is: "max_model_len", "context" or "kv_pool"
    num_pages: int  # the whole pool, the CUDA-graph scratch page included
    pool_tokens: int  # the tokens requests can hold (without the scratch page)
    bytes_per_token: int
    pool_bytes: int
    device_name: str = ""  # the GPU's name (torch.cuda.get_device_name), or "cpu"
    images: ImageInputs | None = None  # None: the model takes text only


class EngineFailed(NamedTuple):
    """The engine could not start (bad model, out of memory...); the process exits after sending it."""

    error: str


@dataclass(frozen=True)
class SpecSnapshot:
    """Speculative decoding since the engine started (`SpecStats` of spec/speculative.py), copied per step.

    Index j of the per-position tuples is draft position j + 1 (the first draft of a step is position 1);
    accepted_by_position[j] <= drafted_by_position[j], and the tuples sum to accepted_tokens and
    drafted_tokens. A dataclass, not a NamedTuple, so that /v1/server_info writes it with its field names.
    """

    method: str  # the drafter's name: ngram or mtp (synthetic ones in benchmarks)
    verify_steps: int
    drafted_tokens: int  # proposed by the drafter (padding excluded)
    accepted_tokens: int
    emitted_tokens: int  # accepted drafts + one target token per request and verify step
    drafted_by_position: tuple[int, ...]
    accepted_by_position: tuple[int, ...]
    active_width: int  # the width policy's last answer (0: no drafts at that batch size)
    max_width: int  # the widest the policy may choose
    mean_accepted_length: float  # emitted / (emitted - accepted): tokens a request gains per verify step


class EngineStats(NamedTuple):
    """Load and pool usage after the step: `Engine.load()` (engine/outputs.py's `EngineLoad`, whose invariant
    holds here) and the figures below."""

    running: int
    waiting: int
    pages_free: int
    pages_cached: int
    pages_held: int
    retractions: int
    integrity: str  # "ok", or the failed check's message; checked once the engine is idle for 0.1 s
    # Host memory the caches hold by design (morion/cache/cache_memory.py), measured when last idle.
    cache_memory_bytes: int
    cache: CacheStats  # hits, restores and traffic by tier (a copy)
    cuda_allocated_bytes: int  # torch's CUDA allocations (0 on the CPU)
    spec: SpecSnapshot | None  # None: speculative decoding is off
    step_times: StepTimes  # the engine's steps and its loop, cumulative (engine/step_timing.py)
    # (kind, path) -> forwards so far: graph replays or eager (runner/forward_counts.py)
    forwards: dict[tuple[str, str], int]


class RequestDelta(NamedTuple):
    """What one request gained in one step. The last delta of a request has `finish_reason` and `usage`."""

    request_id: str
    token_ids: list[int]
    text: str  # detokenized by the engine, stop strings already applied
    logprobs: list[float] | None  # one per token in token_ids, when the request asked for logprobs
    top_logprobs: list[list[tuple[int, float]]] | None
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    usage: Usage | None = None
    error: str | None = None  # with finish_reason "error"
    internal: bool = False  # an error of the engine itself (HTTP 500), not of the request (HTTP 400)
    # With params.prompt_logprobs, on the request's first delta with tokens (outputs.py, PromptLogprob).
    prompt_logprobs: list[PromptLogprob | None] | None = None
    stop_reason: str | int | None = None  # on the last delta: the stop string or token id (None: EOS)
    # On the request's first delta with a token: its queue and prefill time in the engine (outputs.py).
    first_token_times: FirstTokenTimes | None = None


class CacheEvicted(NamedTuple):
    """The answer to `EvictDeviceCache`: how many device pages went back to the free list."""

    reply_id: str
    pages: int


class EngineOutputs(NamedTuple):
    deltas: list[RequestDelta]
    stats: EngineStats | None  # None: unchanged enough to skip (sent at most every STATS_PERIOD_S while busy)


OutboxMessage = EngineInfo | EngineFailed | EngineOutputs
