"""Speculative decoding: draft, verify in one target forward, accept, roll back.

Per step, the running requests that decode (one uncomputed token: the last sampled one) and are eligible
(no grammar, no penalties: both depend on every token before them, so drafts would need their state
replayed) are handed to `SpeculativeDecoding.verify` instead of the ordinary decode forward:

1. Width: the policy (`spec/policy.py`) picks k for this batch size; the drafter proposes up to k tokens
   per request. With no proposals at all the requests decode normally (CUDA graphs included).
2. Verify: one target forward over n = 1 + k tokens per request (the last sampled token, then its drafts;
   a request with fewer drafts is padded with repeats of its last token, which are verified like any
   draft: accepting one is correct because it is what the target itself would pick). K/V of all n
   positions go to the request's pages; a hybrid model's linear layers keep the state after every
   position in a slot (`HybridBackend.verify_slots`: column 0 the working slot, then the request's
   `draft_slots`).
3. Accept: greedy drafts while they equal the target's argmax; sampled requests by rejection sampling
   (`spec/rejection.py`), which keeps the target's distribution. Greedy (and a benchmark's forced)
   acceptance is computed on the device, and an MTP drafter launches the next step's drafts from it
   before the host has read anything: the device goes from the verify to the drafts without waiting
   for the host's commit.
4. Commit: `verify` returns, per request, the tokens to commit (`VerifiedRow`); the engine commits them
   token by token (engine/engine.py): before token j, `VerifiedRow.use_state_after(j)` makes the state
   after position j the working slot by swapping slot numbers (no copy, no recompute); K/V beyond the
   accepted tokens stay in the pages and are overwritten later (rollback is `num_computed`). Each
   committed token goes through the scheduler's decode bookkeeping (a page boundary keeps its state for
   the prefix cache) and the engine's finish rules, so a stop token inside accepted drafts ends the
   request right there. Then `after_commit` tells the drafter where each request stands.

Greedy output with speculation equals output without it, token for token. Seeded sampling is
reproducible for a given speculation setting, but draws differ from a run without speculation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from morion.runner.forward_batch import build_forward_batch, page_table_array
from morion.runner.host_to_device import to_device
from morion.runner.image_batch import ImageChunk, ImageEncoder
from morion.runner.model_runner import ModelRunner
from morion.runner.profile_ranges import ACCEPTANCE, DRAFT
from morion.spec.draft_mirror import DraftMirror
from morion.spec.drafter import (
    Drafter,
    DraftRequest,
    HiddenStateDrafter,
    PendingTokens,
    VerifyAwareDrafter,
    VerifyResult,
)
from morion.spec.forced import ForcedAcceptance
from morion.spec.mtp import MtpDrafter
from morion.spec.policy import WidthPolicy
from morion.spec.target import SpecRequest, VerifyRoom
from morion.spec.verify_acceptance import Acceptance, VerifyRow, decide_acceptance, padded_draft


@dataclass
class SpecStats:
    """Counters since start (exported as Prometheus counters) and the active width (a gauge)."""

    verify_steps: int = 0
    drafted_tokens: int = 0  # proposed by the drafter (padding excluded)
    accepted_tokens: int = 0
    emitted_tokens: int = 0  # accepted drafts + one target token per request and verify step
    accepted_by_position: list[int] = field(default_factory=list)  # position j: drafts j accepted
    drafted_by_position: list[int] = field(default_factory=list)
    active_width: int = 0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a request gains per verify step (accepted drafts + the target's own token)."""
        requests = self.emitted_tokens - self.accepted_tokens  # one target token per request-step
        return self.emitted_tokens / requests if requests else 0.0

    def count(self, drafted: int, accepted: int, emitted: int) -> None:
        for position in range(drafted):
            if position >= len(self.drafted_by_position):
                self.drafted_by_position.append(0)
                self.accepted_by_position.append(0)
            self.drafted_by_position[position] += 1
            self.accepted_by_position[position] += position < accepted
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        self.emitted_tokens += emitted


class VerifiedRow(NamedTuple):
    """What one request's verify decided: the tokens to commit, in order (its accepted drafts, then the
    target's own token). `logprobs` [n, V]: the log-softmax of the verify's logits at its rows, for a
    request that asked for logprobs (token j's are row j). `state_columns` (models with state): the slot
    holding the state after each verify position, column 0 the working slot."""

    request: SpecRequest
    tokens: list[int]
    logprobs: torch.Tensor | None
    state_columns: list[int] | None
    start: int  # the request's computed tokens before the verify

    def use_state_after(self, j: int) -> None:
        """Before committing token j: the request has computed its last token and the j drafts before
        token j, so its working state becomes the one after them (verify column j), the others its draft
        slots."""
        columns = self.state_columns
        if columns is not None:
            self.request.state_slot = columns[j]
            self.request.draft_slots = columns[:j] + columns[j + 1 :]


class VerifyStep(NamedTuple):
    """One step's speculation: the verified requests' rows (commit each, then call `after_commit`), and
    the requests left to decode normally (no drafts, or no room for them)."""

    rows: list[VerifiedRow]
    plain: list[SpecRequest]
    drafting: _Drafting | None  # the next step's drafts, launched before the commit


class SpeculativeDecoding:
    def __init__(
        self,
        drafter: Drafter,
        policy: WidthPolicy,
        has_state: bool,
        runner: ModelRunner,
        forced: ForcedAcceptance | None = None,
    ) -> None:
        """`forced` (benchmarks only, spec/forced.py) replaces the target's verdict on the drafts."""
        self.drafter = drafter
        self.policy = policy
        self.has_state = has_state
        self.forced = forced
        self.stats = SpecStats()
        self._runner = runner
        # Rank 0 of a tensor-parallel engine with an MTP drafter: the drafter's calls, which the follower
        # ranks make to theirs (spec/draft_mirror.py).
        self.mirror: DraftMirror | None = None
        # Set by the engine for models with a vision tower: verify rows of requests with images take
        # their positions per axis (text after the images: index + the prompt's delta).
        self.image_encoder: ImageEncoder | None = None

    @staticmethod
    def eligible(request: SpecRequest) -> bool:
        params = request.params
        return (
            request.sampler.grammar is None
            and params.repetition_penalty == 1.0
            and params.presence_penalty == 0.0
            and params.frequency_penalty == 0.0
        )

    def capture_graphs(self, page_size: int) -> None:
        """The verify forward of every width the policy may pick as CUDA graphs (after the runner's decode
        graphs, in their memory pool), and an MTP drafter's after-verify draft of that width; eager from
        the first width whose verify capture fails."""
        for width in self.policy.candidate_widths:
            if width + 1 > page_size:
                continue  # padding rows keep their tokens in one scratch page
            if not self._runner.capture_verify_graph(width + 1):
                return
            if isinstance(self.drafter, MtpDrafter):
                self.drafter.capture_graphs(width, self._runner.decode_graphs, self._runner.scratch_pages[0])

    def verify(self, requests: Sequence[SpecRequest], room: VerifyRoom, max_model_len: int) -> VerifyStep:
        """Drafts and verifies for `requests` (each decoding, its last token uncomputed)."""
        width = self.policy.width(len(requests))
        self.stats.active_width = width
        # Positions past the context cannot be verified: the widest verify must fit every request.
        width = min([width, *(max_model_len - r.num_tokens for r in requests)])
        if width <= 0:
            return VerifyStep([], list(requests), None)
        # Room first (an MTP drafter writes its K/V at the draft positions while drafting).
        slots = width if self.has_state else 0
        with_room = [r for r in requests if room.reserve_for_verify(r, 1 + width, slots)]
        plain = [r for r in requests if r not in with_room]
        draft_requests = [_draft_request(r) for r in with_room]
        if self.mirror is not None:
            self.mirror.propose(draft_requests, width)
        with self._runner.ranges.region(DRAFT):
            drafts = self.drafter.propose(draft_requests, width)
        verifying = []
        for request, tokens, probs in zip(with_room, drafts.tokens, drafts.probs, strict=True):
            if tokens:
                verifying.append((request, tokens[:width], probs))  # PendingTokens stay pending
            else:
                plain.append(request)
        if not verifying:
            return VerifyStep([], plain, None)
        widest = max(len(tokens) for _, tokens, _ in verifying)
        rows, drafting, accepted = self._verify(verifying, widest, room)
        self.policy.observe(len(requests), width, accepted)
        return VerifyStep(rows, plain, drafting)

    def observe(self, request: SpecRequest, start: int, hidden: torch.Tensor, rows: slice) -> None:
        """The target computed `request`'s positions from `start` on, their hidden states `hidden[rows]`
        (`hidden`: its forward's output; an MTP drafter keeps them)."""
        if isinstance(self.drafter, HiddenStateDrafter):
            draft_request = _draft_request(request)
            if self.mirror is not None:
                self.mirror.observe(draft_request, start, rows)
            self.drafter.observe(draft_request, start, hidden[rows])

    def _verify(
        self, verifying: list[VerifyRow], width: int, room: VerifyRoom
    ) -> tuple[list[VerifiedRow], _Drafting | None, list[int]]:
        """The verify forward of `verifying` (1 + `width` tokens each) and its acceptance; returns the rows
        to commit, the next step's drafts when launched, and the drafts each row accepted."""
        n = 1 + width
        runner = self._runner
        device = next(runner.model.parameters()).device
        # Drafts still on their way from the device (PendingTokens) run as placeholders in the host-built
        # batch and are written into its input ids on the device: the verify is launched without waiting
        # for them, and the host reads them only after it (below).
        batch = build_forward_batch(
            [
                (
                    [*r.token_ids, *padded_draft(r, [] if isinstance(d, PendingTokens) else d, width)],
                    r.pages,
                    r.num_computed,
                    n,
                )
                for r, d, _ in verifying
            ],
            [r.state_slot for r, _, _ in verifying],
            runner.pool.page_size,
            device,
        )
        input_rows = batch.input_ids.view(len(verifying), n)
        for row, (_, tokens, _) in enumerate(verifying):
            if isinstance(tokens, PendingTokens):
                input_rows[row, 1 : 1 + len(tokens)].copy_(tokens.on_device, non_blocking=True)
        columns = None
        if self.has_state:
            columns = np.asarray([[r.state_slot, *r.draft_slots[:width]] for r, _, _ in verifying], np.int32)
        images = None
        if self.image_encoder is not None:  # positions per axis for requests with images
            images = self.image_encoder.rows([ImageChunk(r, r.num_computed, n) for r, _, _ in verifying])
        forward = runner.verify(batch, columns, images)
        logits = forward.logits.float().view(len(verifying), n, -1)
        hidden = forward.hidden.view(len(verifying), n, -1)
        self.stats.verify_steps += 1
        # Everything the host reads of the verify's outputs is taken before the next step's drafts are
        # launched: the draft graph shares the verify graph's memory pool and overwrites its outputs.
        raw_logprobs = [
            logits[row].log_softmax(dim=-1) if request.params.logprobs is not None else None
            for row, (request, _, _) in enumerate(verifying)
        ]
        with runner.ranges.region(ACCEPTANCE):
            acceptance = decide_acceptance(verifying, input_rows, logits, width, self.forced)
        with runner.ranges.region(DRAFT):
            drafting = self._launch_drafts(verifying, input_rows, hidden, acceptance, width, room)
        accepted_counts, next_tokens = acceptance.on_host()
        rows = []
        for row, (request, tokens, _) in enumerate(verifying):
            accepted, next_token = accepted_counts[row], next_tokens[row]
            emitted = [*padded_draft(request, tokens, width)[:accepted], next_token]
            self.stats.count(len(tokens), min(accepted, len(tokens)), len(emitted))
            columns = [request.state_slot, *request.draft_slots] if self.has_state else None
            rows.append(VerifiedRow(request, emitted, raw_logprobs[row], columns, request.num_computed))
        return rows, drafting, accepted_counts

    def after_commit(self, step: VerifyStep) -> None:
        """Once the engine committed `step`'s rows: the drafter keeps the next drafts it launched for the
        requests still running, or, for those without room for them, the hidden states of the positions
        they committed (the head waits for the next proposal)."""
        drafting = step.drafting
        if drafting is None:
            return
        kept: list[tuple[str, int, int]] = []
        for row, verified in enumerate(step.rows):
            request = verified.request
            if request.is_finished:
                continue
            if row in drafting.draft_rows:
                kept.append((request.request_id, drafting.draft_rows[row], request.num_computed))
            else:
                count = request.num_computed - verified.start
                draft_request = _draft_request(request)
                if self.mirror is not None:
                    self.mirror.observe_verified(draft_request, verified.start, row, count)
                self.drafter.observe(draft_request, verified.start, drafting.waiting_hidden[row][:count])
        if drafting.handle is not None:
            if self.mirror is not None:
                self.mirror.keep_drafts(kept)
            self.drafter.keep_drafts(drafting.handle, kept)

    def _launch_drafts(
        self,
        verifying: list[VerifyRow],
        inputs: torch.Tensor,
        hidden: torch.Tensor,
        acceptance: Acceptance,
        width: int,
        room: VerifyRoom,
    ) -> _Drafting | None:
        """Hands the verify's hidden states to a drafter that reads them, before the commit. A verify-aware
        one (MTP) drafts the next step's tokens right away on the device, for the requests with room for
        them: pages for every token this step may commit and the next verify's, and draft slots. The
        others' hidden rows are copied for `observe` once their committed tokens are known."""
        drafter = self.drafter
        if not isinstance(drafter, HiddenStateDrafter):
            return None
        rows: list[int] = []
        if isinstance(drafter, VerifyAwareDrafter):
            slots = width if self.has_state else 0
            rows = [
                row
                for row, (request, _, _) in enumerate(verifying)
                if room.reserve_for_verify(request, 2 * (1 + width), slots)
            ]
        waiting = [row for row in range(len(verifying)) if row not in rows]
        # Indexing by a list copies: the draft graph may reuse `hidden`'s memory.
        waiting_hidden = dict(zip(waiting, hidden[waiting], strict=True)) if waiting else {}
        handle = None
        if not rows:
            if self.mirror is not None:
                self.mirror.launch(len(verifying))
        else:
            requests = [verifying[row][0] for row in rows]
            host_starts = np.asarray([r.num_computed for r in requests], dtype=np.int64)
            host_table = page_table_array([r.pages for r in requests])
            index, starts, page_table = to_device(
                [np.asarray(rows, dtype=np.int64), host_starts, host_table], hidden.device
            )
            accepted, next_tokens = acceptance.accepted, acceptance.next_tokens
            if len(rows) < len(verifying):  # else every row drafts, in order: no gather needed
                inputs, hidden = inputs.index_select(0, index), hidden.index_select(0, index)
                accepted, next_tokens = accepted.index_select(0, index), next_tokens.index_select(0, index)
            if self.mirror is not None:  # the followers draft from what rank 0 alone accepted
                self.mirror.launch(len(verifying), rows, host_starts, host_table, accepted, next_tokens)
            handle = drafter.after_verify(
                VerifyResult(inputs, hidden, accepted, next_tokens, starts, page_table)
            )
        return _Drafting({row: i for i, row in enumerate(rows)}, handle, waiting_hidden)

    def release(self, request_id: str) -> None:
        if self.mirror is not None:
            self.mirror.release(request_id)
        self.drafter.release(request_id)


class _Drafting(NamedTuple):
    """The next step's drafts launched from a verify step: verify row -> its row in the drafts, and the
    drafter's handle; for the rows without room, copies of their hidden states [n, W]."""

    draft_rows: dict[int, int]
    handle: object | None
    waiting_hidden: dict[int, torch.Tensor]


def _draft_request(request: SpecRequest) -> DraftRequest:
    return DraftRequest(request.request_id, request.token_ids, request.pages, request.num_computed)
