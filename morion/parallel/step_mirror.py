"""Rank 0's half of a tensor-parallel engine's one seam: the device work every rank repeats.

Rank 0 alone schedules, owns the radix tree and the host/disk tiers' indexes, and samples; each follower
rank holds the same parts built from the same `EngineConfig` (its model shard, a page pool and state slots
with the same page and slot ids, its own host arena rows) and repeats, in order, what rank 0 does to
device memory: each forward (its batch's host arrays, from which the follower builds the same batch on its
device), each logits computation (the vocabulary gather is a collective), every state slot copy or reset,
and every backup to or restore from the host arena. Operations without a collective are queued and sent
with the next one that has one, so a step costs one message per forward (or logits) to each follower.

The messages are pickled lists of operations on each follower's standard input (engine/rank_follower.py
reads them): a follower sees end-of-file when rank 0 exits, however it exits, and ends itself. (SGLang
broadcasts its scheduler's requests over a gloo group; one host's pipes need no timeout while idle.)
"""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Sequence
from typing import BinaryIO

import torch

from morion.cache.copy_engine import CopyEngine, Transfer
from morion.parallel.group import TensorParallel

# Operations that take part in a collective: the followers must have them (and everything before) now.
_COLLECTIVE = frozenset({"forward", "verify", "logits"})
STOP = "stop"


class StepMirror:
    """Queues rank 0's device work and sends it to every follower before a collective (module docstring)."""

    def __init__(self, streams: Sequence[BinaryIO], group: TensorParallel) -> None:
        self._streams = list(streams)
        self._group = group
        self._queue: list[tuple] = []

    def send(self, *op: object) -> None:
        self._queue.append(op)
        if op[0] in _COLLECTIVE:
            self.flush()

    def agree(self, *op: object, flags: list[bool]) -> list[bool]:
        """Sends `op` (with what is queued) and ands `flags` with every follower's answer to it."""
        self._queue.append(op)
        self.flush()
        return self._group.all_agree(flags)

    def broadcast(self, tensor: torch.Tensor, *op: object) -> None:
        """Sends `op` (with what is queued), then broadcasts rank 0's device `tensor`, which the followers
        receive while applying `op`."""
        self._queue.append(op)
        self.flush()
        self._group.broadcast_(tensor)

    def flush(self) -> None:
        if not self._queue:
            return
        message = pickle.dumps(self._queue, protocol=pickle.HIGHEST_PROTOCOL)
        self._queue = []
        for stream in self._streams:
            stream.write(message)
            stream.flush()

    def stop(self) -> None:
        """Sends what is queued and the stop message; closes the streams (a follower then exits).
        Idempotent."""
        if not self._streams:
            return
        with contextlib.suppress(BrokenPipeError, OSError):  # a follower already gone: nothing to tell it
            self.send(STOP)
            self.flush()
        for stream in self._streams:
            with contextlib.suppress(BrokenPipeError, OSError):
                stream.close()
        self._streams = []


class MirroredCopyEngine(CopyEngine):
    """Rank 0's copy engine: each backup and restore between device pages/slots and host rows is also
    sent to the followers, which copy the same pages, slots and row numbers of their own shards."""

    def __init__(self, inner: CopyEngine, mirror: StepMirror) -> None:
        self._inner = inner
        self._mirror = mirror

    # The CopyEngine interface's signatures (copy_engine.py documents the arguments).
    def backup(self, pool, pages, page_store, page_rows, slots=None, slot=None,
               snapshot_store=None, snapshot_row=None) -> Transfer:  # fmt: skip
        self._mirror.send("backup", list(pages), list(page_rows), slot, snapshot_row)
        return self._inner.backup(
            pool, pages, page_store, page_rows, slots, slot, snapshot_store, snapshot_row
        )

    def restore(self, page_store, page_rows, pool, pages, snapshot_store=None, snapshot_row=None,
                slots=None, dst_slots=()) -> Transfer:  # fmt: skip
        self._mirror.send("restore", list(page_rows), list(pages), snapshot_row, list(dst_slots))
        return self._inner.restore(
            page_store, page_rows, pool, pages, snapshot_store, snapshot_row, slots, dst_slots
        )
