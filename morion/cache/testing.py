"""Test doubles for the cache tiers, used by the CPU tests of the async copy rules (design §3).

On a CPU every copy is done when it returns, so nothing could go wrong between a copy's issue and its
end. `InFlightCopyEngine` keeps restores in flight until something waits on them, the way a CUDA copy
stream does, and lets a test act on the host tier in that window.
"""

from __future__ import annotations

from collections.abc import Callable

from morion.cache.copy_engine import SyncCopyEngine, Transfer
from morion.cache.host_store import HostObjectStore


class InFlightTransfer(Transfer):
    """Copies that run only when something first waits on them: the forward's first layer, a
    `wait_all`, or `synchronize`. `before_copies` runs just before them: whatever it does to the host
    tier happens while the restore is in flight."""

    def __init__(self, copies: list[Callable[[], None]], before_copies: Callable[[], None]) -> None:
        self._copies = copies
        self._before = before_copies

    def _run(self) -> None:
        if self._copies:
            copies, self._copies = self._copies, []
            self._before()
            for copy in copies:
                copy()

    def done(self) -> bool:
        return not self._copies

    def synchronize(self) -> None:
        self._run()

    def completion_waiter(self) -> Callable[[], None]:
        return self._run  # a test double: its copies are its buffers, and they must run when waited for

    def wait(self, component: str, layer: int) -> None:
        self._run()

    def wait_all(self) -> None:
        self._run()


class InFlightCopyEngine(SyncCopyEngine):
    """Backups copy at once; restores stay in flight (`InFlightTransfer`)."""

    def __init__(self, before_copies: Callable[[], None] = lambda: None) -> None:
        self.before_copies = before_copies
        self._restoring = False
        self.restores_in_flight_seen = 0

    def restore(self, *args, **kwargs) -> Transfer:
        self._restoring = True
        try:
            return super().restore(*args, **kwargs)
        finally:
            self._restoring = False

    def _run(self, copies):
        if not self._restoring:
            return super()._run(copies)
        self.restores_in_flight_seen += 1
        return InFlightTransfer(copies, self.before_copies)


def flood(store: HostObjectStore, tag: bytes) -> int:
    """Evict everything evictable from `store` and refill every free row with garbage under new keys:
    what another request's backups or prefetches would do. Returns how many rows were overwritten."""
    store.evict(store.num_rows)
    junk = []
    while True:
        key = tag + len(junk).to_bytes(8, "little") + bytes(32 - len(tag) - 8)
        entry = store.reserve(key)  # pinned until the store is full, so the flood does not evict itself
        if entry is None:
            break
        store.arena[entry.row].fill_(0x7F)  # 0x7f7f7f7f is a float32 of 3.4e38: attention would notice
        entry.ready = True
        junk.append(key)
    for key in junk:
        store.unpin(key)
    return len(junk)
