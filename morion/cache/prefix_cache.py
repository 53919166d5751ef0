"""The prefix-cache contract: what the scheduler may rely on, and when a result is safe to use.

Ownership, in one place. Every page is in exactly one of: the page pool's free list, the prefix cache,
or a running request. Every state slot likewise: the free list, the cache (as a snapshot), or a request.
Pages and slots move between them only through these calls:

- `match_prefix` moves nothing. It lends the cache's pages and snapshot to the caller, and the loan is
  only safe while the matched node is locked.
- `insert` moves the caller's pages for the newly cached span (and, if attached, its snapshot slot)
  into the cache. Everything it did not take stays with the caller (see `InsertResult`).
- `evict` / `evict_snapshots` move unlocked pages and snapshot slots from the cache to the free lists.

A node is an opaque handle: pass it back to `lock`/`unlock`, and never read its pages after an unlock.

Sequences live in key chains (`chain_root`, page_keys.py): the zero root, or a cache salt's. A match
finds only what was inserted in the same chain, so requests with different salts share no page.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch

from morion.cache.page_keys import ROOT_KEY


class CacheIntegrityError(RuntimeError):
    """The cache's bookkeeping is inconsistent: a bug, never a user error."""


class PrefixMatch(NamedTuple):
    """The deepest usable cached prefix of a sequence.

    `pages` are the cache's pages for the first `num_tokens` tokens (`num_tokens == len(pages) *
    page_size`); `snapshot_slot` is the state slot holding the state after exactly `num_tokens` tokens, or
    None when the spec has no state or nothing matched (`num_tokens == 0`: start from the zero state).
    Both are lent, not given: safe to use only while `node` is locked.
    """

    node: object
    num_tokens: int
    pages: list[int]
    snapshot_slot: int | None
    # The matched pages' content keys (page_keys.py), where the cache was given them with every page of
    # the match; else None (hash the tokens). A long conversation's next turn reads them here instead of
    # hashing its whole prefix again (32K tokens: 2.3 ms on the CPU, 256K: 33 ms).
    page_keys: list[bytes] | None = None


class InsertResult(NamedTuple):
    """What `insert(token_ids, pages, snapshot_slot)` did, with n = len(token_ids) rounded down to a page.

    - `num_cached_tokens`: how many of the n tokens were already cached. The cache took
      `pages[num_cached_tokens // page_size : n // page_size]`; those now belong to it.
    - `duplicate_pages`: the caller's pages within `pages[: num_cached_tokens // page_size]` that differ
      from the cache's page at the same position. They were not taken and still belong to the caller,
      which frees them (or keeps using them and frees them later). The other pages in that span are the
      cache's own (the caller got them from a match or an earlier insert): never free those.
    - `pages[n // page_size:]` (a partial last page and beyond) were not looked at: still the caller's.
    - `unused_snapshot_slot`: the snapshot slot passed in when the cache already had a snapshot at that
      position (it keeps its own), else None. An unused slot still belongs to the caller.
    - `node`: the node ending exactly at n tokens. A caller that keeps running after inserting (chunked
      prefill) locks it before unlocking the node it held: the pages the cache took are still in use and
      are evictable as soon as nothing locks them.
    """

    num_cached_tokens: int
    unused_snapshot_slot: int | None
    duplicate_pages: list[int]
    node: object


class PrefixCache(ABC):
    """A page-aligned prefix cache over token ids. Only whole pages are ever matched or inserted."""

    @abstractmethod
    def match_prefix(
        self, token_ids: Sequence[int] | torch.Tensor, chain_root: bytes = ROOT_KEY
    ) -> PrefixMatch:
        """The deepest prefix of `token_ids`, in the chain `chain_root`, that every cache component covers.

        For a spec with state components that is the deepest matched node carrying a state snapshot:
        cached pages past it are not usable because the state after them is unknown. Otherwise it is the
        deepest page-aligned match. A match may cover every token; a caller that needs logits for the last
        token matches `token_ids[:-1]`.

        Changes no ownership, but marks the matched path as recently used and may split a node, which
        leaves every existing handle valid. The result is safe to use only after `lock(result.node)`,
        and until the matching `unlock`; between the match and the lock, do not evict.
        """

    @abstractmethod
    def lock(self, node: object) -> None:
        """Protect `node` and its path to the root from eviction, and `node`'s snapshot from
        `evict_snapshots`. Locks nest: each lock needs one unlock. Locking the root is a no-op."""

    @abstractmethod
    def unlock(self, node: object) -> None:
        """Undo one `lock(node)`. Raises RuntimeError if `node` holds no lock."""

    @abstractmethod
    def insert(
        self,
        token_ids: Sequence[int] | torch.Tensor,
        pages: Sequence[int],
        snapshot_slot: int | None = None,
        chain_root: bytes = ROOT_KEY,
    ) -> InsertResult:
        """Cache the whole-page prefix of `token_ids`, whose page table is `pages`, in the chain
        `chain_root`.

        `snapshot_slot`, if given, holds the state after exactly `len(token_ids)` tokens, which must then
        be a positive multiple of the page size; it is attached to the node ending there unless that node
        already has a snapshot. Ownership of pages and the slot is spelled out on `InsertResult`.
        """

    @abstractmethod
    def evict(self, num_pages: int) -> int:
        """Free at least `num_pages` pages (whole nodes, so possibly more) by dropping unlocked leaves,
        least recently used first, together with their snapshots. Returns the number of pages freed: less
        than asked only when nothing evictable is left. `evict(0)` does nothing."""

    @abstractmethod
    def evict_snapshots(self, num_slots: int) -> int:
        """Free up to `num_slots` snapshot slots of nodes not locked themselves, least recently used first.
        The nodes keep their pages ("tombstones"); a tombstone is never the end of a state-spec match.
        Returns the number of slots freed."""

    @property
    @abstractmethod
    def cached_pages(self) -> int:
        """Pages the cache owns."""

    @property
    @abstractmethod
    def evictable_pages(self) -> int:
        """Pages `evict` could free now (those of unlocked nodes)."""

    @property
    @abstractmethod
    def cached_snapshots(self) -> int:
        """State slots the cache owns as snapshots."""

    @abstractmethod
    def index_bytes(self) -> int:
        """Host memory the index itself holds (cache_memory.py); the K/V and state live in the pools."""

    @abstractmethod
    def check_integrity(
        self, pages_held_by_requests: Iterable[int] = (), slots_held_by_requests: Iterable[int] = ()
    ) -> None:
        """Check the cache against its pools: every page and state slot is in exactly one place (free list,
        cache, or the given request holdings), lock counts and sizes are consistent. Raises
        CacheIntegrityError naming the first violation. O(cache size + pool size): for tests and idle time.
        """
