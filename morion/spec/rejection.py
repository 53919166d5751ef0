"""Verifying one request's drafts: how many the target accepts and which token it adds.

Position j = 0..k of the verify forward predicts the token after the committed sequence plus drafts
0..j-1: row j of `target_argmax` / `target_probs` belongs to position j, and draft j is judged by row j.
Row k is the bonus position, used when all k drafts are accepted. A step therefore yields
`num_accepted + 1` tokens: the accepted drafts, then `next_token`.

Greedy: drafts are accepted while they equal the target's argmax; the next token is the target's argmax
at the first mismatch (or the bonus). Output is exactly the target's greedy output.

Sampling (Leviathan et al. 2023, Chen et al. 2023): draft x_j, drawn from q_j, is accepted with
probability min(1, p_j(x_j) / q_j(x_j)); at the first rejection the next token is drawn from
normalize(max(p_j - q_j, 0)), and after k acceptances from p_k. Each emitted token is then distributed
as p_j exactly, whatever q is. A deterministic drafter's q_j is one-hot at x_j: accept with probability
p_j(x_j), else draw from p_j with x_j removed. `p` is the processed sampling distribution
(`engine.sampler.sampling_probs`: temperature, top-k/p, min-p applied), `q` the drafter's over the full
vocabulary (an FR-Spec drafter's expanded with `frspec.expand_probs`).

`greedy_accept` takes host ints (the engine reads a verify step's argmax for the whole batch at once);
`rejection_sample` works on the tensors' device and synchronises with the host once, to return ints.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch


class Acceptance(NamedTuple):
    num_accepted: int  # leading drafts accepted, 0..k
    next_token: int  # the target's token after them (correction or bonus)


def greedy_accept(target_argmax: Sequence[int], draft_tokens: Sequence[int]) -> Acceptance:
    """`target_argmax` (k + 1 token ids) and `draft_tokens` (k), on the host."""
    k = len(draft_tokens)
    if len(target_argmax) != k + 1:
        raise ValueError(f"{len(target_argmax)} target rows for {k} drafts; need one more row than drafts")
    num_accepted = next((j for j in range(k) if target_argmax[j] != draft_tokens[j]), k)
    return Acceptance(num_accepted, target_argmax[num_accepted])


def rejection_sample(
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    generator: torch.Generator,
) -> Acceptance:
    """`target_probs` [k+1, V] fp32, `draft_tokens` [k], `draft_probs` [k, V] or None (one-hot drafts).

    Draws k uniforms and V exponentials from `generator` (on the tensors' device): the generator moves
    on by the same amount whatever is accepted.
    """
    k = _check_width(target_probs.shape[0], draft_tokens)
    if draft_probs is not None and draft_probs.shape != (k, target_probs.shape[1]):
        raise ValueError(f"draft_probs shape {tuple(draft_probs.shape)} is not {(k, target_probs.shape[1])}")
    drafts = draft_tokens.long().unsqueeze(1)
    p_draft = target_probs[:k].gather(1, drafts).squeeze(1)
    q_draft = torch.ones_like(p_draft) if draft_probs is None else draft_probs.gather(1, drafts).squeeze(1)
    uniforms = torch.rand(k, generator=generator, device=target_probs.device, dtype=target_probs.dtype)
    # u < p/q without dividing: q = 0 (a draft its drafter gave no mass) is then accepted iff p > 0.
    num_accepted = _first_true(uniforms * q_draft >= p_draft)

    # Rows 0..k-1: the residual after a rejection there; row k: the bonus distribution p_k.
    if draft_probs is None:
        residuals = target_probs[:k].scatter(1, drafts, 0.0)
    else:
        residuals = (target_probs[:k] - draft_probs).clamp_(min=0.0)
    rows = torch.cat([residuals, target_probs[k:]])
    row = rows.index_select(0, num_accepted).squeeze(0)
    # A rejection needs p_j(x) < q_j(x) somewhere, so max(p_j - q_j, 0) has mass; only rounding can
    # leave none, and then p_j itself is the right answer (p_j ~ q_j).
    fallback = target_probs.index_select(0, num_accepted).squeeze(0)
    row = torch.where(row.sum() > 0, row, fallback)
    next_token = _draw(row, generator).unsqueeze(0)
    return Acceptance(*torch.cat([num_accepted, next_token]).tolist())


def _check_width(rows: int, draft_tokens: torch.Tensor) -> int:
    k = draft_tokens.shape[0]
    if draft_tokens.dim() != 1 or rows != k + 1:
        raise ValueError(
            f"{rows} target rows for {tuple(draft_tokens.shape)} drafts; need one more row than drafts"
        )
    return k


def _first_true(flags: torch.Tensor) -> torch.Tensor:
    """Index of the first True in a 1-D bool tensor, or its length when there is none, as a [1] tensor."""
    padded = torch.cat([flags, flags.new_ones(1)])
    return padded.int().argmax().unsqueeze(0)  # argmax returns the first maximal index


def _draw(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One index with probability probs / sum(probs): the exponential race of `engine.sampler._draw`."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)  # exponential_ may return 0; 0/0 would be NaN
    return (probs / noise).argmax()
