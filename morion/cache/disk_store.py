"""The disk tier: one file per object in a namespace directory, written by a process of its own
(`disk_writer.py`: in this process, the writes' turns at the GIL held up the engine thread's launches)
and read by worker threads.

The engine thread owns the index (which objects exist or are being written, least recently used first,
and their sizes); the writer process and worker threads only write, read and remove files and report
back through `poll`. An
object being read or written is pinned against cleanup. Cleanup is LRU down to a low watermark whenever a
write would pass the budget: the engine thread drops the victims from the index at once, and a worker
unlinks their files (thousands of them at a time: on the H200 machine's virtual disk, unlinking them on
the engine thread stalled one step of every running request for 2.9 s).

Recency follows prefix chains (`touch_chain`): a chain's head is its most recently used object, so LRU
takes a conversation from its end and what stays is a prefix, a hit as deep as its last snapshot. The
order survives a restart in the files' modification times: those of objects touched since the last save
are set to consecutive nanosecond stamps in LRU order every `RECENCY_SAVE_S` and at close, and the
start-up scan sorts by them.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from queue import SimpleQueue
from typing import NamedTuple

import numpy as np

from morion.cache.disk_format import (
    FORMAT_VERSION,
    KIND_PAGE,
    KIND_SNAPSHOT,
    OBJECT_NAME,
    SUFFIX,
    CorruptObject,
    namespace_of,
    object_file_size,
    object_path,
    object_relative_path,
    probe_direct_io,
    process_alive,
    read_manifest,
    read_object,
    temp_file_writer_pid,
    write_manifest,
)
from morion.cache.disk_writer import DiskWriter
from morion.cache.host_store import ObjectLayout
from morion.cache.spec import CacheSpec

logger = logging.getLogger("morion.cache")

LOW_WATERMARK = 0.9  # cleanup frees down to this share of the budget, so it runs once per many writes
AUTO_BUDGET_SHARE = 0.5  # the automatic budget: this share of (free space + the namespace's own objects)
RECENCY_SAVE_S = 10.0  # how often the LRU order of touched objects is written into modification times
_MAX_LOGGED_ERRORS = 5

ObjectId = tuple[int, bytes]  # (kind, key)
_OBJECT_ID_BYTES = sys.getsizeof((KIND_PAGE, b""))


class DiskResult(NamedTuple):
    """A finished write or read. `error` is None on success; `corrupt` marks a failed check on read."""

    op: str  # "write" or "read"
    kind: int
    key: bytes
    error: str | None
    corrupt: bool = False
    nbytes: int = 0


class DiskStore:
    """The namespace directory `root/<namespace of identity>`; `enabled` is False (with `skip_reason`)
    when the directory's manifest does not match, and then every call is a no-op or a miss."""

    def __init__(
        self,
        root: Path,
        identity: dict,
        info: dict,
        budget_bytes: int | None,
        payload_bytes: dict[int, int],
        num_threads: int = 4,
        direct_io: bool = False,
        budget_share: float = 1.0,
    ) -> None:
        """`direct_io`: write objects with O_DIRECT where the filesystem allows it. Off by default:
        buffered writes leave the objects in the page cache, so a restarted server restores from memory
        (on the H200 machine's virtual disk, ~120 reads per second, O_DIRECT made a 64K-token restore
        read at 0.03 GB/s and take 5x the cold prefill); O_DIRECT keeps a very large cache from
        crowding the page cache.

        `budget_bytes` None: automatic, `AUTO_BUDGET_SHARE` of the filesystem's free space plus the bytes
        of this namespace's objects found at start (`automatic_budget`), times `budget_share` (a rank's
        share of the filesystem when every tensor-parallel rank keeps its own namespace on it)."""
        self.root = Path(root)
        self.identity = identity
        self.namespace = namespace_of(identity)
        self.dir = self.root / self.namespace
        self.budget_auto = budget_bytes is None
        self.budget_bytes = budget_bytes or 0
        self._budget_share = budget_share
        self.payload_bytes = payload_bytes  # kind -> bytes of one object's payload (a host row)
        self.enabled = False
        self.skip_reason: str | None = None
        self.direct_io = False
        # -> file size; least recently used first. Writes in flight are in it (so that touches order them)
        # but not visible (`has`) until they are done.
        self._index: OrderedDict[ObjectId, int] = OrderedDict()
        self._sizes: dict[int, int] = {}  # one int object per distinct size, shared by the index's entries
        self._pins: dict[ObjectId, int] = {}
        self._writing: set[ObjectId] = set()
        # Dropped from the index, file still to be unlinked by a worker, which holds the lock from its check
        # to the unlink's end. A new write of one takes it out first (under the lock), so no worker unlinks
        # a file written after its eviction.
        self._unlinking: set[ObjectId] = set()
        self._unlinking_lock = threading.Lock()
        self._reserved = 0  # bytes of writes in flight
        self.used_bytes = 0
        # Jobs in flight -> (op, kind, key, size). A finished one's future is put in `_finished` by its done
        # callback (in the worker), so that `poll`, called every step, costs what finished, not what is
        # pending: a long prompt's write-through queues thousands of pages (looking at each cost 0.4 us).
        self._futures: dict[Future, tuple[str, int, bytes, int]] = {}
        self._finished: SimpleQueue[Future] = SimpleQueue()
        self._reads = 0  # reads in flight
        self._touched: set[ObjectId] = set()  # moved in the LRU order since the last save of recency
        self._last_stamp = 0  # the newest modification time (ns) given or found
        self._recency_job: Future | None = None
        self._next_recency_save = time.monotonic() + RECENCY_SAVE_S
        self._errors_logged = 0
        self.num_evicted = 0
        self.removed_temp_files = 0
        self._executor: ThreadPoolExecutor | None = None  # reads, unlinks, recency stamps
        self._writer: DiskWriter | None = None  # object writes, in a process of their own
        self._open(info, num_threads, direct_io)

    # -- opening ---------------------------------------------------------------------------------------------

    def _open(self, info: dict, num_threads: int, direct_io: bool) -> None:
        # Whatever the directory holds, a problem with it skips the tier (loudly); it never stops a start.
        try:
            self._open_dir(info, num_threads, direct_io)
        except OSError as error:
            self.enabled = False
            self._index.clear()
            self.used_bytes = 0
            self._skip(f"cannot use {self.dir}: {error}")

    def _open_dir(self, info: dict, num_threads: int, direct_io: bool) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            self._skip(f"cannot create {self.dir}: {error}")
            return
        manifest = read_manifest(self.dir)
        objects = self.dir / "objects"
        if manifest is None:
            if objects.exists() and any(objects.iterdir()):
                self._skip(f"{self.dir} holds objects but no readable manifest.json")
                return
            sizes = {SUFFIX[kind].lstrip("."): size for kind, size in self.payload_bytes.items()}
            manifest = {
                "identity": self.identity,
                "namespace": self.namespace,
                "payload_bytes": sizes,
                **info,
            }
            write_manifest(self.dir, manifest)
        elif manifest.get("identity") != self.identity or manifest.get("namespace") != self.namespace:
            theirs = manifest.get("identity")
            theirs = theirs if isinstance(theirs, dict) else {}
            ours = self.identity
            differing = sorted(k for k in {*theirs, *ours} if theirs.get(k) != ours.get(k))
            self._skip(
                f"the manifest in {self.dir} was written for another model or layout "
                f"({', '.join(differing)} differ)"
            )
            return
        objects.mkdir(exist_ok=True)
        self.direct_io = direct_io and probe_direct_io(self.dir)
        self._scan(objects)
        if self.budget_auto:
            self.budget_bytes = int(automatic_budget(self.dir, self.used_bytes) * self._budget_share)
        self.enabled = True
        self._executor = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="morion-disk")
        self._writer = DiskWriter(self.namespace, self.direct_io, num_threads)
        if self.used_bytes > self.budget_bytes:  # the budget shrank since the objects were written
            self._cleanup(0)

    def _skip(self, reason: str) -> None:
        self.skip_reason = reason
        logger.warning("disk cache tier NOT used: %s", reason)

    def _scan(self, objects: Path) -> None:
        """Index every object file, oldest modification first (the LRU order saved by the last run);
        remove temp files of dead writers."""
        found: list[tuple[int, ObjectId, int]] = []
        for subdir in objects.iterdir():
            if not subdir.is_dir():
                continue
            for entry in os.scandir(subdir):
                pid = temp_file_writer_pid(entry.name)
                if pid is not None:
                    if not process_alive(pid):  # a writer killed mid-write: the file was never valid
                        with contextlib.suppress(OSError):
                            os.unlink(entry.path)
                        self.removed_temp_files += 1
                    continue
                match = OBJECT_NAME.match(entry.name)
                if match is None or not entry.is_file(follow_symlinks=False):
                    continue  # only regular files are objects: reading a FIFO would block a worker
                try:
                    stat = entry.stat(follow_symlinks=False)
                except OSError:
                    continue  # removed meanwhile
                kind = KIND_PAGE if match.group(2) == "page" else KIND_SNAPSHOT
                found.append((stat.st_mtime_ns, (kind, bytes.fromhex(match.group(1))), stat.st_size))
        found.sort(key=lambda item: item[0])
        for _, object_id, size in found:
            self._index[object_id] = size = self._sizes.setdefault(size, size)
            self.used_bytes += size
        if found:
            self._last_stamp = found[-1][0]

    # -- queries ---------------------------------------------------------------------------------------------

    @property
    def num_objects(self) -> int:
        return len(self._index) - len(self._writing)

    def index_bytes(self) -> int:
        """The index (cache_memory.py): its table and a (kind, key) pair per object, bounded by the budget.
        The keys themselves are counted by the host tier, which holds the same key objects for what it
        wrote; the pins and recency marks are not counted (a leak there must show)."""
        return sys.getsizeof(self._index) + len(self._index) * _OBJECT_ID_BYTES

    def has(self, kind: int, key: bytes) -> bool:
        object_id = (kind, key)
        return object_id in self._index and object_id not in self._writing

    def busy(self) -> bool:
        """True while writes or reads are in flight."""
        return bool(self._futures)

    def reads_in_flight(self) -> bool:
        return self._reads > 0

    # -- writes ----------------------------------------------------------------------------------------------

    def submit_write(self, kind: int, key: bytes, payload: np.ndarray, before: Callable[[], None]) -> bool:
        """Queue a write of `payload` (a pinned host row the caller keeps pinned until the matching
        `DiskResult` comes back), after `before()` returns in the worker (it waits for the row's backup
        copy to finish). False, queuing nothing, when the object is on disk, being written, or cannot fit."""
        object_id = (kind, key)
        if not self.enabled or object_id in self._index or object_id in self._writing:
            return False
        size = object_file_size(payload.nbytes)
        size = self._sizes.setdefault(size, size)
        if self.used_bytes + self._reserved + size > self.budget_bytes:
            self._cleanup(size)
            if self.used_bytes + self._reserved + size > self.budget_bytes:
                return False
        if object_id in self._unlinking:  # evicted, its file not yet gone: the write replaces it instead
            with self._unlinking_lock:
                self._unlinking.discard(object_id)
        self._writing.add(object_id)
        self._reserved += size
        self._index[object_id] = size
        self._touch(object_id)
        future = self._writer.submit(str(object_path(self.dir, kind, key)), kind, key, payload, before)
        self._track(future, "write", kind, key, size)
        return True

    # -- reads -----------------------------------------------------------------------------------------------

    def submit_read(self, kind: int, key: bytes, out: np.ndarray) -> bool:
        """Queue a read of the object into `out` (a host row the caller keeps pinned until the result)."""
        object_id = (kind, key)
        if not self.enabled or not self.has(kind, key):
            return False
        self._pins[object_id] = self._pins.get(object_id, 0) + 1
        self._touch(object_id)
        path = object_path(self.dir, kind, key)
        self._reads += 1
        self._track(
            self._executor.submit(self._read_job, path, kind, key, out), "read", kind, key, out.nbytes
        )
        return True

    def _read_job(self, path: Path, kind: int, key: bytes, out: np.ndarray) -> None:
        read_object(path, kind, key, self.namespace, out)  # buffered: see read_object

    # -- recency ---------------------------------------------------------------------------------------------

    def touch_chain(self, keys: Sequence[bytes]) -> None:
        """Mark the objects of a prefix chain used now: `keys` are its page keys from the root, and at
        each one its page and the snapshot keyed by it (where present). The head ends most recently
        used and each page's snapshot just before it, so LRU evicts the chain from its end, a snapshot
        before its page: what stays is a prefix that still ends at a snapshot, a hit as deep as that."""
        if not self.enabled:
            return
        for key in reversed(keys):
            self._touch((KIND_SNAPSHOT, key))
            self._touch((KIND_PAGE, key))

    def _touch(self, object_id: ObjectId) -> None:
        if object_id in self._index:
            self._index.move_to_end(object_id)
            self._touched.add(object_id)

    def _save_recency(self) -> None:
        """Write the LRU order of the objects touched since the last save into their modification times,
        as consecutive nanosecond stamps newer than any before (touched objects are newer than the rest),
        in one worker job. Writes still in flight stay for the next save."""
        stamped: list[ObjectId] = []
        remaining = len(self._touched)
        for object_id in reversed(self._index):  # touched objects are the most recently used ones
            if not remaining:
                break
            if object_id in self._touched:
                remaining -= 1
                if object_id not in self._writing:
                    stamped.append(object_id)
        if not stamped:
            return
        self._touched.difference_update(stamped)
        first = max(time.time_ns(), self._last_stamp + 1)
        self._last_stamp = first + len(stamped) - 1
        stamped.reverse()  # least recently used first
        self._recency_job = self._executor.submit(_stamp_files, str(self.dir), stamped, first)

    # -- completion ------------------------------------------------------------------------------------------

    def poll(self, timeout: float | None = 0.0) -> list[DiskResult]:
        """Results of finished jobs; with a timeout > 0, first waits up to that long for all of them.

        All, not the first: the caller waits because it has nothing else to do, and every return costs it
        a scheduling pass over the waiting hit's pages while holding the GIL the workers need between
        their system calls. Returning at each completion made a 4,096-object restore crawl at one
        object per GIL switch interval (7 ms per object, 0.03 GB/s, on the H200 machine)."""
        if self._recency_job is not None and self._recency_job.done():
            self._recency_job = None
        if self._touched and self._recency_job is None and time.monotonic() >= self._next_recency_save:
            self._next_recency_save = time.monotonic() + RECENCY_SAVE_S
            self._save_recency()
        if not self._futures:
            return []
        if timeout:
            wait(list(self._futures), timeout=timeout, return_when="ALL_COMPLETED")
        results = []
        while not self._finished.empty():
            future = self._finished.get()
            results.append(self._finish(future, *self._futures.pop(future)))
        return results

    def _track(self, future: Future, op: str, kind: int, key: bytes, size: int) -> None:
        self._futures[future] = (op, kind, key, size)
        future.add_done_callback(self._finished.put)  # at once, here, when it is done already

    def _finish(self, future: Future, op: str, kind: int, key: bytes, size: int) -> DiskResult:
        object_id = (kind, key)
        error = future.exception()
        if op == "write":
            self._writing.discard(object_id)
            self._reserved -= size
            if error is None:
                self.used_bytes += size
                return DiskResult(op, kind, key, None, nbytes=size)
            del self._index[object_id]
            self._touched.discard(object_id)
            self._log(f"writing a cache object failed: {error}")
            if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
                self._cleanup(self.budget_bytes // 10)  # the disk filled before the budget did
            return DiskResult(op, kind, key, str(error))
        self._reads -= 1
        self._pins[object_id] -= 1
        if not self._pins[object_id]:
            del self._pins[object_id]
        if error is None:
            return DiskResult(op, kind, key, None, nbytes=size)
        corrupt = isinstance(error, CorruptObject)
        self._log(f"cache object {key.hex()}{'.page' if kind == KIND_PAGE else '.snap'} is a miss: {error}")
        self._remove([object_id])  # corrupt or unreadable: never try it again; a later backup rewrites it
        return DiskResult(op, kind, key, str(error), corrupt=corrupt)

    def _log(self, message: str) -> None:
        if self._errors_logged < _MAX_LOGGED_ERRORS:
            logger.warning(message)
        self._errors_logged += 1

    # -- cleanup ---------------------------------------------------------------------------------------------

    def _cleanup(self, incoming: int) -> None:
        """Evict least recently used unpinned objects until `incoming` more bytes fit under the low
        watermark (or nothing evictable is left)."""
        target = self.budget_bytes * LOW_WATERMARK - incoming - self._reserved
        if self.used_bytes <= target:
            return
        victims = []
        freed = 0
        for object_id, size in self._index.items():
            if self.used_bytes - freed <= target:
                break
            if object_id in self._pins or object_id in self._writing:
                continue
            victims.append(object_id)
            freed += size
        self._remove(victims)
        self.num_evicted += len(victims)

    def _remove(self, object_ids: list[ObjectId]) -> None:
        """Drop `object_ids` from the index now; one worker job unlinks their files."""
        removed = []
        for object_id in object_ids:
            size = self._index.pop(object_id, None)
            if size is None:
                continue
            self._touched.discard(object_id)
            self.used_bytes -= size
            removed.append(object_id)
        if removed:
            with self._unlinking_lock:
                self._unlinking.update(removed)
            self._executor.submit(self._unlink_job, removed)

    def _unlink_job(self, object_ids: list[ObjectId]) -> None:
        for object_id in object_ids:
            path = os.path.join(self.dir, object_relative_path(*object_id))
            with self._unlinking_lock:
                if object_id in self._unlinking:  # else written again since, or unlinked by an earlier job
                    with contextlib.suppress(OSError):  # gone already
                        os.unlink(path)
                    self._unlinking.discard(object_id)

    def close(self) -> list[DiskResult]:
        """Finish every queued job and stop the workers; returns the last results."""
        if self._executor is None:
            return []
        results = self.poll(timeout=None)
        while self._futures:
            results += self.poll(timeout=1.0)
        self._save_recency()  # every write is done: all of the order since the last save goes down
        self._writer.close()
        self._executor.shutdown(wait=True)
        self._executor = self._writer = None
        self.enabled = False
        return results


def automatic_budget(directory: Path, own_bytes: int) -> int:
    """The automatic disk budget: `AUTO_BUDGET_SHARE` of what the tier could use, the free space of the
    filesystem holding `directory` plus `own_bytes`, the namespace's objects already there. Counting
    them as used would shrink the budget at every restart (by half of the cache each time) and the
    start-up trim would evict what fitted before; counted as available, a restart with nothing else
    changed on the disk computes the same budget as the run that wrote them."""
    return int((shutil.disk_usage(directory).free + own_bytes) * AUTO_BUDGET_SHARE)


def _stamp_files(directory: str, objects: list[ObjectId], first_ns: int) -> None:
    """Set the modification times of `objects` (least recently used first) in the namespace `directory`
    to first_ns, first_ns + 1, ..."""
    for offset, (kind, key) in enumerate(objects):
        stamp = first_ns + offset
        with contextlib.suppress(OSError):  # evicted meanwhile
            os.utime(os.path.join(directory, object_relative_path(kind, key)), ns=(stamp, stamp))


def _components(items, shape_attr: str) -> list[dict]:
    return [
        {
            "name": c.name,
            "layers": c.num_layers,
            "shape": list(getattr(c, shape_attr)),
            "dtype": str(c.dtype).removeprefix("torch."),
        }
        for c in items
    ]


def open_disk_store(
    root: str | Path,
    model_identity: dict,
    info: dict,
    spec: CacheSpec,
    budget_bytes: int | None,
    num_threads: int = 4,
    direct_io: bool = False,
    budget_share: float = 1.0,
) -> DiskStore:
    """The disk tier for `spec`'s page and snapshot objects, in the namespace of `model_identity` (what
    the engine knows about the model: config and weights digests, dtype) plus what the cache itself
    determines: the format version, the page size, the CacheSpec and the exact byte layout of objects.
    `budget_bytes` None: the automatic budget (see `DiskStore`), times `budget_share`."""
    page_layout = ObjectLayout.for_pages(spec)
    identity = {
        "format_version": FORMAT_VERSION,
        **model_identity,
        "page_size": spec.page_size,
        "token_components": _components(spec.token_components, "token_shape"),
        "state_components": _components(spec.state_components, "shape"),
        "page_object": [*page_layout.describe(), {"row_bytes": page_layout.row_bytes}],
        "snapshot_object": None,
    }
    payload = {KIND_PAGE: page_layout.row_bytes}
    if spec.has_state:
        snapshot_layout = ObjectLayout.for_snapshots(spec)
        identity["snapshot_object"] = [*snapshot_layout.describe(), {"row_bytes": snapshot_layout.row_bytes}]
        payload[KIND_SNAPSHOT] = snapshot_layout.row_bytes
    return DiskStore(Path(root), identity, info, budget_bytes, payload, num_threads, direct_io, budget_share)
