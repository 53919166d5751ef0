"""What a speculative drafter is to the engine.

Each decode step with speculation, the engine asks the drafter for up to `width` tokens per running
request that continue its sequence (prompt + outputs so far); one target forward then verifies all of
them (`spec/speculative.py`). A drafter never changes what the target generates: greedy output with
speculation equals output without, and sampled output keeps the target's distribution (rejection
sampling); a drafter only changes how many tokens one target forward yields.

Model-free drafters (n-gram lookup, the synthetic benchmark drafter) see token ids only. The MTP drafter
(`spec/mtp.py`) also reads the target's hidden states, which the engine reports to it after every target
forward (`HiddenStateDrafter.observe`), and writes its own K/V into the request's pages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, overload, runtime_checkable

import torch


@dataclass(frozen=True)
class DraftRequest:
    """One running request as a drafter sees it.

    `token_ids` is the whole sequence so far (prompt + generated); its last token has been sampled but
    not yet run through the target (the verify forward runs it first, then the drafts).
    """

    request_id: str
    token_ids: Sequence[int]
    pages: Sequence[int] = ()  # the request's pages, already covering the drafts' positions
    num_computed: int = 0  # tokens whose K/V (and state) are computed: all but the last one


class PendingTokens(Sequence[int]):
    """Drafts made on the device whose values are still on their way to the host. Their count is known
    and their values are on the device (`on_device`, [count] int64), so the verify forward can be built
    and launched before the host has them: the engine writes `on_device` into the verify's input ids on
    the device, and reads the values (which waits for their copy) only after the verify, to accept them.
    A prefix slice stays pending; any other read waits for the values."""

    def __init__(self, on_device: torch.Tensor, read: Callable[[], list[int]]) -> None:
        self.on_device = on_device
        self._read = read

    def __len__(self) -> int:
        return self.on_device.shape[0]

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[int]: ...
    def __getitem__(self, index: int | slice) -> int | Sequence[int]:
        if isinstance(index, slice) and index.start in (None, 0) and index.step in (None, 1):
            stop = len(self) if index.stop is None else index.stop
            if stop >= 0:
                return PendingTokens(self.on_device[:stop], lambda: self._read()[:stop])
        return self._read()[index]


@dataclass(frozen=True)
class Drafts:
    """Per request, the proposed tokens (0 to `width` of them; a `PendingTokens` while still on their way
    from the device) and, when the drafter sampled them from a distribution, that distribution per
    proposed token ([n, vocab] fp32 probabilities) for rejection sampling; None means deterministic
    proposals (one-hot: accepted with the target's probability)."""

    tokens: list[Sequence[int]]
    probs: list[torch.Tensor | None]


class Drafter(Protocol):
    name: str

    def propose(self, requests: Sequence[DraftRequest], width: int) -> Drafts:
        """Up to `width` tokens per request, in request order."""
        ...

    def release(self, request_id: str) -> None:
        """The request finished or was aborted: drop anything kept for it."""
        ...


@runtime_checkable
class HiddenStateDrafter(Drafter, Protocol):
    """A drafter that reads the target's hidden states (MTP): the engine reports them after every
    target forward that computed tokens of a running request."""

    def observe(self, request: DraftRequest, start: int, hidden: torch.Tensor) -> None:
        """`hidden` [n, W]: the target's hidden states as its forward returns them (W = `hidden_width`)
        of `request` at positions start .. start + n - 1 (valid only during the call: a CUDA graph's
        output buffer is overwritten by its next replay)."""
        ...


@dataclass(frozen=True)
class VerifyResult:
    """The rows of a verify step of n - 1 drafts that draft right after it, all on the device: `inputs`
    [B, n] the tokens it ran (last sampled, then the drafts), `hidden` [B, n, H] the target's final
    hidden states there, `accepted` [B] drafts kept, `next_tokens` [B] the target's own token after
    them, `start_positions` [B] each request's computed tokens before the step, `page_table` [B, pages]
    (int32) its pages, covering the next step's drafts."""

    inputs: torch.Tensor
    hidden: torch.Tensor
    accepted: torch.Tensor
    next_tokens: torch.Tensor
    start_positions: torch.Tensor
    page_table: torch.Tensor


@runtime_checkable
class VerifyAwareDrafter(HiddenStateDrafter, Protocol):
    """A drafter that makes the next step's drafts right after a verify step, from its hidden states
    (the MTP head: one fixed-shape draft per batch and width)."""

    def after_verify(self, verified: VerifyResult) -> object:
        """Launches the drafts of `verified`'s rows, reading nothing of the verify on the host (the
        engine has not yet learned what it accepted); returns a handle of them for `keep_drafts`."""
        ...

    def keep_drafts(self, handle: object, kept: Sequence[tuple[str, int, int]]) -> None:
        """After the commit: (request id, row in the handle, tokens computed now) of each request still
        running; their drafts are proposed at their next step. The other rows' are dropped."""
        ...
