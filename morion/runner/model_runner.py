"""The model's forwards over the engine's memory, all through one door.

`ModelRunner.forward` runs a step's prefill, short and decode chunks, `ModelRunner.verify` a speculative
verify forward, and the warm-up (runner/warmup.py) runs `forward_eager` on scratch memory. Whether a
forward replays a CUDA graph or runs eagerly is decided in `ModelRunner._run` alone: a graph when one was
captured for the batch's shape (runner/cuda_graph.py: decode buckets, and verify graphs per draft
width; runner/prefill_graph.py: piecewise prefill graphs per token bucket), eagerly otherwise.
Host/disk restores still copying in are waited for there too: an eager forward's backend waits layer by
layer (runner/restore_wait.py), and so do a piecewise replay's eager calls (its pieces touch no cache
memory); a decode or verify replay waits for all of them first.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import numpy as np
import torch

from morion.cache.copy_engine import Transfer
from morion.cache.page_pool import PagePool
from morion.cache.state_slots import DeviceWorkMirror, StateSlots
from morion.layers.hybrid_backend import SHORT_CHUNK_TOKENS
from morion.models.image_rows import ImageRows
from morion.runner.backend import KVScales, PagedAttentionBackend
from morion.runner.capture_failure import report_capture_failure
from morion.runner.cuda_graph import DecodeGraphRunner
from morion.runner.forward_batch import ForwardBatch
from morion.runner.forward_counts import ForwardCounts, forward_kind
from morion.runner.host_to_device import to_device
from morion.runner.prefill_graph import PrefillGraphRunner
from morion.runner.profile_ranges import FORWARD, LM_HEAD, ProfileRanges
from morion.runner.restore_wait import RestoreWaits


class Forward(NamedTuple):
    hidden: torch.Tensor  # [rows, hidden_width]: what the model's forward returns (an MTP drafter reads it)
    # [rows, vocab] fp32 from a decode or verify graph's replay, valid until the next replay; None from an
    # eager forward or a short-chunk graph, whose caller computes the rows it needs (`ModelRunner.logits`).
    logits: torch.Tensor | None


def forward_eager(
    model: torch.nn.Module,
    pool: PagePool,
    batch: ForwardBatch,
    state_slots: StateSlots | None,
    kv_scales: KVScales,
    verify_slots: torch.Tensor | None = None,
    restore_waits: RestoreWaits | None = None,
    images: ImageRows | None = None,
) -> torch.Tensor:
    """The trunk's forward over `batch` without a graph: hidden states [rows, hidden_width]. `images`:
    the image rows of requests with images (positions per axis; runner/image_batch.py)."""
    backend = PagedAttentionBackend(pool, batch, state_slots, kv_scales, verify_slots, restore_waits)
    extra = {} if images is None else {"images": images}
    return model(batch.input_ids, batch.positions, backend, **extra)


class ModelRunner:
    """Owns the model's forwards and their CUDA graphs. `scratch_pages` / `scratch_slots`: the page and
    state slot the graphs' padding rows write into (held by nobody else; empty without graphs)."""

    def __init__(
        self,
        model: torch.nn.Module,
        pool: PagePool,
        state_slots: StateSlots | None,
        kv_scales: KVScales,
        scratch_pages: list[int],
        scratch_slots: list[int],
    ) -> None:
        self.model = model
        self.pool = pool
        self.state_slots = state_slots
        self.kv_scales = kv_scales
        self.scratch_pages = scratch_pages
        self.scratch_slots = scratch_slots
        self.decode_graphs: DecodeGraphRunner | None = None
        self.verify_graphs: dict[int, DecodeGraphRunner] = {}  # per tokens per sequence (1 + draft width)
        # Short forwards (a prompt's tail, 2 to SHORT_CHUNK_TOKENS tokens) of one sequence, per token count.
        self.short_graphs: dict[int, DecodeGraphRunner] = {}
        self.prefill_graphs: PrefillGraphRunner | None = None
        self.ranges = ProfileRanges()  # named profiler ranges, on only while profiling
        self.forwards = ForwardCounts()  # per kind, replayed or eager (the server's metrics)
        # Rank 0 of a tensor-parallel engine: each forward and each logits gather is sent to the follower
        # ranks first (their collectives meet rank 0's), with the device work queued before it.
        self.mirror: DeviceWorkMirror | None = None

    # ------------------------------------------------------------------ forwards
    def forward(
        self, batch: ForwardBatch, restores: Sequence[Transfer], images: ImageRows | None = None
    ) -> Forward:
        """A step's forward of one kind of chunk (engine/forward_groups.py), after `restores`."""
        if self.mirror is not None:
            self.mirror.send("forward", batch.host)
        n = batch.max_query_len
        graph = self.decode_graphs if n == 1 else self.short_graphs.get(n)
        return self._run(forward_kind(n), batch, graph, restores, images=images)

    def verify(
        self, batch: ForwardBatch, verify_columns: np.ndarray | None, images: ImageRows | None = None
    ) -> Forward:
        """A verify forward: every sequence has the same 1 + width new tokens; logits of every row.
        `verify_columns` [B, 1 + width] int32: each sequence's state slot per verified position (models
        with state)."""
        if self.mirror is not None:
            self.mirror.send("verify", batch.host, verify_columns)
        verify_slots = None
        if verify_columns is not None:
            [verify_slots] = to_device([verify_columns], batch.input_ids.device)
        graph = self.verify_graphs.get(batch.max_query_len)
        forward = self._run("verify", batch, graph, (), verify_slots, images)
        if forward.logits is None:
            with self.ranges.region(LM_HEAD):
                return Forward(forward.hidden, self.model.compute_logits(forward.hidden))
        return forward

    def logits(self, forward: Forward, rows: list[int]) -> torch.Tensor:
        """fp32 logits [len(rows), vocab] of `rows` (a copy: a graph's output buffer is rewritten by its
        next replay)."""
        if forward.logits is None:
            if self.mirror is not None:
                self.mirror.send("logits", rows)
            with self.ranges.region(LM_HEAD):
                return self.model.compute_logits(forward.hidden[rows])
        return forward.logits[rows]

    def _run(
        self,
        kind: str,
        batch: ForwardBatch,
        graph: DecodeGraphRunner | None,
        restores: Sequence[Transfer],
        verify_slots: torch.Tensor | None = None,
        images: ImageRows | None = None,
    ) -> Forward:
        """The one place that picks a graph replay or an eager forward (inside the profiler's forward range
        while profiling). Graphs take sequence indices as positions: a forward with images (positions per
        axis) runs eagerly. A prefill forward replays piecewise graphs where its tokens fit a bucket. Each
        forward is counted by `kind` (runner/forward_counts.py) and how it ran."""
        with self.ranges.region(FORWARD):
            if images is None and graph is not None and graph.can_run(batch):
                # A graph replays its layers without the per-layer restore waits: the whole forward waits (on
                # the GPU) for this step's restores instead.
                for restore in restores:
                    restore.wait_all()
                logits = graph.run(batch, verify_slots)
                self.forwards.record(kind, "graph")
                return Forward(graph.last_hidden(len(batch.query_ranges) * graph.query_len), logits)
            waits = None
            if restores:
                components = [c.name for c in self.pool.spec.token_components]
                waits = RestoreWaits(restores, components)
            prefill = self.prefill_graphs
            if images is None and verify_slots is None and prefill is not None and prefill.can_run(batch):
                self.forwards.record(kind, "graph")
                return Forward(prefill.run(batch, waits), None)
            self.forwards.record(kind, "eager")
            hidden = forward_eager(
                self.model, self.pool, batch, self.state_slots, self.kv_scales, verify_slots, waits, images
            )
            return Forward(hidden, None)

    @contextlib.contextmanager
    def profiled(self, by_module: bool) -> Iterator[None]:
        """Profiler ranges on (runner/profile_ranges.py) for the duration. `by_module`: every model part
        of a known kind in a range of its own, and every forward eager meanwhile (a graph replay runs no
        Python, so no hook would fire); the graphs come back afterwards."""
        graphs = self.decode_graphs, self.verify_graphs, self.short_graphs, self.prefill_graphs
        if by_module:
            self.decode_graphs, self.prefill_graphs = None, None
            self.verify_graphs, self.short_graphs = {}, {}
        try:
            with self.ranges.on(self.model if by_module else None):
                yield
        finally:
            self.decode_graphs, self.verify_graphs, self.short_graphs, self.prefill_graphs = graphs

    # ------------------------------------------------------------------ capture
    def capture_decode_graphs(self, max_batch: int, max_pages: int) -> None:
        """Decode graphs for batches up to `max_batch` sequences of up to `max_pages` pages; decode runs
        eagerly where capture fails (a model path that syncs with the host)."""
        graphs = self._graph_runner(max_batch, max_pages)
        try:
            graphs.capture()
        except RuntimeError as error:
            report_capture_failure("CUDA graph capture FAILED, decode runs eagerly", error)
            return
        self.decode_graphs = graphs

    def capture_verify_graph(self, query_len: int) -> bool:
        """Verify graphs of `query_len` tokens per sequence, in the decode graphs' memory pool (runners
        replay one at a time); False where capture failed (verify runs eagerly)."""
        decode = self.decode_graphs
        runner = self._graph_runner(decode.max_batch, decode.max_pages, query_len)
        runner.share_memory_pool(decode)
        try:
            runner.capture()
        except RuntimeError as error:
            report_capture_failure("verify CUDA graph capture FAILED, verify runs eagerly", error)
            return False
        self.verify_graphs[query_len] = runner
        return True

    def capture_short_graphs(self) -> None:
        """Graphs of short forwards of one sequence, one per token count 2 .. SHORT_CHUNK_TOKENS (at most
        the page size), in the decode graphs' memory pool: the tail of every prompt (the tokens after its
        last page boundary, scheduler `_chunk`) is such a forward, eager otherwise (a decode step's
        kernels, launched from Python). Only for models whose short forward is capturable
        (`short_chunk_graphs`); short forwards stay eager where capture fails."""
        decode = self.decode_graphs
        lengths = range(2, min(SHORT_CHUNK_TOKENS, self.pool.page_size) + 1)
        if decode is None or not lengths or not getattr(self.model, "short_chunk_graphs", False):
            return
        started = time.perf_counter()
        graphs: dict[int, DecodeGraphRunner] = {}
        for query_len in lengths:
            runner = self._graph_runner(1, decode.max_pages, query_len, verify=False)
            runner.share_memory_pool(decode)
            try:
                runner.capture(quiet=True)
            except RuntimeError as error:
                report_capture_failure("short-chunk CUDA graph capture FAILED, they run eagerly", error)
                return
            graphs[query_len] = runner
        self.short_graphs = graphs
        print(
            f"morion: captured short-chunk CUDA graphs (one sequence of 2 to {max(graphs)} tokens, in the "
            f"decode graphs' memory pool) in {time.perf_counter() - started:.1f} s",
            file=sys.stderr,
        )

    def capture_prefill_graphs(self, buckets: Sequence[int]) -> None:
        """Piecewise prefill graphs for forwards of up to max(`buckets`) tokens (runner/prefill_graph.py);
        prefill runs eagerly where capture fails (a layer that reads the batch's layout outside
        `attend` and `outside_graph`, or a path that syncs with the host)."""
        graphs = PrefillGraphRunner(
            self.model,
            self.pool,
            self.state_slots,
            self.kv_scales,
            buckets,
            self.scratch_pages[0],
            self._scratch_slot,
        )
        try:
            graphs.capture()
        except RuntimeError as error:
            report_capture_failure("piecewise prefill CUDA graph capture FAILED, prefill runs eagerly", error)
            return
        self.prefill_graphs = graphs

    @property
    def _scratch_slot(self) -> int | None:
        """The state slot graphs' padding rows write into (None for models without state)."""
        return self.scratch_slots[0] if self.scratch_slots else None

    def _graph_runner(
        self, max_batch: int, max_pages: int, query_len: int = 1, verify: bool = True
    ) -> DecodeGraphRunner:
        """Graphs over this runner's model and memory, their padding rows in the scratch page and slot."""
        return DecodeGraphRunner(
            self.model, self.pool, self.state_slots, self.kv_scales, max_batch, max_pages,
            self.scratch_pages[0], self._scratch_slot, query_len=query_len, verify=verify,
        )  # fmt: skip
