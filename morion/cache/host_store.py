"""The host tier's storage: page-major objects in one (pinned) arena, indexed by key, evicted LRU.

An *object* is a page of every token component (all layers), or one state snapshot of every state
component, laid out as one contiguous row of bytes (`ObjectLayout`): the unit the copy engine moves, and
the payload of one disk file. The store is used by the engine thread only; disk worker threads read or
fill rows that the engine thread pinned for them.
"""

from __future__ import annotations

import math
import sys
from collections import OrderedDict
from collections.abc import Iterator

import numpy as np
import torch

from morion.cache.page_keys import KEY_BYTES
from morion.cache.spec import CacheSpec

_ALIGN = 64  # every part starts 64-byte aligned, so a dtype view of it is always legal (and vectorises)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class ObjectLayout:
    """Named parts `(name, shape, dtype)` packed into one row of bytes, each part 64-byte aligned."""

    def __init__(self, parts: list[tuple[str, tuple[int, ...], torch.dtype]]) -> None:
        self.parts = parts
        self.offsets: dict[str, int] = {}
        offset = 0
        for name, shape, dtype in parts:
            self.offsets[name] = offset
            offset = _round_up(offset + math.prod(shape) * dtype.itemsize, _ALIGN)
        self.row_bytes = max(offset, _ALIGN)

    @classmethod
    def for_pages(cls, spec: CacheSpec) -> ObjectLayout:
        """One page: per token component `[num_layers, page_size, *token_shape]`."""
        return cls(
            [(c.name, (c.num_layers, spec.page_size, *c.token_shape), c.dtype) for c in spec.token_components]
        )

    @classmethod
    def for_snapshots(cls, spec: CacheSpec) -> ObjectLayout:
        """One state snapshot: per state component `[num_layers, *shape]`."""
        return cls([(c.name, (c.num_layers, *c.shape), c.dtype) for c in spec.state_components])

    def views(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per part, a typed view `[N, *shape]` into `rows` (uint8 `[N, row_bytes]`, any device)."""
        views = {}
        for name, shape, dtype in self.parts:
            start = self.offsets[name]
            size = math.prod(shape) * dtype.itemsize
            views[name] = rows[:, start : start + size].view(dtype).view(rows.shape[0], *shape)
        return views

    def describe(self) -> list[dict]:
        """For the disk manifest: what a row holds, exactly."""
        return [
            {
                "name": name,
                "shape": list(shape),
                "dtype": str(dtype).removeprefix("torch."),
                "offset": self.offsets[name],
            }
            for name, shape, dtype in self.parts
        ]


class HostEntry:
    """One object in the host arena. `ready`: its row holds the object (in copy-stream order for a backup
    still in flight). `pins`: copies or disk I/O that use the row right now; a pinned row is never evicted
    or reused (copy rule 1). `from_disk`: filled by a disk read and not yet restored from."""

    __slots__ = ("from_disk", "pins", "ready", "row")

    def __init__(self, row: int) -> None:
        self.row = row
        self.pins = 0
        self.ready = False
        self.from_disk = False


_ENTRY_AND_KEY_BYTES = sys.getsizeof(HostEntry(0)) + sys.getsizeof(bytes(KEY_BYTES))


class HostObjectStore:
    """`num_rows` objects of `layout` in one arena (pinned when `pin_memory`), LRU over unpinned rows."""

    def __init__(self, layout: ObjectLayout, num_rows: int, pin_memory: bool = False) -> None:
        if num_rows < 1:
            raise ValueError(f"a host store needs at least one row, got {num_rows}")
        self.layout = layout
        self.num_rows = num_rows
        # Empty, not zeroed: touching every byte of a large pinned arena at startup costs seconds, and a
        # row is always written (backup or disk read) before it is marked ready.
        self.arena = torch.empty((num_rows, layout.row_bytes), dtype=torch.uint8, pin_memory=pin_memory)
        self.views = layout.views(self.arena)
        self._free = list(range(num_rows - 1, -1, -1))  # a stack: a fresh store fills rows 0, 1, 2, ...
        self._entries: OrderedDict[bytes, HostEntry] = OrderedDict()  # least recently used first
        self.num_evicted = 0

    @property
    def num_bytes(self) -> int:
        return self.num_rows * self.layout.row_bytes

    @property
    def num_used(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._entries)

    def get(self, key: bytes) -> HostEntry | None:
        return self._entries.get(key)

    def touch(self, key: bytes) -> None:
        """Mark `key` most recently used."""
        self._entries.move_to_end(key)

    def reserve(self, key: bytes) -> HostEntry | None:
        """A row for a new object `key`, evicting the least recently used unpinned object if none is free;
        None when every row is pinned. The entry comes back pinned once and not ready: the caller fills
        the row, marks it ready and unpins it."""
        if key in self._entries:
            raise KeyError("object is already in the host store")
        if not self._free and not self.evict(1):
            return None
        entry = HostEntry(self._free.pop())
        entry.pins = 1
        self._entries[key] = entry
        return entry

    def evict(self, count: int) -> int:
        """Drop up to `count` unpinned objects, least recently used first; returns how many went."""
        victims = []
        for key, entry in self._entries.items():
            if len(victims) == count:
                break
            if entry.pins == 0:
                victims.append(key)
        for key in victims:
            self._free.append(self._entries.pop(key).row)
        self.num_evicted += len(victims)
        return len(victims)

    def pin(self, key: bytes) -> HostEntry:
        entry = self._entries[key]
        entry.pins += 1
        return entry

    def unpin(self, key: bytes) -> None:
        entry = self._entries[key]
        if entry.pins <= 0:
            raise RuntimeError("unpin of a host object that is not pinned")
        entry.pins -= 1

    def drop(self, key: bytes) -> None:
        """Remove `key` (a failed disk read, say). Only its last pin holder may drop it."""
        entry = self._entries[key]
        if entry.pins > 1:
            raise RuntimeError("drop of a host object that others still use")
        del self._entries[key]
        self._free.append(entry.row)

    def index_bytes(self) -> int:
        """The index (cache_memory.py): its table and, per object, an entry and a page key (row numbers
        are the free list's own ints). At most `num_rows` objects."""
        return sys.getsizeof(self._entries) + len(self._entries) * _ENTRY_AND_KEY_BYTES

    def row_array(self, entry: HostEntry) -> np.ndarray:
        """The entry's row as a numpy byte array sharing the arena's memory (for disk worker threads)."""
        return self.arena[entry.row].numpy()

    def check_integrity(self) -> None:
        rows = [e.row for e in self._entries.values()] + self._free
        if sorted(rows) != list(range(self.num_rows)):
            raise RuntimeError("host store rows are lost or double-booked")
