"""Prefill forwards replayed as piecewise CUDA graphs, one captured forward per token bucket (issue #24).

A 1K-token prefill of the 80B model launches ~2,300 kernels, and the GPU idles while Python issues them.
Here every part of the trunk that depends only on the number of tokens replays from graphs, and only the
calls that read the batch's sequence layout run eagerly between them (runner/piecewise_graph.py). A
forward of T tokens replays the smallest bucket R >= T: its T tokens are copied into the static inputs,
rows T..R are padding (token 0 at position 0).

What keeps answers right:
- Padding rows never touch cache memory: the eager calls (the only parts that write K/V or state) run
  with the live batch over its T real rows, so no page or state slot of anyone is written for them.
- The same chunk is computed the same way every time: the bucket is a function of T alone, and whether a
  forward replays at all of its shape alone (`can_run`), so a prompt's chunk (its cut points are its own:
  Scheduler._chunk) replays the same bucket in a cold run and after a restore, and the padding rows
  compute from the same values on every replay (their eager outputs are zeroed). A bucket's GEMMs see R
  rows where an eager forward's see T, so the bits may differ from an eager forward's; never between two
  replays.
- Only prefill forwards replay (a chunk longer than SHORT_CHUNK_TOKENS): decode and short forwards keep
  their batch-invariant kernels, whose tiles a bucket's row count would change.
- Restores still copying in are waited for by the eager calls, layer by layer, as an eager forward's
  backend does: the pieces touch no cache memory.

Capture is at startup (`capture`), largest bucket first, into one memory pool shared by all buckets (one
forward runs at a time, and every value a piece reads was written earlier in the same replay, or is a
static input or bridge outside the pool). Each bucket is warmed up eagerly twice first: Triton compiles
and autotunes at the bucket's shapes, and the bridges are made.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence

import torch

from morion.cache.page_pool import PagePool
from morion.cache.state_slots import StateSlots
from morion.layers.hybrid_backend import SHORT_CHUNK_TOKENS
from morion.runner.backend import KVScales, PagedAttentionBackend
from morion.runner.forward_batch import ForwardBatch, build_forward_batch
from morion.runner.piecewise_graph import (
    AtBreak,
    Bridges,
    CapturedForward,
    CapturePieces,
    EagerOp,
    PieceBackend,
    PieceForward,
    Traced,
    capture_cuda_pieces,
)
from morion.runner.restore_wait import RestoreWaits


class PrefillGraphRunner:
    """Piecewise prefill graphs over `model` for forwards of up to `max(buckets)` tokens (`buckets`:
    distinct, increasing, positive, as EngineConfig checks `prefill_graph_tokens`). The warm-ups write
    K/V into `scratch_page` and state into `scratch_slot` (held by nobody else). `capture_pieces`
    captures a traced forward (None: CUDA graphs; the CPU tests stand in for them)."""

    def __init__(
        self,
        model: torch.nn.Module,
        pool: PagePool,
        state_slots: StateSlots | None,
        kv_scales: KVScales,
        buckets: Sequence[int],
        scratch_page: int,
        scratch_slot: int | None,
        capture_pieces: CapturePieces | None = None,
    ) -> None:
        self._model = model
        self._pool = pool
        self._state_slots = state_slots
        self._kv_scales = kv_scales
        self.buckets = tuple(buckets)
        self._scratch_page = scratch_page
        self._scratch_slot = scratch_slot
        self._capture_pieces = capture_pieces
        rows = self.buckets[-1]
        device = pool.device
        self._input_ids = torch.zeros(rows, dtype=torch.long, device=device)
        self._positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.bridges = Bridges(rows)
        self._captured: dict[int, CapturedForward] = {}
        self.replays = 0  # prefill forwards served from graphs

    def bucket(self, tokens: int) -> int:
        """The bucket a forward of `tokens` tokens replays: the smallest that holds it."""
        return next(b for b in self.buckets if b >= tokens)

    def can_run(self, batch: ForwardBatch) -> bool:
        """A prefill forward (some chunk longer than SHORT_CHUNK_TOKENS) of at most the largest bucket's
        tokens; its shape alone decides, never what else happens in the step."""
        fits = batch.input_ids.shape[0] <= self.buckets[-1]
        return bool(self._captured) and batch.max_query_len > SHORT_CHUNK_TOKENS and fits

    def run(self, batch: ForwardBatch, restore_waits: RestoreWaits | None = None) -> torch.Tensor:
        """The hidden states [T, hidden_width] of `batch` (valid until the next replay): its tokens copied
        into the static inputs, then the bucket's pieces replayed and its eager calls run with the live
        batch's backend (which waits for `restore_waits` where a call touches restored memory)."""
        rows = batch.input_ids.shape[0]
        bucket = self.bucket(rows)
        self._input_ids[:rows].copy_(batch.input_ids)
        self._positions[:rows].copy_(batch.positions)
        if rows < bucket:  # rows a longer forward left behind are padding now
            self._input_ids[rows:bucket].zero_()
            self._positions[rows:bucket].zero_()
        backend = PagedAttentionBackend(
            self._pool, batch, self._state_slots, self._kv_scales, restore_waits=restore_waits
        )
        hidden = self._captured[bucket].replay(backend, rows, bucket)
        self.replays += 1
        return hidden

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture every bucket, largest first, with one line on stderr at the end."""
        started = time.perf_counter()
        device = self._pool.device
        capture_pieces = self._capture_pieces
        if capture_pieces is None:
            free_before, _ = torch.cuda.mem_get_info(device)
            memory_pool = torch.cuda.graph_pool_handle()

            def capture_pieces(forward: PieceForward) -> CapturedForward:
                return capture_cuda_pieces(forward, memory_pool, device)

        for bucket in reversed(self.buckets):
            forward = self._traced_forward(bucket)
            warm_up = self._warm_up(bucket)
            forward(warm_up)  # compiles and autotunes every kernel at these shapes; capture must not
            forward(warm_up)
            self._captured[bucket] = capture_pieces(forward)
        calls = len(self._captured[self.buckets[-1]].calls)
        used = ""
        if self._capture_pieces is None:
            torch.cuda.synchronize(device)
            free_after, _ = torch.cuda.mem_get_info(device)
            used = f", {(free_before - free_after) / 2**30:.2f} GiB"
        print(
            f"morion: captured piecewise prefill CUDA graphs for {len(self.buckets)} token buckets "
            f"{list(self.buckets)}, {calls + 1} pieces and {calls} eager calls each, in "
            f"{time.perf_counter() - started:.1f} s (bridges {self.bridges.num_bytes / 2**30:.2f} GiB{used})",
            file=sys.stderr,
        )

    def _traced_forward(self, bucket: int) -> PieceForward:
        """The model over the bucket's static inputs, with a `PieceBackend` that does `at_break` at each
        break point."""
        input_ids, positions = self._input_ids[:bucket], self._positions[:bucket]

        def forward(at_break: AtBreak) -> Traced:
            backend = PieceBackend(self.bridges, bucket, at_break)
            hidden = self._model(input_ids, positions, backend)
            return Traced(hidden, backend.calls)

        return forward

    def _warm_up(self, bucket: int) -> AtBreak:
        """Runs each call at once on a batch of one sequence of `bucket` tokens in scratch memory: its
        K/V all in the scratch page (slot i % page size), its state in the scratch slot."""
        page_size = self._pool.page_size
        pages = [self._scratch_page] * -(-bucket // page_size)
        batch = build_forward_batch(
            [([0] * bucket, pages, 0, bucket)], [self._scratch_slot], page_size, self._pool.device
        )
        backend = PagedAttentionBackend(self._pool, batch, self._state_slots, self._kv_scales)

        def at_break(op: EagerOp, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
            return op(backend, *inputs)

        return at_break
