"""A follower rank of a tensor-parallel engine (`python -m morion.engine.rank_follower`, started by
engine/ranks.py): it assembles the same parts as rank 0 from the same config, with its own shard, and
repeats the device work rank 0 sends (parallel/step_mirror.py) until the stop message, or until rank 0
is gone (end-of-file on its standard input, or its parent process changed: no orphan is left behind).
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
import time
from typing import BinaryIO

import torch

from morion.cache.copy_engine import Transfer
from morion.cache.disk_format import KIND_PAGE, KIND_SNAPSHOT
from morion.cache.host_store import HostObjectStore
from morion.engine.assembly import EngineParts, assemble
from morion.engine.ranks import FollowerStart, share_cpu_threads
from morion.parallel.group import TensorParallel
from morion.parallel.step_mirror import STOP
from morion.runner.forward_batch import batch_from_host
from morion.runner.model_runner import Forward
from morion.spec.draft_mirror import DraftFollower
from morion.spec.mtp import MtpDrafter

_PARENT_CHECK_S = 1.0
_DISK_WAIT_S = 0.05  # one wait for this rank's disk jobs, while rank 0 needs their outcome or their row


class Follower:
    """Applies rank 0's operations to this rank's parts, in rank 0's order."""

    def __init__(self, parts: EngineParts, device: torch.device, group: TensorParallel) -> None:
        self._parts = parts
        self._device = device
        self._group = group
        self._disk_jobs: dict[tuple[int, bytes], int] = {}  # (kind, key) -> the host row it reads or writes
        self._reads: dict[tuple[int, bytes], bool] = {}  # finished reads until rank 0 asks: succeeded?
        self._last: Forward | None = None  # the latest forward: what "logits" rows index
        self._restores: list[Transfer] = []  # issued since the last forward, which waits on them
        self._backups: list[Transfer] = []  # until done: their host rows must not be read before
        self._drafts: DraftFollower | None = None  # an MTP drafter's calls (spec/draft_mirror.py)
        speculative = parts.speculative
        if speculative is not None and isinstance(speculative.drafter, MtpDrafter):
            self._drafts = DraftFollower(speculative.drafter, device, group.broadcast_)

    @torch.inference_mode()
    def apply(self, op: tuple) -> None:
        name, *args = op
        parts = self._parts
        if name == "forward":
            (host,) = args
            restores, self._restores = self._restores, []
            self._last = parts.runner.forward(batch_from_host(host, self._device), restores)
        elif name == "verify":
            host, verify_columns = args
            batch = batch_from_host(host, self._device)
            if self._drafts is not None:
                self._drafts.before_verify(batch)
            self._last = parts.runner.verify(batch, verify_columns)
        elif name == "logits":
            (rows,) = args
            parts.runner.logits(self._last, rows)
        elif name in ("state_copy", "state_zero"):
            for restore in self._restores:  # a restored snapshot copied on: after its copy (rule 4)
                restore.wait_all()
            if name == "state_copy":
                parts.state_slots.copy_storage(*args)
            else:
                parts.state_slots.zero_storage(*args)
        elif name == "backup":
            pages, page_rows, slot, snapshot_row = args
            tiers = parts.tiers
            self._settle(KIND_PAGE, page_rows)  # a disk job still reading a row rank 0 reuses
            self._settle(KIND_SNAPSHOT, [snapshot_row])
            transfer = tiers.copy_engine.backup(
                parts.pool, pages, tiers.host, page_rows, parts.state_slots, slot, tiers.snapshots,
                snapshot_row,
            )  # fmt: skip
            self._backups = [t for t in self._backups if not t.done()] + [transfer]
        elif name == "restore":
            page_rows, pages, snapshot_row, dst_slots = args
            tiers = parts.tiers
            restore = tiers.copy_engine.restore(
                tiers.host, page_rows, parts.pool, pages, tiers.snapshots, snapshot_row, parts.state_slots,
                dst_slots,
            )  # fmt: skip
            self._restores.append(restore)
        elif name.startswith("disk_"):
            self._disk(name, *args)
        elif name.startswith("spec_") and self._drafts is not None:
            self._drafts.apply(name, tuple(args), self._last.hidden if self._last is not None else None)
        else:
            raise RuntimeError(f"unknown operation {name!r} from rank 0")

    # -- the disk tier: this rank's shard of each object, in its own namespace -----------------------------
    def _disk(self, name: str, *args) -> None:
        disk = self._parts.tiers.disk
        if name == "disk_write":
            kind, key, row = args
            filled = self._backups[-1].synchronize  # the backup just before filled the row
            if disk.submit_write(kind, key, self._row(kind, row), filled):
                self._disk_jobs[(kind, key)] = row
        elif name == "disk_read":
            kind, key, row = args
            self._settle(kind, [row])
            if disk.submit_read(kind, key, self._row(kind, row)):
                self._disk_jobs[(kind, key)] = row
            else:
                self._reads[(kind, key)] = False
        elif name == "disk_touch":
            disk.touch_chain(*args)
        elif name == "disk_agree":
            (objects,) = args
            flags = []
            for kind, key in objects:
                while (kind, key) in self._disk_jobs:
                    self.poll_disk(_DISK_WAIT_S)
                flags.append(self._reads.pop((kind, key), False))
            self._group.all_agree(flags)
        else:
            raise RuntimeError(f"unknown operation {name!r} from rank 0")

    def _row(self, kind: int, row: int):
        tiers = self._parts.tiers
        store: HostObjectStore = tiers.host if kind == KIND_PAGE else tiers.snapshots
        return store.arena[row].numpy()

    def poll_disk(self, timeout: float = 0.0) -> None:
        """Takes this rank's finished disk jobs (a read's outcome is kept for rank 0's question)."""
        tiers = self._parts.tiers
        if tiers is None or tiers.disk is None:
            return
        for result in tiers.disk.poll(timeout):
            self._disk_jobs.pop((result.kind, result.key), None)
            if result.op == "read":
                self._reads[(result.kind, result.key)] = result.error is None

    def _settle(self, kind: int, rows: list[int | None]) -> None:
        """Waits for this rank's disk jobs on `rows` of `kind`'s arena: they are about to be overwritten."""
        busy = set(rows)
        while any(k == kind and row in busy for (k, _), row in self._disk_jobs.items()):
            self.poll_disk(_DISK_WAIT_S)

    def close(self) -> None:
        """Finishes this rank's copies and disk writes (its tiers' index is rank 0's: only the disk store
        itself is closed here)."""
        for transfer in self._backups + self._restores:
            transfer.synchronize()
        tiers = self._parts.tiers
        if tiers is not None and tiers.disk is not None:
            tiers.disk.close()


def follow(follower: Follower, stream: BinaryIO) -> None:
    """Applies each message's operations until the stop message or end-of-file."""
    while True:
        try:
            ops = pickle.load(stream)
        except EOFError:
            return
        for op in ops:
            if op[0] == STOP:
                return
            follower.apply(op)
        follower.poll_disk()


def _exit_when_orphaned(parent: int) -> None:
    """A thread's loop: rank 0 died while this rank waited inside a collective (which may never return)."""
    while True:
        time.sleep(_PARENT_CHECK_S)
        if os.getppid() != parent:
            os._exit(1)


def main() -> None:
    # Ctrl-C or a SIGTERM to the process group reaches every rank; rank 0 decides when the ranks stop (the
    # server drains first), and a follower ends when rank 0 says so or is gone.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_exit_when_orphaned, args=(os.getppid(),), daemon=True).start()
    stream = sys.stdin.buffer
    start: FollowerStart = pickle.load(stream)
    config = start.config
    device = config.torch_device
    share_cpu_threads(config)
    store = torch.distributed.TCPStore("127.0.0.1", start.store_port, start.size, is_master=False)
    group = TensorParallel.join(start.rank, start.size, device, store=store)
    parts = assemble(config, None, None, None, group)
    follower = Follower(parts, device, group)
    try:
        follow(follower, stream)
    finally:
        follower.close()
        group.leave()


if __name__ == "__main__":
    main()
