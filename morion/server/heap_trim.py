"""Give the engine's freed heap memory back to the OS when it goes idle (glibc's `malloc_trim`).

glibc returns freed memory only from the top of a heap, and only past a trim threshold that rises with
every large block freed (the dynamic mmap threshold, up to 32 MiB); what is freed below a live block
stays resident. A step's transient buffers (prompt tensors, page tables, copy indices, on the CPU the
whole forward's activations) are freed but kept so: measured in the engine process on the CPU, 40
conversations of up to 2,000 tokens left the heap 61 MiB larger with 8 MiB of it in use. `malloc_trim(0)`
hands back the free pages of every arena (madvise): 0.4 to 14 ms there, which is why the engine waits
for a second of idleness first. Elsewhere (musl, macOS) there is no such call and nothing is done.
"""

from __future__ import annotations

import ctypes

from morion.libc import libc_function

HEAP_TRIM_IDLE_S = 1.0  # the engine trims once it has been idle this long (process.serve)


def release_free_heap() -> bool:
    """Return free heap pages to the OS; True where the C library could (glibc)."""
    trim = libc_function("malloc_trim", ctypes.c_int, (ctypes.c_size_t,))
    if trim is None:
        return False
    trim(0)
    return True
