"""The native MTP drafter: the model's own multi-token-prediction head proposes the drafts.

Qwen3-Next's MTP head at position p reads (the target's final hidden state h_p, the token at p + 1) and
predicts the token at p + 2 (`Qwen3NextForCausalLM.mtp_forward`). Its decoder layer attends over its own
K/V of earlier positions, kept in the request's pages as one more layer of the "kv" component (the
engine builds the cache spec with `draft_layers=True`), so it is paged, prefix-cached and tiered with
the trunk's K/V.

Per request the drafter keeps the target hidden states it has been shown (`observe`) for positions m..
whose MTP K/V is not computed yet. A request about to be verified has computed c tokens (positions
0..c-1) and sampled token c; `propose`:

1. extend: the head over positions m..c-1 (input token_{p+1}, hidden h_p), writing their MTP K/V; its
   output at c-1 predicts draft d_1 (the token at c + 1);
2. chain: for j = 1..k-1 the head at position c-1+j with input d_j and, as hidden state, its own output
   at the previous position, giving d_{j+1}.

Chained steps write MTP K/V at positions c..c+k-2 from draft tokens; the next extend recomputes those
positions from the verified tokens before any query can read them (queries only see positions <= their
own). Drafts are greedy (argmax of the head's logits: one-hot proposals; sampled requests still keep the
target distribution through rejection sampling). With a FR-Spec token map the head's logits are computed
over the reduced vocabulary only (`spec/frspec.py`).

The head's K/V at a prefix-cache hit's last position may come from another conversation's next token,
and positions whose hidden states the drafter never saw (a cached prefix) keep whatever the pages hold:
both only cost draft quality, never correctness (every draft is verified).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from morion.cache.page_pool import PagePool
from morion.engine.forward_batch import KVScales, PagedAttentionBackend, build_forward_batch
from morion.spec.drafter import DraftRequest, Drafts
from morion.spec.frspec import to_full_ids

_MAX_PENDING = 256  # hidden states kept per request before the MTP K/V of known positions is written


@dataclass
class _Pending:
    """Target hidden states for positions start .. start + len - 1 whose MTP K/V is not written yet."""

    start: int
    rows: list[torch.Tensor] = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.start + sum(r.shape[0] for r in self.rows)


class MtpDrafter:
    name = "mtp"

    def __init__(
        self,
        model: torch.nn.Module,
        pool: PagePool,
        kv_scales: KVScales,
        token_map: torch.Tensor | None = None,
    ) -> None:
        if getattr(model, "mtp", None) is None:
            raise ValueError(
                "speculative mtp needs a model with an MTP head (its checkpoint has no mtp.* weights)"
            )
        self._model = model
        self._pool = pool
        self._kv_scales = kv_scales
        self._pending: dict[str, _Pending] = {}
        device = next(model.parameters()).device
        self._token_map = None if token_map is None else token_map.to(device)
        self._reduced_head: torch.Tensor | None = None
        if token_map is not None:
            head = model.lm_head.weight if model.lm_head is not None else model.model.embed_tokens.weight
            if head.element_size() == 1:  # FP8 head: index in bytes, then dequantize the reduced rows
                raise ValueError("an FR-Spec token map needs a BF16 LM head (not --weight-dtype fp8)")
            self._reduced_head = head.index_select(0, self._token_map)

    def observe(self, request: DraftRequest, start: int, hidden: torch.Tensor) -> None:
        pending = self._pending.get(request.request_id)
        if pending is None or pending.end != start:
            # First sight, or a gap (a prefix-cache hit, a recompute after retraction): start over here.
            pending = self._pending[request.request_id] = _Pending(start)
        # A copy: a CUDA graph's output buffer is overwritten by its next replay.
        pending.rows.append(hidden.detach().clone())
        if pending.end - pending.start > _MAX_PENDING:
            # A long prefill: write the MTP K/V of every position whose next token is known now, so the
            # hidden states kept stay small.
            known = min(pending.end, len(request.token_ids) - 1)
            if known > pending.start:
                self._extend([request], [known])

    def release(self, request_id: str) -> None:
        self._pending.pop(request_id, None)

    def propose(self, requests: Sequence[DraftRequest], width: int) -> Drafts:
        ready = [r for r in requests if self._extendable(r)]
        tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
        if ready and width > 0:
            for request, drafted in zip(ready, self._draft(ready, width), strict=True):
                tokens[request.request_id] = drafted
        return Drafts([tokens[r.request_id] for r in requests], [None] * len(requests))

    def _extendable(self, request: DraftRequest) -> bool:
        """The hidden states of every position up to the last computed one are here."""
        pending = self._pending.get(request.request_id)
        return pending is not None and pending.rows != [] and pending.end == request.num_computed

    def _extend(self, requests: list[DraftRequest], ends: list[int]) -> torch.Tensor:
        """The head over each request's pending positions up to `ends` (exclusive; each position's next
        token known), writing their MTP K/V. Returns its output at each request's last position."""
        model, page_size = self._model, self._pool.page_size
        device = next(model.parameters()).device
        pendings = [self._pending[r.request_id] for r in requests]
        # Index p of a request's shifted tokens is the token at p + 1: the MTP input at position p.
        chunks = [
            (list(r.token_ids[1:]), r.pages, p.start, end - p.start)
            for r, p, end in zip(requests, pendings, ends, strict=True)
        ]
        batch = build_forward_batch(chunks, [None] * len(requests), page_size, device)
        hidden = []
        for pending, end in zip(pendings, ends, strict=True):
            rows = torch.cat(pending.rows)
            hidden.append(rows[: end - pending.start])
            pending.start, pending.rows = end, [rows[end - pending.start :]] if end < pending.end else []
        out = model.mtp_forward(batch.input_ids, batch.positions, torch.cat(hidden), self._backend(batch))
        return out[batch.last_rows]

    @torch.inference_mode()
    def _draft(self, requests: list[DraftRequest], width: int) -> list[list[int]]:
        model, page_size = self._model, self._pool.page_size
        device = next(model.parameters()).device
        last = self._extend(requests, [r.num_computed for r in requests])
        drafts = [[token] for token in self._argmax(last)]
        for j in range(1, width):
            # Draft j at position c - 1 + j: appended to the shifted tokens, it is that position's input.
            chunks = [
                ([*r.token_ids[1:], *d], r.pages, r.num_computed - 1 + j, 1)
                for r, d in zip(requests, drafts, strict=True)
            ]
            batch = build_forward_batch(chunks, [None] * len(requests), page_size, device)
            last = model.mtp_forward(batch.input_ids, batch.positions, last, self._backend(batch))
            for d, token in zip(drafts, self._argmax(last), strict=True):
                d.append(token)
        return drafts

    def _backend(self, batch) -> PagedAttentionBackend:
        return PagedAttentionBackend(self._pool, batch, None, self._kv_scales)

    def _argmax(self, hidden: torch.Tensor) -> list[int]:
        if self._reduced_head is None:
            return self._model.compute_logits(hidden).argmax(dim=-1).tolist()
        reduced = F.linear(hidden, self._reduced_head).argmax(dim=-1)
        return to_full_ids(reduced, self._token_map).tolist()
