"""The host and disk tiers behind the device radix cache: backup, lookup, prefetch and load-back.

Objects are found by page key (`page_keys.py`): a page of every token component, or a state snapshot
keyed by the page it ends on. The device radix tree stays the only structure the scheduler matches
against; the tiers continue the key chain where the device match ends:

- **Backup.** Write-through (default): whenever the scheduler hands pages (and a snapshot) to the radix
  cache, the ones the host lacks are copied to it, and from there written to disk by worker threads.
  Write-back: only when the device evicts a node (or a snapshot) is it copied to the host.
- **Lookup** (`find`, at admission, after the device match): the longest run of the prompt's next full
  pages found in host memory, for a state model cut back to the deepest position whose snapshot is there
  too (a hit is valid only if every component covers it, design §3). If disk would extend the hit, the
  missing objects are prefetched into host memory first and the request waits (not holding any device
  memory) until they arrive or fail.
- **Load-back** (`restore`): all pages of the hit and the snapshot at its end, all or nothing, into pages
  and a state slot the scheduler allocated; the scheduler then inserts them into the radix tree, so the
  next request sees a device hit.

Copy rules (design §3; see `copy_engine.py`): every host object a copy reads or writes is pinned until
that copy's transfer is done (rule 1), which is what makes host eviction during an in-flight load-back
harmless; disk writers wait for the backup's transfer before reading the row (rule 3, host side).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import NamedTuple

import torch

from morion.cache.copy_engine import CopyEngine, Transfer
from morion.cache.disk_format import KIND_PAGE, KIND_SNAPSHOT
from morion.cache.disk_store import DiskResult, DiskStore
from morion.cache.host_store import HostObjectStore, ObjectLayout
from morion.cache.page_keys import extend_page_keys
from morion.cache.page_pool import PagePool
from morion.cache.state_slots import DeviceWorkMirror, StateSlots
from morion.cache.tier_stats import CacheStats

WRITE_POLICIES = ("write_through", "write_back")
WAIT = "wait"  # `find`'s answer while objects the hit needs are on their way from disk
PREFETCHING = "prefetching"  # likewise, when this very call started (some of) those reads


class TierHit(NamedTuple):
    """A load-back to do: pages [start_page, start_page + num_pages) of the prompt, and for a state model
    the snapshot after them. Its host objects are pinned from `find` until `restore` (or `release`)."""

    start_page: int
    num_pages: int
    page_keys: list[bytes]
    snapshot_key: bytes | None
    disk_pages: int  # how many of the pages were prefetched from disk for this hit
    started: float  # when the admission that found it began (perf_counter)


class _PrefetchBatch:
    """Disk reads started together for one hit, and the pins that keep the rest of that hit (objects
    already in host memory) from being evicted to make room for them, released when the last read ends."""

    __slots__ = ("outstanding", "pins")

    def __init__(self) -> None:
        self.pins: list[tuple[HostObjectStore, bytes]] = []
        self.outstanding = 0


class _InFlight(NamedTuple):
    transfer: Transfer
    pins: list[tuple[HostObjectStore, bytes]]
    restore_started: float | None  # set for a load-back: its latency is recorded when it is done


class CacheTiers:
    def __init__(
        self,
        pool: PagePool,
        slots: StateSlots | None,
        copy_engine: CopyEngine,
        host_pages: int,
        host_snapshots: int,
        pin_memory: bool,
        write_policy: str = "write_through",
        stats: CacheStats | None = None,
    ) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"write policy must be one of {WRITE_POLICIES}, got {write_policy!r}")
        spec = pool.spec
        self.pool, self.slots, self.spec = pool, slots, spec
        self.page_size = spec.page_size
        self.copy_engine = copy_engine
        self.write_policy = write_policy
        self.host = HostObjectStore(ObjectLayout.for_pages(spec), host_pages, pin_memory)
        self.snapshots = None
        if spec.has_state:
            self.snapshots = HostObjectStore(ObjectLayout.for_snapshots(spec), host_snapshots, pin_memory)
        self.disk: DiskStore | None = None
        self.stats = stats or CacheStats()
        self._in_flight: list[_InFlight] = []
        self._for_forward: list[Transfer] = []
        self._batches: dict[tuple[int, bytes], _PrefetchBatch] = {}  # by the object being read
        # Rank 0 of a tensor-parallel engine: each disk write and read of a host row is repeated by every
        # rank on its own shard's row, and a read counts as done only when every rank's succeeded.
        self.mirror: DeviceWorkMirror | None = None
        self.refresh_gauges()

    @staticmethod
    def host_rows(spec, host_bytes: int, state_fraction: float) -> tuple[int, int]:
        """(page rows, snapshot rows) for a host budget: a state model gives `state_fraction` of it to
        snapshots. Raises ValueError when the budget holds less than one of each."""
        page_bytes = ObjectLayout.for_pages(spec).row_bytes
        snapshot_bytes = ObjectLayout.for_snapshots(spec).row_bytes if spec.has_state else 0
        snapshot_budget = int(host_bytes * state_fraction) if spec.has_state else 0
        num_snapshots = snapshot_budget // snapshot_bytes if snapshot_bytes else 0
        num_pages = (host_bytes - num_snapshots * snapshot_bytes) // page_bytes
        if num_pages < 1 or (spec.has_state and num_snapshots < 1):
            need = page_bytes + (snapshot_bytes / state_fraction if spec.has_state else 0)
            raise ValueError(
                f"a host cache of {host_bytes} bytes holds no page/snapshot; it needs >= {int(need)} bytes"
            )
        return num_pages, num_snapshots

    def attach_disk(self, disk: DiskStore) -> None:
        self.disk = disk
        self.refresh_gauges()

    @property
    def write_through(self) -> bool:
        return self.write_policy == "write_through"

    def _store(self, kind: int) -> HostObjectStore:
        return self.host if kind == KIND_PAGE else self.snapshots

    def _disk_has(self, kind: int, key: bytes) -> bool:
        return self.disk is not None and self.disk.enabled and self.disk.has(kind, key)

    # -- lookup ----------------------------------------------------------------------------------------------

    def find(
        self, keys: Sequence[bytes], start_page: int, may_prefetch: bool, started: float
    ) -> TierHit | str | None:
        """The load-back for a prompt whose page keys are `keys` (every full page that may be a hit) and
        whose device match ends at `start_page`: a TierHit (its objects pinned), WAIT (objects it needs
        are on their way from disk: ask again next step), or None. With `may_prefetch`, disk objects
        that would extend the hit are prefetched into host memory first, and the answer is PREFETCHING.
        Reads in flight always end (done or failed), so asking again terminates."""
        host, limit = self.host, len(keys)
        end = start_page
        while end < limit and keys[end] in host:
            end += 1
        ready_end = next((p for p in range(start_page, end) if not host.get(keys[p]).ready), end)
        disk_end = end
        while disk_end < limit and self._disk_has(KIND_PAGE, keys[disk_end]):
            disk_end += 1
        if self.snapshots is None:
            now_end, later_end = ready_end, disk_end
        else:
            snapshots = self.snapshots
            now_end = next(
                (
                    p
                    for p in range(ready_end, start_page, -1)
                    if (e := snapshots.get(keys[p - 1])) and e.ready
                ),
                start_page,
            )
            later_end = next(
                (
                    p
                    for p in range(disk_end, start_page, -1)
                    if keys[p - 1] in snapshots or self._disk_has(KIND_SNAPSHOT, keys[p - 1])
                ),
                start_page,
            )
        if later_end > now_end:
            started_reads = self._prefetch(keys, start_page, later_end) if may_prefetch else 0
            if self._loading(keys, start_page, later_end):
                return PREFETCHING if started_reads else WAIT
        if now_end <= start_page:
            return None
        page_keys = list(keys[start_page:now_end])
        snapshot_key = keys[now_end - 1] if self.snapshots is not None else None
        self._touch_on_disk(keys[:now_end])
        disk_pages = 0
        for key in page_keys:
            entry = host.pin(key)
            disk_pages += entry.from_disk
            entry.from_disk = False
        if snapshot_key is not None:
            self.snapshots.pin(snapshot_key).from_disk = False
        return TierHit(start_page, now_end - start_page, page_keys, snapshot_key, disk_pages, started)

    def _loading(self, keys: Sequence[bytes], start: int, end: int) -> bool:
        """True when an object the hit [start, end) needs is still being read from disk."""
        if any((e := self.host.get(k)) is not None and not e.ready for k in keys[start:end]):
            return True
        entry = self.snapshots.get(keys[end - 1]) if self.snapshots is not None else None
        return entry is not None and not entry.ready

    def _prefetch(self, keys: Sequence[bytes], start: int, end: int) -> int:
        """Start disk reads into host memory for the objects of hit [start, end) that only the disk has.
        The objects of the hit already in host memory are pinned until the batch is done, so making room
        for the new ones cannot evict them. Returns the number of reads started."""
        needed = [(KIND_PAGE, key) for key in keys[start:end]]
        if self.snapshots is not None:
            needed.insert(0, (KIND_SNAPSHOT, keys[end - 1]))  # first: without it the pages are useless
        batch = _PrefetchBatch()
        for kind, key in needed:
            store = self._store(kind)
            entry = store.get(key)
            if entry is not None:
                if entry.ready:  # one still loading is pinned by its own read (and dropped if that fails)
                    store.pin(key)
                    batch.pins.append((store, key))
                continue
            if not self._disk_has(kind, key):
                break
            entry = store.reserve(key)
            if entry is None:
                break  # every host row is pinned: prefetch what fits
            if not self.disk.submit_read(kind, key, store.row_array(entry)):
                store.drop(key)
                break
            if self.mirror is not None:
                self.mirror.send("disk_read", kind, key, entry.row)
            self._batches[(kind, key)] = batch
            batch.outstanding += 1
        if batch.outstanding == 0:
            self._release_pins(batch.pins)
        return batch.outstanding

    # -- load-back -------------------------------------------------------------------------------------------

    def restore(self, hit: TierHit, pages: Sequence[int], dst_slots: Sequence[int]) -> None:
        """Copy the hit's pages into device `pages` and its snapshot into every slot of `dst_slots`. The
        forward must not read them before `take_for_forward`'s transfers say so (rule 4)."""
        rows = [self.host.get(key).row for key in hit.page_keys]
        snapshot_row = None
        if hit.snapshot_key is not None:
            snapshot_row = self.snapshots.get(hit.snapshot_key).row
        transfer = self.copy_engine.restore(
            self.host, rows, self.pool, pages, self.snapshots, snapshot_row, self.slots, dst_slots
        )
        # Rule 1: the hit's host rows stay pinned (unevictable, never reused) until the transfer is done.
        pins = [(self.host, key) for key in hit.page_keys]
        if hit.snapshot_key is not None:
            pins.append((self.snapshots, hit.snapshot_key))
            self.snapshots.touch(hit.snapshot_key)
        self._in_flight.append(_InFlight(transfer, pins, hit.started))
        self._for_forward.append(transfer)
        self._retire_copies()  # a synchronous copy is done already
        for key in reversed(hit.page_keys):  # the head of a chain is evicted last
            self.host.touch(key)
        stats = self.stats
        stats.restores += 1
        stats.restored_tokens += hit.num_pages * self.page_size
        stats.bytes_host_to_device += len(rows) * self.host.layout.row_bytes
        if snapshot_row is not None:
            stats.restored_snapshots += 1
            stats.bytes_host_to_device += self.snapshots.layout.row_bytes

    def release(self, hit: TierHit) -> None:
        """Give up a hit that will not be restored (its admission failed)."""
        pins = [(self.host, key) for key in hit.page_keys]
        if hit.snapshot_key is not None:
            pins.append((self.snapshots, hit.snapshot_key))
        self._release_pins(pins)

    def take_for_forward(self) -> list[Transfer]:
        """The restores issued since the last forward: the next forward waits on them layer by layer."""
        transfers, self._for_forward = self._for_forward, []
        return transfers

    def order_after_restores(self) -> None:
        """Order the current stream after every restore of this step (before a device-side read of restored
        data outside the forward, e.g. copying a restored snapshot into another request's slot)."""
        for transfer in self._for_forward:
            transfer.wait_all()

    # -- backup ----------------------------------------------------------------------------------------------

    def backup(
        self,
        keys: Sequence[bytes],
        pages: Sequence[int],
        snapshot_slot: int | None = None,
        snapshot_key: bytes | None = None,
    ) -> None:
        """Back up device `pages` (keys[i] is the key of pages[i], a run of whole pages) and the snapshot
        in `snapshot_slot` (key `snapshot_key`), skipping what the host has. The caller may overwrite the
        pages and the slot right after (the copy engine orders device writes after the copy, rule 3)."""
        host = self.host
        present = [key for key in keys if key in host]
        for key in present:  # a run's own head must not make room for its tail
            host.pin(key)
            host.touch(key)  # and out of the way of the LRU scan for victims
        new_keys, new_pages, rows = [], [], []
        for key, page in zip(keys, pages, strict=True):
            if key in host:
                continue
            entry = host.reserve(key)
            if entry is None:
                break  # every other row is pinned
            new_keys.append(key)
            new_pages.append(page)
            rows.append(entry.row)
        for key in present:
            host.unpin(key)
        snapshot_row = None
        complete = len(present) + len(new_keys) == len(keys)
        if snapshot_slot is not None and complete and snapshot_key not in self.snapshots:
            entry = self.snapshots.reserve(snapshot_key)
            snapshot_row = entry.row if entry is not None else None
        for key in reversed(keys):
            if key in host:
                host.touch(key)
        if not new_keys and snapshot_row is None:
            self._touch_on_disk(keys)
            return
        transfer = self.copy_engine.backup(
            self.pool,
            new_pages,
            host,
            rows,
            self.slots,
            snapshot_slot if snapshot_row is not None else None,
            self.snapshots,
            snapshot_row,
        )
        # Ready means restorable: a restore is queued behind this backup on the same copy stream.
        objects = [(KIND_PAGE, key) for key in new_keys]
        if snapshot_row is not None:
            objects.append((KIND_SNAPSHOT, snapshot_key))
        pins = []
        for kind, key in objects:
            store = self._store(kind)
            store.get(key).ready = True
            pins.append((store, key))  # pinned once by `reserve`: released when the transfer is done
        self._in_flight.append(_InFlight(transfer, pins, None))
        stats = self.stats
        stats.backed_up_pages += len(new_keys)
        stats.bytes_device_to_host += len(new_keys) * host.layout.row_bytes
        if snapshot_row is not None:
            stats.backed_up_snapshots += 1
            stats.bytes_device_to_host += self.snapshots.layout.row_bytes
        if self.disk is not None and self.disk.enabled:
            self._write_to_disk(objects, transfer)
        self._touch_on_disk(keys)  # after the writes: the new objects are the chain's tail
        self._retire_copies()

    def _write_to_disk(self, objects: list[tuple[int, bytes]], transfer: Transfer) -> None:
        for kind, key in objects:
            store = self._store(kind)
            entry = store.pin(key)  # rule 1: the writer reads the row until its result comes back
            # Rule 3 (host side): the writer reads the row only after the backup copy has filled it.
            if not self.disk.submit_write(kind, key, store.row_array(entry), transfer.completion_waiter()):
                store.unpin(key)
            elif self.mirror is not None:
                self.mirror.send("disk_write", kind, key, entry.row)

    def on_device_evict(
        self,
        prefix_tokens: Sequence[int],
        node_pages: Sequence[int],
        snapshot_slot: int | None,
        chain_root: bytes,
    ) -> None:
        """The radix cache's eviction listener (write-back): `prefix_tokens` end where the evicted node
        ends; `node_pages` are its last pages; `snapshot_slot` its snapshot (evicted with it, or alone);
        `chain_root` the root of its key chain (a cache salt's, or the zero root)."""
        num_pages = len(prefix_tokens) // self.page_size
        keys = extend_page_keys([], prefix_tokens, self.page_size, num_pages, chain_root)
        node_keys = keys[len(keys) - len(node_pages) :]
        self.backup(node_keys, node_pages, snapshot_slot, keys[-1] if keys else None)
        self._touch_on_disk(keys)  # the node is its chain's tail: the head stays more recent on disk

    def _touch_on_disk(self, chain_keys: Sequence[bytes]) -> None:
        """The disk's LRU order follows chains (`DiskStore.touch_chain`): whenever a chain is written or
        hit, its head becomes the most recently used, so disk cleanup evicts conversations from their end."""
        if self.disk is not None:
            self.disk.touch_chain(chain_keys)
            if self.mirror is not None:  # the ranks' disks evict in the same order
                self.mirror.send("disk_touch", list(chain_keys))

    # -- progress --------------------------------------------------------------------------------------------

    def poll(self, timeout: float = 0.0) -> None:
        """Retire finished copies (unpinning their host objects) and disk jobs; refresh the gauges. With a
        timeout, first waits up to that long for a disk job to finish."""
        self._retire_copies()
        if self.disk is not None:
            for result in self._agreed(self.disk.poll(timeout)):
                self._disk_done(result)
        self.refresh_gauges()

    def _agreed(self, results: list[DiskResult]) -> list[DiskResult]:
        """At tensor parallelism, a read that succeeded here fails unless every rank's read of its shard of
        the object did too (a rank's object may be missing, or corrupt, where rank 0's is not)."""
        reads = [r for r in results if r.op == "read" and r.error is None]
        if self.mirror is None or not reads:
            return results
        objects = [(r.kind, r.key) for r in reads]
        agreed = self.mirror.agree("disk_agree", objects, flags=[True] * len(reads))
        everywhere = dict(zip(objects, agreed, strict=True))
        return [
            r._replace(error="another rank's read failed", nbytes=0)
            if r.op == "read" and r.error is None and not everywhere[(r.kind, r.key)]
            else r
            for r in results
        ]

    def _retire_copies(self) -> None:
        """Unpin the host objects of finished transfers (rule 1: not before) and time finished restores."""
        still = []
        now = time.perf_counter()
        for item in self._in_flight:
            if not item.transfer.done():
                still.append(item)
                continue
            self._release_pins(item.pins)
            if item.restore_started is not None:
                latency = now - item.restore_started
                self.stats.restore_seconds_total += latency
                self.stats.restore_seconds_max = max(self.stats.restore_seconds_max, latency)
        self._in_flight = still

    def loads_in_flight(self) -> bool:
        return self.disk is not None and self.disk.reads_in_flight()

    def _disk_done(self, result: DiskResult) -> None:
        store, stats = self._store(result.kind), self.stats
        if result.op == "write":
            store.unpin(result.key)
            if result.error is None:
                stats.disk_objects_written += 1
                stats.bytes_disk_written += result.nbytes
            else:
                stats.disk_write_errors += 1
            return
        if result.error is None:
            entry = store.get(result.key)
            entry.ready = entry.from_disk = True
            store.unpin(result.key)
            stats.disk_objects_read += 1
            stats.bytes_disk_read += result.nbytes
        else:
            store.drop(result.key)  # a miss: the request restores less, or computes
            if result.corrupt:
                stats.checksum_failures += 1
            else:
                stats.disk_read_errors += 1
        batch = self._batches.pop((result.kind, result.key))
        batch.outstanding -= 1
        if batch.outstanding == 0:
            self._release_pins(batch.pins)

    def _release_pins(self, pins: list[tuple[HostObjectStore, bytes]]) -> None:
        for store, key in pins:
            store.unpin(key)

    def refresh_gauges(self) -> None:
        stats = self.stats
        stats.host_enabled = True
        stats.host_pages_used, stats.host_pages_capacity = self.host.num_used, self.host.num_rows
        stats.host_bytes = self.host.num_bytes
        stats.host_evictions = self.host.num_evicted
        if self.snapshots is not None:
            stats.host_snapshots_used = self.snapshots.num_used
            stats.host_snapshots_capacity = self.snapshots.num_rows
            stats.host_bytes += self.snapshots.num_bytes
            stats.host_evictions += self.snapshots.num_evicted
        disk = self.disk
        if disk is not None:
            stats.disk_enabled = disk.enabled
            stats.disk_skip_reason = disk.skip_reason
            stats.disk_objects, stats.disk_bytes_used = disk.num_objects, disk.used_bytes
            stats.disk_bytes_budget, stats.disk_evictions = disk.budget_bytes, disk.num_evicted

    def close(self) -> None:
        """Wait for every copy and disk write to finish (call before the engine goes away: a new engine
        on the same disk directory then finds everything this one wrote)."""
        for item in self._in_flight:
            item.transfer.synchronize()
        self.poll()
        if self.disk is not None:
            for result in self.disk.close():
                self._disk_done(result)
        self.refresh_gauges()

    def index_bytes(self) -> int:
        """The host and disk tiers' indexes (cache_memory.py)."""
        stores = [self.host] + ([self.snapshots] if self.snapshots is not None else [])
        total = sum(store.index_bytes() for store in stores)
        return total + (self.disk.index_bytes() if self.disk is not None else 0)

    def arenas(self) -> list[torch.Tensor]:
        return [self.host.arena] + ([self.snapshots.arena] if self.snapshots is not None else [])

    def check_integrity(self) -> None:
        """Host rows are each in one place; when nothing is in flight, nothing is pinned."""
        stores = [self.host] + ([self.snapshots] if self.snapshots is not None else [])
        for store in stores:
            store.check_integrity()
            if not self._in_flight and not (self.disk and self.disk.busy()):
                pinned = [key for key in store if store.get(key).pins]
                if pinned:
                    raise RuntimeError(f"{len(pinned)} host objects are pinned with nothing in flight")
