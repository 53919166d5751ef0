"""The native MTP drafter: the model's own multi-token-prediction head proposes the drafts.

The MTP head at position p reads (the target's hidden state h_p, the token at p + 1) and predicts the
token at p + 2 (`mtp_forward`). h_p is what the target's `forward` returns there: Qwen3-Next's
final-normed hidden state [H], Qwen3.8-Flash-Next's pre-mixer hyper-connection streams [n * H]
(`model.hidden_width` wide). The head's output is of the same kind (its chained steps read it as their
h) and its draft logits are `lm_logits(mtp_head_input(output))` (Qwen3-Next: the output is already
normed; Qwen3.8-Flash-Next: the head's own mixer first). Its decoder layers attend over their own K/V of
earlier positions (Qwen3.8-Flash-Next's QSA layers also over their raw index keys and block keys), kept
in the request's pages as further layers of the trunk's token components (the engine builds the cache
spec with `draft_layers=True`), so they are paged, prefix-cached and tiered with the trunk's.

Per request the drafter keeps the target hidden states it has been shown (`observe`) for positions m..
whose MTP K/V is not computed yet. A request about to be verified has computed c tokens (positions
0..c-1) and sampled token c; `propose`:

1. extend: the head over positions m..c-1 (input token_{p+1}, hidden h_p), writing their MTP K/V; its
   output at c-1 predicts draft d_1 (the token at c + 1). A prefill chunk is extended as soon as it is
   observed, up to its last position whose next token is known, so the pages the engine then hands to
   the prefix cache (and backs up to the host tier) hold the head's layers too;
2. chain: for j = 1..k-1 the head at position c-1+j with input d_j and, as hidden state, its own output
   at the previous position, giving d_{j+1}.

Chained steps write MTP K/V (and QSA side caches: a block key is written when its block's last token is)
at positions c..c+k-2 from draft tokens; the next extend recomputes those positions from the verified
tokens before any query can read them (queries only see positions, and complete blocks, <= their own).
Drafts are greedy (argmax of the head's logits: one-hot proposals; sampled requests still keep the
target distribution through rejection sampling). With a FR-Spec token map the head's logits are computed
over the reduced vocabulary only (`spec/frspec.py`).

The head's K/V at a prefix-cache hit's last position may come from another conversation's next token,
and positions whose hidden states the drafter never saw (a cached prefix) keep whatever the pages hold:
both only cost draft quality, never correctness (every draft is verified).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

import numpy as np
import torch

from morion.cache.page_pool import PagePool
from morion.layers.linear_fp8 import Fp8Linear
from morion.ops.fp8 import FP8_DTYPE
from morion.runner.backend import KVScales, PagedAttentionBackend
from morion.runner.capture_failure import report_capture_failure
from morion.runner.cuda_graph import DecodeGraphRunner
from morion.runner.forward_batch import ForwardBatch, build_forward_batch, page_table_array
from morion.runner.host_to_device import ToHost, to_device
from morion.spec.drafter import DraftRequest, Drafts, PendingTokens, VerifyResult
from morion.spec.frspec import to_full_ids
from morion.spec.mtp_graph import MtpDraftGraphs


def _fixed_batch(
    tokens: torch.Tensor, positions: torch.Tensor, page_table: torch.Tensor, page_size: int
) -> ForwardBatch:
    """The MTP head's batch for [B, n] tokens at [B, n] consecutive positions, its K/V slots looked up in
    `page_table` on the device (no host work that depends on the values)."""
    num, n = tokens.shape
    slots = page_table.gather(1, positions // page_size) * page_size + positions % page_size
    return ForwardBatch(
        input_ids=tokens.flatten(),
        positions=positions.flatten(),
        out_slots=slots.flatten(),
        page_table=page_table.int(),
        cu_seqlens_q=torch.arange(num + 1, dtype=torch.int32, device=tokens.device) * n,
        seq_lens=(positions[:, -1] + 1).int(),
        state_indices=None,
        max_query_len=n,
        query_ranges=[(b * n, n) for b in range(num)],
        last_rows=[b * n + n - 1 for b in range(num)],
    )


class _UniformBackend(PagedAttentionBackend):
    """The after-verify draft's backend: every sequence has the same n new tokens at consecutive positions
    (`uniform_queries`), so layers with a static path for such steps take it (QSA, layers/qsa_attention.py:
    no host syncs, as a CUDA graph needs), as in the verify forward."""

    uniform_queries = True


_MAX_PENDING = 256  # hidden states kept per request before the MTP K/V of known positions is written


@dataclass
class _Pending:
    """Target hidden states for positions start .. start + len - 1 whose MTP K/V is not written yet, and
    the head's output at start - 1 when an extend wrote it (where a chain starts once no row waits)."""

    start: int
    rows: list[torch.Tensor] = field(default_factory=list)
    last: torch.Tensor | None = None

    @property
    def end(self) -> int:
        return self.start + sum(r.shape[0] for r in self.rows)


class _HostDrafts:
    """One after-verify draft's tokens [B, width], kept on the device and on their way to the host. The
    copy to the host is queued behind the draft forward and waited for only after the next verify, which
    reads the device copy (`PendingTokens`), so the host builds and launches that verify while the draft
    forward runs. Both copies are the drafter's own: a graph's output buffer is overwritten by its next
    replay, and by any graph that shares its memory pool."""

    def __init__(self, drafted: torch.Tensor) -> None:
        self._device = drafted.clone()
        self._host = ToHost(self._device)

    def row(self, index: int) -> PendingTokens:
        return PendingTokens(self._device[index], lambda: self._host.tolist()[index])


def reduced_head(model: torch.nn.Module, token_map: torch.Tensor) -> torch.nn.Module:
    """The LM head restricted to the FR-Spec vocabulary `token_map` [V'] (rows of the full head, in map
    order): a bias-free linear layer over the same input. An FP8 head (`--weight-dtype fp8`) keeps its
    rows in e4m3 with the same per-tensor scale (selected as bytes: indexing has no float8 kernels), so
    the reduced logits equal the full head's logits at those ids; tied embeddings give a BF16 layer."""
    head = model.lm_head
    if isinstance(head, Fp8Linear):
        reduced = Fp8Linear(head.in_features, token_map.numel())
        reduced.weight = torch.nn.Parameter(
            head.weight.view(torch.uint8).index_select(0, token_map).view(FP8_DTYPE), requires_grad=False
        )
        reduced.weight_scale = head.weight_scale
        return reduced
    weight = head.weight if head is not None else model.model.embed_tokens.weight
    reduced = torch.nn.Linear(weight.shape[1], token_map.numel(), bias=False, device="meta")
    reduced.weight = torch.nn.Parameter(weight.index_select(0, token_map), requires_grad=False)
    return reduced


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
        # Drafts made right after a verify step (after_verify): request -> (its computed tokens then, the
        # step's drafts, its row in them)
        self._ready: dict[str, tuple[int, _HostDrafts, int]] = {}
        self.graphs: dict[int, MtpDraftGraphs] = {}  # per draft width, when captured (`capture_graphs`)
        # Rank 0 of a tensor-parallel engine: sends the follower ranks the calls queued so far before each
        # of the head's forwards, whose collectives theirs must meet (spec/draft_mirror.py).
        self.flush_mirror: Callable[[], None] | None = None
        device = next(model.parameters()).device
        self._token_map = None if token_map is None else token_map.to(device)
        self._reduced_head: torch.nn.Module | None = None
        if token_map is not None:
            self._reduced_head = reduced_head(model, self._token_map)

    def capture_graphs(self, width: int, decode: DecodeGraphRunner, scratch_page: int) -> None:
        """The after-verify draft of this width as CUDA graphs (spec/mtp_graph.py), in the decode graphs'
        memory pool; eager where capture fails. Its hidden-state buffer is as wide as what the model's
        forward returns (`hidden_width`: Qwen3.8-Flash-Next's n pre-mixer streams), in the embeddings'
        dtype (never FP8)."""
        model = self._model
        dtype = model.model.embed_tokens.weight.dtype
        graphs = MtpDraftGraphs(
            self.draft_after_verify, width, decode.max_batch, decode.max_pages, model.hidden_width,
            dtype, scratch_page, self._pool.device,
        )  # fmt: skip
        try:
            graphs.capture(decode.memory_pool)
        except RuntimeError as error:
            report_capture_failure("MTP draft CUDA graph capture FAILED, drafts run eagerly", error)
            return
        self.graphs[width] = graphs

    def observe(self, request: DraftRequest, start: int, hidden: torch.Tensor) -> None:
        pending = self._pending.get(request.request_id)
        if pending is None or pending.end != start:
            # First sight, or a gap (a prefix-cache hit, a recompute after retraction): start over here.
            pending = self._pending[request.request_id] = _Pending(start)
        # A copy: a CUDA graph's output buffer is overwritten by its next replay.
        pending.rows.append(hidden.detach().clone())
        if hidden.shape[0] > 1 or pending.end - pending.start > _MAX_PENDING:
            # A prefill chunk (or many waiting positions): write the head's caches of every position whose
            # next token is known now. The engine hands the chunk's full pages to the prefix cache right
            # after this call, and under write-through backs them up to the host tier then: they must hold
            # the head's layers already. Single decode steps wait for the next proposal (no head forward
            # per step where no drafts are made).
            known = min(pending.end, len(request.token_ids) - 1)
            if known > pending.start:
                self._extend([request], [known])

    def release(self, request_id: str) -> None:
        self._pending.pop(request_id, None)
        self._ready.pop(request_id, None)

    def propose(self, requests: Sequence[DraftRequest], width: int) -> Drafts:
        tokens: dict[str, Sequence[int]] = {r.request_id: [] for r in requests}
        for request in requests:
            made = self._ready.pop(request.request_id, None)
            if made is not None and made[0] == request.num_computed:
                _, drafts, row = made
                tokens[request.request_id] = drafts.row(row)[:width]
        extendable = [r for r in requests if not tokens[r.request_id] and self._extendable(r)]
        if extendable and width > 0:
            for request, drafted in zip(extendable, self._draft(extendable, width), strict=True):
                tokens[request.request_id] = drafted
        return Drafts([tokens[r.request_id] for r in requests], [None] * len(requests))

    @torch.inference_mode()
    def after_verify(self, verified: VerifyResult) -> _HostDrafts:
        """Drafts for the next step, made right after a verify step from its hidden states, in shapes
        fixed by the batch and width alone (so the whole draft replays as one CUDA graph), before the
        host knows what the verify accepted:

        - extend over all n verify positions c0 .. c0 + n - 1 of each request (c0 = its computed
          tokens before the verify), input at row t the token at c0 + t + 1: the draft the verify ran
          at row t + 1, except at row a (the accepted drafts) where it is the target's own token. Rows
          past a write MTP K/V at positions no query reads before the next extend rewrites them;
        - the output at row a (position c - 1, c = c0 + 1 + a) gives draft 1, then the chained steps.
        """
        self._meet_ranks()
        v = verified
        args = (v.inputs, v.hidden, v.accepted, v.next_tokens, v.start_positions)
        width = v.inputs.shape[1] - 1
        graphs = self.graphs.get(width)
        if graphs is not None and graphs.fits(v.page_table):
            drafted = graphs.run(*args, v.page_table)
        else:
            drafted = self.draft_after_verify(*args, v.page_table.long(), width)
        return _HostDrafts(drafted)  # read when proposed: nothing here waits for the draft forward

    def keep_drafts(self, handle: object, kept: Sequence[tuple[str, int, int]]) -> None:
        drafts = cast(_HostDrafts, handle)  # what `after_verify` returned
        for request_id, row, computed in kept:
            self._ready[request_id] = (computed, drafts, row)
            self._pending[request_id] = _Pending(computed)  # MTP K/V written up to c - 1

    def draft_after_verify(
        self,
        inputs: torch.Tensor,
        hidden: torch.Tensor,
        accepted: torch.Tensor,
        next_tokens: torch.Tensor,
        starts: torch.Tensor,
        page_table: torch.Tensor,
        width: int,
    ) -> torch.Tensor:
        """`after_verify`'s computation on device tensors alone (see there): [B, width] draft tokens.
        Shapes depend only on B, n and width, and nothing reads back to the host: a CUDA graph can
        capture it (`spec/mtp_graph.py`)."""
        model, page_size = self._model, self._pool.page_size
        num, n = inputs.shape
        rows = torch.arange(num, device=inputs.device)
        shifted = torch.cat((inputs[:, 1:], next_tokens[:, None]), dim=1)
        shifted[rows, accepted] = next_tokens
        positions = starts[:, None] + torch.arange(n, device=inputs.device)
        batch = _fixed_batch(shifted, positions, page_table, page_size)
        backend = _UniformBackend(self._pool, batch, None, self._kv_scales)
        out = model.mtp_forward(batch.input_ids, batch.positions, hidden.flatten(0, 1), backend)
        return self._chain(out.view(num, n, -1)[rows, accepted], starts + accepted, page_table, width)

    def _chain(
        self, last: torch.Tensor, position: torch.Tensor, page_table: torch.Tensor, width: int
    ) -> torch.Tensor:
        """[B, width] drafts from the head's output `last` [B, hidden_width] at `position` [B] (c - 1): draft
        1 is its argmax, then each chained step runs the head at the next position on the previous draft,
        its hidden state the head's own output at the position before."""
        self._meet_ranks()
        drafts = [self._argmax_device(last)]
        for _ in range(1, width):
            position = position + 1
            batch = _fixed_batch(drafts[-1][:, None], position[:, None], page_table, self._pool.page_size)
            last = self._model.mtp_forward(batch.input_ids, batch.positions, last, self._backend(batch))
            drafts.append(self._argmax_device(last))
        return torch.stack(drafts, dim=1)

    def _extendable(self, request: DraftRequest) -> bool:
        """The hidden states of every position up to the last computed one are here (or their extend
        already ran, its output at the last one kept)."""
        pending = self._pending.get(request.request_id)
        return (
            pending is not None
            and (pending.rows != [] or pending.last is not None)
            and pending.end == request.num_computed
        )

    def _extend(self, requests: list[DraftRequest], ends: list[int]) -> None:
        """The head over each request's pending positions up to `ends` (exclusive; each position's next
        token known; at least one), writing their MTP K/V; keeps its output at each request's last
        position (`_Pending.last`)."""
        self._meet_ranks()
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
        for pending, row in zip(pendings, out[batch.last_rows], strict=True):
            pending.last = row

    @torch.inference_mode()
    def _draft(self, requests: list[DraftRequest], width: int) -> list[list[int]]:
        waiting = [r for r in requests if self._pending[r.request_id].rows]
        if waiting:  # the others' extend ran when their rows were observed
            self._extend(waiting, [r.num_computed for r in waiting])
        last = torch.stack([self._pending[r.request_id].last for r in requests])
        device = last.device
        position = torch.tensor([r.num_computed - 1 for r in requests], device=device)
        [table] = to_device([page_table_array([r.pages for r in requests]).astype(np.int64)], device)
        return self._chain(last, position, table, width).tolist()

    def _meet_ranks(self) -> None:
        if self.flush_mirror is not None:
            self.flush_mirror()

    def _backend(self, batch) -> PagedAttentionBackend:
        return PagedAttentionBackend(self._pool, batch, None, self._kv_scales)

    def _argmax_device(self, hidden: torch.Tensor) -> torch.Tensor:
        """Greedy drafts from the head's output [B, hidden_width]."""
        x = self._model.mtp_head_input(hidden)
        if self._reduced_head is None:
            return self._model.lm_logits(x).argmax(dim=-1)
        return to_full_ids(self._reduced_head(x).argmax(dim=-1), self._token_map)
