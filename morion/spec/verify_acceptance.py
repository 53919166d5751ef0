"""Which drafts a verify forward accepts (spec/speculative.py), per row of the verify batch.

Greedy requests keep their drafts while they equal the target's argmax, and a benchmark's forced
acceptance (spec/forced.py) keeps a drawn number of them: both need only the target's argmax, so they
are decided on the device, and nothing is read back before the next step's drafts are launched from
them. A batch with a sampled request is decided on the host: rejection sampling (spec/rejection.py)
keeps the target's distribution.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from morion.runner.host_to_device import ToHost, to_device
from morion.spec.forced import ForcedAcceptance
from morion.spec.rejection import greedy_accept, rejection_sample
from morion.spec.target import SpecRequest

VerifyRow = tuple[SpecRequest, Sequence[int], torch.Tensor | None]  # request, its drafts, their probabilities


class Acceptance(NamedTuple):
    """Per verify row, drafts accepted and the target's own token after them: on the device, and on the
    host where they were decided there (rejection sampling) or, decided on the device, on their way
    (a copy queued right behind the kernels that decide them, ahead of the next drafts' launch)."""

    accepted: torch.Tensor  # [B] int64
    next_tokens: torch.Tensor  # [B] int64
    host: list[tuple[int, int]] | None = None
    to_host: ToHost | None = None

    @classmethod
    def gathered(cls, accepted: torch.Tensor, targets: torch.Tensor) -> Acceptance:
        """`accepted` [B] with the target's argmax `targets` [B, n] at row `accepted` as the next token."""
        next_tokens = targets.gather(1, accepted[:, None]).squeeze(1)
        return cls(accepted, next_tokens, to_host=ToHost(torch.stack([accepted, next_tokens])))

    def on_host(self) -> tuple[list[int], list[int]]:
        """(accepted, next tokens) as host lists (waits for their copy where they were decided on the
        device)."""
        if self.to_host is not None:
            accepted, next_tokens = self.to_host.tolist()
            return accepted, next_tokens
        host = self.host or []
        return [a for a, _ in host], [t for _, t in host]


def padded_draft(request: SpecRequest, tokens: Sequence[int], width: int) -> list[int]:
    """A row's `width` verify inputs after its last token: its drafts, then repeats of the last token (a
    repeat is verified like any draft: accepting one is what the target itself would pick)."""
    return [*tokens, *[request.token_ids[-1]] * (width - len(tokens))]


def decide_acceptance(
    verifying: Sequence[VerifyRow],
    inputs: torch.Tensor,
    logits: torch.Tensor,
    width: int,
    forced: ForcedAcceptance | None,
) -> Acceptance:
    """`inputs` [B, 1 + width] the tokens the verify ran (drafts padded with repeats of the last token),
    `logits` [B, 1 + width, V] fp32 its logits."""
    device = logits.device
    if forced is not None:
        # Drawn per row in batch order, whatever the target says.
        counts = [forced.num_accepted(len(tokens)) for _, tokens, _ in verifying]
        [accepted] = to_device([np.asarray(counts, dtype=np.int64)], device)
        return Acceptance.gathered(accepted, logits.argmax(dim=-1))
    if all(request.params.greedy for request, _, _ in verifying):
        targets = logits.argmax(dim=-1)  # [B, n]
        # Leading drafts equal to the target's argmax (padding included: accepting a repeat of the last
        # token is what the target itself picks), as `greedy_accept` on the host.
        matches = (targets[:, :width] == inputs[:, 1:]).long()
        return Acceptance.gathered(matches.cumprod(dim=1).sum(dim=1), targets)
    targets = logits.argmax(dim=-1).tolist() if any(r.params.greedy for r, _, _ in verifying) else []
    host = []
    for row, (request, tokens, probs) in enumerate(verifying):
        draft = padded_draft(request, tokens, width)
        if request.params.greedy:
            host.append(tuple(greedy_accept(targets[row], draft)))
        else:
            host.append(tuple(_sample_accept(request, logits[row], draft, probs, len(tokens))))
    accepted, next_tokens = to_device(
        [np.asarray([a for a, _ in host], dtype=np.int64), np.asarray([t for _, t in host], dtype=np.int64)],
        device,
    )
    return Acceptance(accepted, next_tokens, host)


def _sample_accept(
    request: SpecRequest, logits: torch.Tensor, draft: list[int], probs: torch.Tensor | None, proposed: int
) -> tuple[int, int]:
    """Rejection sampling of a sampled request's drafts (padding positions: one-hot proposals)."""
    drafted = torch.tensor(draft, device=logits.device)
    if probs is not None and proposed < len(draft):
        # Padding positions are deterministic proposals: one-hot rows.
        padding = torch.nn.functional.one_hot(drafted[proposed:], logits.shape[-1]).to(probs)
        probs = torch.cat([probs.to(logits.device), padding])
    target = request.sampler.distribution(logits)
    return rejection_sample(target, drafted, probs, request.sampler.generator(logits.device))
