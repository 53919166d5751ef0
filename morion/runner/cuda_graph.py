"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode step of a hybrid MoE model launches hundreds of small kernels; replaying them from a graph
removes the per-launch CPU cost that otherwise dominates single-request decode (design.md §4). Every
graph reads its inputs from static device buffers, so a replay is: copy the batch in, replay, read the
logits out. A batch of B sequences replays the smallest bucket >= B; the rows past B are padding that
must not touch anyone's cache, so they write their K/V into a scratch page and their state into a
scratch state slot that the engine holds for this purpose and never hands out.

Speculative verify forwards replay graphs too: a runner built with `query_len` n > 1 captures batches of
B sequences with exactly n new tokens each (the last sampled token and n - 1 drafts), and, for models
with state, the [B, n] `verify_slots` buffer (HybridBackend.verify_slots). Its padding rows write their n
tokens into the scratch page (n <= page size) and all their states into the scratch slot. A runner built
with `verify=False` captures short forwards of n tokens per sequence instead (a prompt's tail after its
last page boundary, engine/forward_groups.py): no verify slots, each sequence's state after its last token
in its working slot, the same kernels as the eager short forward.

Invariants for capture: the model's decode path makes no host syncs and allocates nothing whose size
depends on data; all Triton kernels were compiled by an eager warm-up run of the same shapes first.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable

import torch

from morion.cache.page_pool import PagePool
from morion.cache.state_slots import StateSlots
from morion.runner.backend import KVScales, PagedAttentionBackend
from morion.runner.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 64, every 16 above: padding wastes at most a few rows."""
    sizes = [b for b in (1, 2, 4) if b < max_batch]
    step = 8
    size = 8
    while size < max_batch:
        sizes.append(size)
        step = 16 if size >= 64 else 8
        size += step
    sizes.append(max_batch)
    return sizes


class DecodeGraphRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        pool: PagePool,
        state_slots: StateSlots | None,
        kv_scales: KVScales,
        max_batch: int,
        max_pages_per_sequence: int,
        scratch_page: int,
        scratch_slot: int | None,
        query_len: int = 1,
        verify: bool = True,
    ) -> None:
        """`query_len` n new tokens per sequence; with n > 1, a verify forward (`verify`: the state after
        every token in `verify_slots`) or a short one (the state after the last token only)."""
        device = pool.device
        if not 1 <= query_len <= pool.page_size:
            raise ValueError(f"query_len {query_len} must be in [1, page size {pool.page_size}]")
        self._model = model
        self._pool = pool
        self._state_slots = state_slots
        self._kv_scales = kv_scales
        self.buckets = batch_buckets(max_batch)
        self.max_batch = max_batch
        self.max_pages = max_pages_per_sequence
        self._scratch_page = scratch_page
        self._scratch_slot = scratch_slot
        self.query_len = n = query_len
        self.verify = verify and n > 1
        page_size = pool.page_size
        rows = max_batch * n
        # Padding sequences attend to their n keys in the scratch page and write there (and to the
        # scratch slot): token i of every padding sequence goes to scratch token slot i.
        self._padding_slots = scratch_page * page_size + torch.arange(rows, device=device) % n
        self._input_ids = torch.zeros(rows, dtype=torch.long, device=device)
        self._positions = torch.arange(rows, device=device) % n
        self._out_slots = self._padding_slots.clone()
        self._page_table = torch.full(
            (max_batch, self.max_pages), scratch_page, dtype=torch.int32, device=device
        )
        self._cu_seqlens = torch.arange(max_batch + 1, dtype=torch.int32, device=device) * n
        self._seq_lens = torch.full((max_batch,), n, dtype=torch.int32, device=device)
        self._state_indices = (
            torch.full((max_batch,), scratch_slot, dtype=torch.int32, device=device)
            if scratch_slot is not None
            else None
        )
        self._verify_slots = (
            torch.full((max_batch, n), scratch_slot, dtype=torch.int32, device=device)
            if scratch_slot is not None and self.verify
            else None
        )
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor | None] = {}
        self._hidden: dict[int, torch.Tensor] = {}  # what the forward returns (an MTP drafter reads it)
        self._last_bucket = 0
        self._memory_pool = None
        self.replays = 0  # decode steps served from a graph

    def _static_batch(self, size: int) -> ForwardBatch:
        n = self.query_len
        return ForwardBatch(
            input_ids=self._input_ids[: size * n],
            positions=self._positions[: size * n],
            out_slots=self._out_slots[: size * n],
            page_table=self._page_table[:size],
            cu_seqlens_q=self._cu_seqlens[: size + 1],
            seq_lens=self._seq_lens[:size],
            state_indices=None if self._state_indices is None else self._state_indices[:size],
            max_query_len=n,
            query_ranges=[(row * n, n) for row in range(size)],
            last_rows=[row * n + n - 1 for row in range(size)],
        )

    def _forward(self, size: int) -> Callable[[], torch.Tensor]:
        batch = self._static_batch(size)
        verify_slots = None if self._verify_slots is None else self._verify_slots[:size]
        backend = PagedAttentionBackend(self._pool, batch, self._state_slots, self._kv_scales, verify_slots)

        def run() -> tuple[torch.Tensor, torch.Tensor | None]:
            hidden = self._model(batch.input_ids, batch.positions, backend)
            # A short forward needs the logits of its last row only: the caller computes them from
            # the hidden states, as the eager short forward does (the same bits whatever the LM head's
            # GEMM does with a row count).
            sampled = self.query_len == 1 or self.verify  # decode and verify: every row is sampled
            return hidden, self._model.compute_logits(hidden) if sampled else None

        return run

    @property
    def memory_pool(self) -> object | None:
        """The graph memory pool handle (None before capture)."""
        return self._memory_pool

    def share_memory_pool(self, other: DecodeGraphRunner) -> None:
        """Capture into `other`'s graph memory pool: runners replay one at a time, never concurrently,
        so their activations may share memory (call before `capture`)."""
        self._memory_pool = other._memory_pool

    @torch.inference_mode()
    def capture(self, quiet: bool = False) -> None:
        """Warm up and capture every bucket, largest first (later captures reuse its memory pool); the
        startup line unless `quiet` (a caller that reports a family of runners in one line)."""
        started = time.perf_counter()
        free_before, _ = torch.cuda.mem_get_info(self._pool.device)
        stream = torch.cuda.Stream(self._pool.device)
        stream.wait_stream(torch.cuda.current_stream(self._pool.device))
        for size in reversed(self.buckets):
            run = self._forward(size)
            with torch.cuda.stream(stream):
                run()  # compiles every kernel at these shapes; capture must not compile
                run()
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._memory_pool, stream=stream):
                hidden, logits = run()
            if self._memory_pool is None:
                self._memory_pool = graph.pool()
            self._graphs[size], self._hidden[size], self._logits[size] = graph, hidden, logits
        torch.cuda.current_stream(self._pool.device).wait_stream(stream)
        torch.cuda.synchronize(self._pool.device)
        free_after, _ = torch.cuda.mem_get_info(self._pool.device)
        if quiet:
            return
        n = self.query_len
        kind = "decode" if n == 1 else f"{'verify' if self.verify else 'short'} ({n} tokens per sequence)"
        print(
            f"morion: captured {kind} CUDA graphs for batch sizes {self.buckets} in "
            f"{time.perf_counter() - started:.1f} s ({(free_before - free_after) / 2**30:.2f} GiB)",
            file=sys.stderr,
        )

    def can_run(self, batch: ForwardBatch) -> bool:
        n = self.query_len
        return (
            batch.max_query_len == n
            and all(length == n for _, length in batch.query_ranges)
            and len(batch.query_ranges) <= self.max_batch
            and batch.page_table.shape[1] <= self.max_pages
        )

    def run(self, batch: ForwardBatch, verify_slots: torch.Tensor | None = None) -> torch.Tensor | None:
        """Logits [B * n, vocab] (fp32) of a batch of B <= max_batch sequences of n new tokens each (n = 1:
        decode; n > 1: a verify forward, with its `verify_slots` [B, n] for models with state); None for
        a short forward (`last_hidden` holds its result)."""
        n = self.query_len
        size = len(batch.query_ranges)
        bucket = next(b for b in self.buckets if b >= size)
        width = batch.page_table.shape[1]
        self._input_ids[: size * n].copy_(batch.input_ids)
        self._positions[: size * n].copy_(batch.positions)
        self._out_slots[: size * n].copy_(batch.out_slots)
        self._page_table[:size, :width].copy_(batch.page_table)
        self._seq_lens[:size].copy_(batch.seq_lens)
        if self._state_indices is not None and batch.state_indices is not None:
            self._state_indices[:size].copy_(batch.state_indices)
        if self._verify_slots is not None and verify_slots is not None:
            self._verify_slots[:size].copy_(verify_slots)
        if bucket > size:  # rows that held a real sequence last time are padding now
            self._out_slots[size * n : bucket * n].copy_(self._padding_slots[size * n : bucket * n])
            self._page_table[size:bucket, 0].fill_(self._scratch_page)
            self._seq_lens[size:bucket].fill_(n)
            if self._state_indices is not None:
                self._state_indices[size:bucket].fill_(self._scratch_slot)
            if self._verify_slots is not None:
                self._verify_slots[size:bucket].fill_(self._scratch_slot)
        self._graphs[bucket].replay()
        self.replays += 1
        self._last_bucket = bucket
        logits = self._logits[bucket]
        return None if logits is None else logits[: size * n]

    def last_hidden(self, rows: int) -> torch.Tensor:
        """The hidden states [rows, hidden_width] of the last replay's first `rows` rows (valid until the next
        replay of any graph sharing the memory pool)."""
        return self._hidden[self._last_bucket][:rows]
