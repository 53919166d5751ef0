"""The device page pool: storage for every per-token component, handed out in whole pages."""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from morion.cache.spec import CacheSpec


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`torch.zeros`, but on the CPU from calloc (numpy's zeros), whose large blocks are fresh pages the
    kernel zeroes on first touch: a 1 GiB pool costs nothing until it is used, where torch.zeros writes
    every byte first (1.1 s on the 2-core CPU, most of a default start-up)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    num_bytes = math.prod(shape) * dtype.itemsize
    return torch.from_numpy(np.zeros(num_bytes, dtype=np.uint8)).view(dtype).view(shape)


class PagePool:
    """Fixed storage for `num_pages` pages of every token component of `spec`, and their free list.

    Storage of a component is one tensor `[num_layers, num_pages * page_size, *token_shape]`, flat and
    token-major: token slot `page * page_size + offset` holds that token of every layer, so attention
    kernels index token slots directly and one page table (a list of pages) serves every component.

    A page is in exactly one place at a time: this pool's free list, the prefix cache, or a running
    request. The pool only knows the free list; `RadixCache.check_integrity` checks the whole picture.
    """

    def __init__(self, spec: CacheSpec, num_pages: int, device: torch.device | str = "cpu") -> None:
        if not isinstance(num_pages, int) or num_pages < 1:
            raise ValueError(f"num_pages must be an int >= 1, got {num_pages!r}")
        self.spec = spec
        self.device = torch.device(device)
        self._num_pages = num_pages
        num_token_slots = num_pages * spec.page_size
        # Zeroed, not empty: kernels may read masked-out slots of a page, and garbage NaNs there would
        # survive a multiplication by zero.
        self._storage = {
            c.name: zeroed((c.num_layers, num_token_slots, *c.token_shape), c.dtype, self.device)
            for c in spec.token_components
        }
        # A stack, highest page at the bottom: a fresh pool hands out pages 0, 1, 2, ... and reuses the
        # most recently freed pages first.
        self._free = list(range(num_pages - 1, -1, -1))
        self._is_free = bytearray(b"\x01") * num_pages

    @property
    def page_size(self) -> int:
        return self.spec.page_size

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_bytes(self) -> int:
        """Device bytes held by the storage tensors."""
        return self._num_pages * self.spec.bytes_per_page

    def storages(self) -> list[torch.Tensor]:
        return list(self._storage.values())

    def storage(self, name: str) -> torch.Tensor:
        """Storage of token component `name`: `[num_layers, num_pages * page_size, *token_shape]`."""
        try:
            return self._storage[name]
        except KeyError:
            raise KeyError(f"no token component {name!r}; the spec has {sorted(self._storage)}") from None

    def alloc(self, num_pages: int) -> list[int] | None:
        """Take `num_pages` pages off the free list, or None (taking nothing) when fewer are free.

        The pages' contents are whatever their previous owner left: the caller writes before it reads.
        """
        if num_pages < 0:
            raise ValueError(f"cannot allocate {num_pages} pages")
        if num_pages > len(self._free):
            return None
        if num_pages == 0:
            return []
        pages = self._free[-num_pages:]
        del self._free[-num_pages:]
        pages.reverse()
        for page in pages:
            self._is_free[page] = 0
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Return pages to the free list. All or nothing: a bad page raises before any page is freed.

        Raises ValueError for a page outside the pool and RuntimeError for a page that is already free
        (or listed twice): both mean the caller's bookkeeping is broken.
        """
        pages = [operator.index(p) for p in pages]
        for page in pages:
            if not 0 <= page < self._num_pages:
                raise ValueError(f"page {page} is not in this pool of {self._num_pages} pages")
            if self._is_free[page]:
                raise RuntimeError(f"double free of page {page}: it is already free")
        if len(set(pages)) != len(pages):
            raise RuntimeError(f"double free: pages listed more than once in {pages}")
        for page in pages:
            self._is_free[page] = 1
        self._free.extend(pages)

    def is_free(self, page: int) -> bool:
        return bool(self._is_free[page])

    def free_pages(self) -> list[int]:
        """A copy of the free list (O(num_pages); for integrity checks and debugging)."""
        return list(self._free)

    def token_slots(self, pages: Sequence[int], num_tokens: int) -> torch.Tensor:
        """Flat token-slot indices (int64, on the pool's device) of the first `num_tokens` tokens of a
        sequence whose page table is `pages`."""
        ps = self.page_size
        num_used_pages = -(-num_tokens // ps)
        if num_tokens < 0 or num_used_pages > len(pages):
            raise ValueError(f"{num_tokens} tokens do not fit in {len(pages)} pages of {ps} tokens")
        page_ids = torch.tensor(list(pages[:num_used_pages]), dtype=torch.int64, device=self.device)
        offsets = torch.arange(ps, dtype=torch.int64, device=self.device)
        return (page_ids[:, None] * ps + offsets).reshape(-1)[:num_tokens]
