"""What the caches say they hold (`index_bytes`, `storage_resident_bytes`): what a soak subtracts from the
growth of resident memory before calling the rest a leak. It must never claim more than is really held
(that would hide a leak), and must follow the index as it fills and empties."""

from __future__ import annotations

import gc
import mmap
import os
import random
import subprocess
import sys
import textwrap
import tracemalloc

import pytest
import torch

from morion.cache import CacheSpec, PagePool, RadixCache, TokenComponent
from morion.cache.cache_memory import storage_resident_bytes
from morion.cache.disk_store import open_disk_store
from morion.cache.host_store import HostObjectStore, ObjectLayout
from morion.cache.page_keys import page_keys

SPEC = CacheSpec(16, (TokenComponent("kv", 1, (1, 1, 4), torch.float32),), ())


def _traced(fill) -> tuple[int, object]:
    """(bytes still allocated by `fill()` when it returns, its result). A full collection first empties the
    free lists (tuples, dicts): an object taken from one is no allocation tracemalloc sees."""
    gc.collect()
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        result = fill()
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return after - before, result


def _keys(count: int) -> list[bytes]:
    rng = random.Random(0)
    return page_keys([rng.randrange(150_000) for _ in range(count * 16)], 16)


def test_radix_tree_index_bytes_are_what_it_holds() -> None:
    pool = PagePool(SPEC, 4096)
    cache = RadixCache(pool)
    empty = cache.index_bytes()
    rng = random.Random(0)

    def fill() -> None:
        for _ in range(64):
            cache.insert([rng.randrange(150_000) for _ in range(512)], pool.alloc(32))

    held, _ = _traced(fill)
    claimed = cache.index_bytes() - empty
    assert 0.7 * held <= claimed <= 1.05 * held, (claimed, held)  # getsizeof: no allocator rounding
    cache.evict(cache.cached_pages)
    assert cache.index_bytes() < empty + 0.05 * claimed  # the root's child table keeps its size


def test_host_and_disk_index_bytes_are_what_they_hold(tmp_path) -> None:
    store = HostObjectStore(ObjectLayout.for_pages(SPEC), 6000)
    disk = open_disk_store(tmp_path, {"model": "m"}, {}, SPEC, budget_bytes=2**30)
    keys = _keys(5000)
    host_empty, disk_empty = store.index_bytes(), disk.index_bytes()

    def fill() -> None:
        for key in keys:  # fresh key objects, as page_keys makes them for each request
            key = key[:16] + key[16:]
            store.reserve(key).pins = 0
            disk._index[(1, key)] = disk._sizes.setdefault(4096, 4096)  # the index alone, no files

    held, _ = _traced(fill)
    claimed = store.index_bytes() - host_empty + disk.index_bytes() - disk_empty
    assert 0.7 * held <= claimed <= 1.05 * held, (claimed, held)
    store.evict(5000)
    assert store.index_bytes() < host_empty + 0.5 * claimed  # the table keeps its size; entries go
    disk.close()


def test_storage_counts_the_pages_written_so_far() -> None:
    page = os.sysconf("SC_PAGE_SIZE")
    # A fresh anonymous mapping: nothing resident yet. (`torch.empty` may be given heap memory that an
    # earlier test in this worker already touched: CI saw 58 MiB of 64 resident.)
    mapping = mmap.mmap(-1, 64 * 2**20)
    storage = torch.frombuffer(mapping, dtype=torch.uint8)
    assert storage_resident_bytes([storage]) < 2**20
    storage[: 16 * 2**20].fill_(1)
    assert abs(storage_resident_bytes([storage[: 2**20]]) - 16 * 2**20) <= 2 * page  # the whole storage
    assert storage_resident_bytes([torch.empty(8, device="meta")]) == 0  # not in this process's memory


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_idle_trim_returns_freed_heap_memory() -> None:
    """Blocks of 200 KB freed below a live one stay in glibc's heap (the mmap threshold set above them);
    release_free_heap hands them back. In a fresh process, so the heap is only this one's."""
    script = textwrap.dedent(
        """
        import ctypes
        from morion.server.heap_trim import release_free_heap

        def resident():
            with open("/proc/self/statm") as statm:
                return int(statm.read().split()[1]) * 4096

        libc = ctypes.CDLL("libc.so.6")
        libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
        libc.free.argtypes = [ctypes.c_void_p]
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: 200 KB blocks come from the heap, whatever ran before
        blocks = [libc.malloc(200_000) for _ in range(401)]
        for block in blocks:
            ctypes.memset(block, 1, 200_000)
        for block in blocks[:-1]:  # the last stays live above them: the heap's top cannot shrink past it
            libc.free(block)
        before = resident()
        assert release_free_heap()
        print((before - resident()) // 2**20)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert int(out.stdout) >= 40, out.stdout
