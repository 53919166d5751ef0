"""What a speculative drafter is to the engine.

Each decode step with speculation, the engine asks the drafter for up to `width` tokens per running
request that continue its sequence (prompt + outputs so far); one target forward then verifies all of
them (`engine/speculative.py`). A drafter never changes what the target generates: greedy output with
speculation equals output without, and sampled output keeps the target's distribution (rejection
sampling); a drafter only changes how many tokens one target forward yields.

Model-free drafters (n-gram lookup, the synthetic benchmark drafter) see token ids only. The MTP drafter
also reads the target's hidden states, which the engine passes in `DraftRequest.target_hidden`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class DraftRequest:
    """One running request as a drafter sees it.

    `token_ids` is the whole sequence so far (prompt + generated); its last token has been sampled but
    not yet run through the target (the verify forward runs it first, then the drafts).
    `target_hidden` is, for drafters that read it (MTP), the target's last hidden state for the
    sequence's last computed position; None for the others.
    """

    request_id: str
    token_ids: Sequence[int]
    target_hidden: torch.Tensor | None = None


@dataclass(frozen=True)
class Drafts:
    """Per request, the proposed tokens (0 to `width` of them) and, when the drafter sampled them from a
    distribution, that distribution per proposed token ([n, vocab] fp32 probabilities) for rejection
    sampling; None means deterministic proposals (one-hot: accepted with the target's probability)."""

    tokens: list[list[int]]
    probs: list[torch.Tensor | None]


class Drafter(Protocol):
    name: str

    def propose(self, requests: Sequence[DraftRequest], width: int) -> Drafts:
        """Up to `width` tokens per request, in request order."""
        ...

    def release(self, request_id: str) -> None:
        """The request finished or was aborted: drop anything kept for it."""
        ...
