"""What the caches hold in host memory by design: bounded by their capacity, so never a leak.

`morion validate soak` subtracts the growth of this figure from the growth of resident memory
(docs/validate.md): a soak beside a restore suite fills the tiers, and filling a bounded index is not a
leak. Counted:

- index entries, from the sizes Python reports for their objects (`sys.getsizeof`, without the
  allocator's rounding): the device radix tree's nodes, the host tier's entries and the disk tier's
  index, each bounded by its tier's capacity. Bookkeeping with no such bound (pins, recency marks) is
  not counted, so a leak there still shows.
- the resident part of preallocated storage in the engine process's memory: a CPU engine's KV pool and
  state slots and its host arenas, which the OS maps in as they are first written (`mincore`). A pinned
  arena (CUDA) is resident from the start: all of it counts, always the same.
"""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Iterable

import numpy as np
import torch

from morion.libc import libc_function


def storage_resident_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of `tensors` (their storages) resident in this process's memory; device tensors count 0."""
    total = 0
    for tensor in tensors:
        if tensor.device.type != "cpu":
            continue
        storage = tensor.untyped_storage()
        if tensor.is_pinned():
            total += storage.nbytes()
        else:
            total += _resident(storage.data_ptr(), storage.nbytes())
    return total


def _resident(address: int, length: int) -> int:
    """Resident bytes of [address, address + length), by whole pages (0 where `mincore` is missing)."""
    mincore = libc_function("mincore", ctypes.c_int, (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p))
    if mincore is None or length <= 0:
        return 0
    page = mmap.PAGESIZE
    start = address // page * page
    pages = -(-(address + length - start) // page)
    vector = np.zeros(pages, dtype=np.uint8)
    if mincore(start, pages * page, vector.ctypes.data):
        return 0
    return int(np.count_nonzero(vector & 1)) * page
