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
from morion.engine.assembly import EngineParts, assemble
from morion.engine.ranks import FollowerStart, share_cpu_threads
from morion.parallel.group import TensorParallel
from morion.parallel.step_mirror import STOP
from morion.runner.forward_batch import batch_from_host
from morion.runner.model_runner import Forward

_PARENT_CHECK_S = 1.0


class Follower:
    """Applies rank 0's operations to this rank's parts, in rank 0's order."""

    def __init__(self, parts: EngineParts, device: torch.device) -> None:
        self._parts = parts
        self._device = device
        self._last: Forward | None = None  # the latest forward: what "logits" rows index
        self._restores: list[Transfer] = []  # issued since the last forward, which waits on them
        self._backups: list[Transfer] = []  # until done: their host rows must not be read before

    @torch.inference_mode()
    def apply(self, op: tuple) -> None:
        name, *args = op
        parts = self._parts
        if name == "forward":
            (host,) = args
            restores, self._restores = self._restores, []
            self._last = parts.runner.forward(batch_from_host(host, self._device), restores)
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
            transfer = tiers.copy_engine.backup(
                parts.pool, pages, tiers.host, page_rows, parts.state_slots, slot, tiers.snapshots, snapshot_row
            )
            self._backups = [t for t in self._backups if not t.done()] + [transfer]
        elif name == "restore":
            page_rows, pages, snapshot_row, dst_slots = args
            tiers = parts.tiers
            self._restores.append(
                tiers.copy_engine.restore(
                    tiers.host, page_rows, parts.pool, pages, tiers.snapshots, snapshot_row,
                    parts.state_slots, dst_slots,
                )  # fmt: skip
            )
        else:
            raise RuntimeError(f"unknown operation {name!r} from rank 0")

    def close(self) -> None:
        for transfer in self._backups + self._restores:
            transfer.synchronize()
        if self._parts.tiers is not None:
            self._parts.tiers.close()


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
    follower = Follower(parts, device)
    try:
        follow(follower, stream)
    finally:
        follower.close()
        group.leave()


if __name__ == "__main__":
    main()
