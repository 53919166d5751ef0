"""The MTP drafter's after-verify draft (`MtpDrafter.draft_after_verify`) replayed from CUDA graphs, one
per batch bucket, for one draft width.

Eager, the draft is 1 + (width - 1) forwards of an MoE decoder layer plus their small ops, launched one
by one every step: on the 80B preset that costs more than the verify forward it feeds. Its shapes depend
only on the batch size and the width, so it captures like a decode step (`runner/cuda_graph.py`): inputs
are copied into static buffers, the graph of the smallest bucket >= B replays, and the drafts are read
from its static output. Padding rows draft at positions 0 .. width of the scratch page (the verify graphs
already need width + 1 <= page size), so they write no one's K/V.

Without CUDA (tests) the same buffers and padding run the function eagerly instead of a replay.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch

from morion.runner.cuda_graph import batch_buckets

DraftFunction = Callable[
    ..., torch.Tensor
]  # draft_after_verify(inputs, hidden, accepted, next, starts, table, width)


class MtpDraftGraphs:
    def __init__(
        self,
        draft: DraftFunction,
        width: int,
        max_batch: int,
        max_pages: int,
        hidden_size: int,
        hidden_dtype: torch.dtype,
        scratch_page: int,
        device: torch.device,
    ) -> None:
        n = width + 1
        self._draft = draft
        self.width = width
        self.buckets = batch_buckets(max_batch)
        self.max_batch = max_batch
        self.max_pages = max_pages
        self._scratch_page = scratch_page
        self._inputs = torch.zeros(max_batch, n, dtype=torch.long, device=device)
        self._hidden = torch.zeros(max_batch, n, hidden_size, dtype=hidden_dtype, device=device)
        self._accepted = torch.zeros(max_batch, dtype=torch.long, device=device)
        self._next = torch.zeros(max_batch, dtype=torch.long, device=device)
        self._starts = torch.zeros(max_batch, dtype=torch.long, device=device)
        self._table = torch.full((max_batch, max_pages), scratch_page, dtype=torch.long, device=device)
        self._outputs: dict[int, torch.Tensor] = {}
        self._replays: dict[int, Callable[[], None]] = {}
        self.replays = 0

    def _run_bucket(self, size: int) -> torch.Tensor:
        return self._draft(
            self._inputs[:size], self._hidden[:size], self._accepted[:size], self._next[:size],
            self._starts[:size], self._table[:size], self.width,
        )  # fmt: skip

    def prepare_eager(self) -> None:
        """Replays without graphs (no CUDA): each bucket runs the function on the static buffers."""
        for size in self.buckets:

            def replay(size: int = size) -> None:
                self._outputs[size] = self._run_bucket(size)

            self._replays[size] = replay

    @torch.inference_mode()
    def capture(self, memory_pool: object | None) -> object | None:
        """Warm up and capture every bucket, largest first, into `memory_pool` (a graph pool handle, or
        None for a new one); returns the pool used."""
        started = time.perf_counter()
        device = self._inputs.device
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        for size in reversed(self.buckets):
            with torch.cuda.stream(stream):
                self._run_bucket(size)  # compiles the kernels at these shapes; capture must not compile
                self._run_bucket(size)
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=memory_pool, stream=stream):
                self._outputs[size] = self._run_bucket(size)
            memory_pool = memory_pool if memory_pool is not None else graph.pool()
            self._replays[size] = graph.replay
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)
        print(
            f"morion: captured MTP draft CUDA graphs (width {self.width}) for batch sizes {self.buckets} in "
            f"{time.perf_counter() - started:.1f} s",
            file=sys.stderr,
        )
        return memory_pool

    def fits(self, page_table: torch.Tensor) -> bool:
        return page_table.shape[0] <= self.max_batch and page_table.shape[1] <= self.max_pages

    def run(
        self,
        inputs: torch.Tensor,
        hidden: torch.Tensor,
        accepted: torch.Tensor,
        next_tokens: torch.Tensor,
        starts: torch.Tensor,
        page_table: torch.Tensor,
    ) -> torch.Tensor:
        """[B, width] drafts, as `draft_after_verify` gives them."""
        size, pages = page_table.shape
        bucket = next(b for b in self.buckets if b >= size)
        self._inputs[:size].copy_(inputs)
        self._hidden[:size].copy_(hidden)
        self._accepted[:size].copy_(accepted)
        self._next[:size].copy_(next_tokens)
        self._starts[:size].copy_(starts)
        self._table[:size, :pages].copy_(page_table)
        if bucket > size:  # rows that held a request last time are padding now
            self._accepted[size:bucket].zero_()
            self._starts[size:bucket].zero_()
            self._table[size:bucket].fill_(self._scratch_page)
        self._replays[bucket]()
        self.replays += 1
        return self._outputs[bucket][:size]
