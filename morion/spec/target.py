"""What speculative decoding reads and changes of the engine it runs in, as protocols: `spec/` imports
nothing of `engine/` (the engine imports `spec/`; tests/test_package_layers.py keeps it that way)."""

from __future__ import annotations

from typing import Protocol

import torch


class SpecParams(Protocol):
    """The sampling parameters a verify reads (engine/sampling_params.py's `SamplingParams`)."""

    @property
    def greedy(self) -> bool: ...

    logprobs: int | None
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float


class SpecSampler(Protocol):
    """A request's sampler (engine/sampler.py's `RequestSampler`)."""

    grammar: object | None

    def generator(self, device: torch.device) -> torch.Generator: ...

    def distribution(self, scores: torch.Tensor) -> torch.Tensor: ...


class SpecRequest(Protocol):
    """A running request that decodes (engine/request.py's `Request`): its last sampled token is its one
    uncomputed token. A verify writes K/V at its next positions and, for a model with state, the state
    after each of them into `state_slot` and its `draft_slots`."""

    request_id: str
    params: SpecParams
    sampler: SpecSampler
    pages: list[int]
    num_computed: int
    state_slot: int | None
    draft_slots: list[int]

    @property
    def token_ids(self) -> list[int]: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def is_finished(self) -> bool: ...


class VerifyRoom(Protocol):
    """Where a verify's pages and draft state slots come from (engine/scheduler.py's `Scheduler`)."""

    def reserve_for_verify(self, request: SpecRequest, num_tokens: int, num_draft_slots: int) -> bool: ...
