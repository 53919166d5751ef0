"""The MTP drafter's share of a tensor-parallel engine's seam (parallel/step_mirror.py): its forwards.

The MTP head is split like a layer, so its forwards (the extend over observed positions, the chained draft
steps, the after-verify draft) all-reduce, and its draft logits are gathered over the vocabulary: every
rank must run them, in rank 0's order. Each follower therefore holds an `MtpDrafter` over its own shard
and pool and makes it the same calls as rank 0's speculative decoding makes (spec/speculative.py):

- `observe`: the rows of the latest target forward (the follower's own: the hidden states after the
  final norm are the same on every rank, all-reduced); a verify's rows kept for a request without room
  for the next drafts (copied, as on rank 0, before the draft may reuse their memory);
- `propose`: the same requests, so the follower's drafter makes the same drafts; those still on the
  device (made right after the last verify) are written into the next verify's input ids on each rank,
  as rank 0 writes its own (the follower's are equal: the same logits, gathered, give the same argmax);
- the after-verify draft: from the follower's own verify (its inputs and hidden states) and the accepted
  counts and target tokens that rank 0 decided (rejection sampling and forced acceptance run on rank 0
  only), which rank 0 broadcasts on the device;
- `keep_drafts` and `release`.

A request's tokens reach a follower once: each message carries the tokens appended since the last one
(a request's token ids only grow), with the request's pages and computed count. The drafter flushes the
queue before each of its own collectives (`MtpDrafter.flush_mirror`): only then do the followers need
the calls.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from morion.parallel.step_mirror import StepMirror
from morion.runner.forward_batch import ForwardBatch
from morion.runner.host_to_device import to_device
from morion.spec.drafter import DraftRequest, PendingTokens, VerifyResult
from morion.spec.mtp import MtpDrafter

# (request id, index of the first new token, the new tokens, pages, computed tokens)
SentRequest = tuple[str, int, list[int], list[int], int]


class DraftMirror:
    """Rank 0's half: sends its speculative decoding's drafter calls to the followers."""

    def __init__(self, mirror: StepMirror) -> None:
        self._mirror = mirror
        self._sent: dict[str, int] = {}  # request id -> its tokens the followers have

    def observe(self, request: DraftRequest, start: int, rows: slice) -> None:
        """`rows` of the latest target forward."""
        self._mirror.send("spec_observe", self._request(request), start, rows.start, rows.stop)

    def observe_verified(self, request: DraftRequest, start: int, row: int, count: int) -> None:
        """The first `count` positions of verify row `row`, kept for a request without drafts launched."""
        self._mirror.send("spec_observe_verified", self._request(request), start, row, count)

    def propose(self, requests: Sequence[DraftRequest], width: int) -> None:
        self._mirror.send("spec_propose", [self._request(r) for r in requests], width)

    def launch(
        self,
        verified: int,
        rows: list[int] | None = None,
        starts: np.ndarray | None = None,
        page_table: np.ndarray | None = None,
        accepted: torch.Tensor | None = None,
        next_tokens: torch.Tensor | None = None,
    ) -> None:
        """After a verify of `verified` rows: the after-verify draft of verify rows `rows`, at `starts`
        over `page_table`, from their accepted counts and target tokens (on the device); without `rows`,
        no row drafts (each keeps its hidden states for `observe_verified`)."""
        if rows is None or accepted is None or next_tokens is None:
            self._mirror.send("spec_launch", verified, [], None, None)
        else:
            decided = torch.stack((accepted, next_tokens))
            self._mirror.broadcast(decided, "spec_launch", verified, rows, starts, page_table)

    def keep_drafts(self, kept: list[tuple[str, int, int]]) -> None:
        self._mirror.send("spec_keep", kept)

    def release(self, request_id: str) -> None:
        if self._sent.pop(request_id, None) is not None:
            self._mirror.send("spec_release", request_id)

    def _request(self, request: DraftRequest) -> SentRequest:
        sent = self._sent.get(request.request_id, 0)
        tokens = request.token_ids
        self._sent[request.request_id] = len(tokens)
        return request.request_id, sent, list(tokens[sent:]), list(request.pages), request.num_computed


class DraftFollower:
    """A follower's half: the same calls to its own MTP drafter, on its own forwards' hidden states."""

    def __init__(
        self, drafter: MtpDrafter, device: torch.device, broadcast: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        self._drafter = drafter
        self._device = device
        self._broadcast = broadcast  # TensorParallel.broadcast_: receives rank 0's tensor into its argument
        self._tokens: dict[str, list[int]] = {}  # request id -> its token ids so far
        self._proposed: list[Sequence[int]] = []  # the latest proposal's drafts, per verify row
        self._inputs: torch.Tensor | None = None  # the latest verify's input ids [B, n]
        self._handle: object | None = None  # the latest after-verify draft
        self._waiting: dict[int, torch.Tensor] = {}  # verify row -> its hidden states, no drafts launched

    def before_verify(self, batch: ForwardBatch) -> None:
        """Writes the drafts still on the device into the verify's input ids (rank 0's placeholders)."""
        proposed, self._proposed = self._proposed, []
        if not proposed:
            self._inputs = None
            return
        inputs = batch.input_ids.view(len(proposed), -1)
        for row, tokens in enumerate(proposed):
            if isinstance(tokens, PendingTokens):
                inputs[row, 1 : 1 + len(tokens)].copy_(tokens.on_device)
        self._inputs = inputs

    def apply(self, name: str, args: tuple, hidden: torch.Tensor | None) -> None:
        """Rank 0's call `name`; `hidden`: the latest target forward's hidden states."""
        drafter = self._drafter
        if name == "spec_observe":
            request, start, first, stop = args
            drafter.observe(self._request(request), start, hidden[first:stop])
        elif name == "spec_observe_verified":
            request, start, row, count = args
            drafter.observe(self._request(request), start, self._waiting[row][:count])
        elif name == "spec_propose":
            requests, width = args
            drafts = drafter.propose([self._request(r) for r in requests], width)
            self._proposed = [tokens[:width] for tokens in drafts.tokens if tokens]
        elif name == "spec_launch":
            self._launch(hidden, *args)
        elif name == "spec_keep":
            (kept,) = args
            drafter.keep_drafts(self._handle, kept)
            self._handle, self._waiting = None, {}
        elif name == "spec_release":
            (request_id,) = args
            self._tokens.pop(request_id, None)
            drafter.release(request_id)
        else:
            raise RuntimeError(f"unknown operation {name!r} from rank 0")

    def _launch(
        self,
        hidden: torch.Tensor,
        verified: int,
        rows: list[int],
        starts: np.ndarray | None,
        page_table: np.ndarray | None,
    ) -> None:
        """As rank 0's `SpeculativeDecoding._launch_drafts`, from this rank's verify."""
        assert self._inputs is not None, "an after-verify draft without a verify"
        inputs, hidden = self._inputs, hidden.view(verified, self._inputs.shape[1], -1)
        waiting = [row for row in range(verified) if row not in rows]
        self._waiting = dict(zip(waiting, hidden[waiting], strict=True)) if waiting else {}
        self._handle = None
        if not rows or starts is None or page_table is None:
            return
        decided = torch.empty(2, len(rows), dtype=torch.long, device=self._device)
        self._broadcast(decided)
        index, starts_on_device, table = to_device(
            [np.asarray(rows, dtype=np.int64), starts, page_table], self._device
        )
        if len(rows) < verified:
            inputs, hidden = inputs.index_select(0, index), hidden.index_select(0, index)
        verify = VerifyResult(inputs, hidden, decided[0], decided[1], starts_on_device, table)
        self._handle = self._drafter.after_verify(verify)

    def _request(self, sent: SentRequest) -> DraftRequest:
        request_id, first, new, pages, computed = sent
        tokens = self._tokens.setdefault(request_id, [])
        assert len(tokens) == first, f"request {request_id}: tokens out of step with rank 0"
        tokens.extend(new)
        return DraftRequest(request_id, tokens, pages, computed)
