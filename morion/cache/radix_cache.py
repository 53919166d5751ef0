"""The device-tier radix tree: a page-aligned prefix cache over token ids with optional state snapshots.

Tree invariants (checked by `check_integrity`):

- A non-root node holds a run of whole pages: `num_tokens == len(pages) * page_size`, at least one
  page. A parent keys its children by their first page of token ids, so siblings differ in it.
- Every node belongs to one key chain, `chain_root` (page_keys.py: the zero root, or a cache salt's),
  as its parent does; the root keys its children by chain root and first page. Sequences of different
  chains (salts) therefore never share a node, and the chain root is what write-back hashes from.
- Token ids are stored packed, 8 bytes each (uint64, `bytes`): a node costs 8 bytes a token, where a
  tuple of Python ints cost about 40 (a pointer and an int object per token, ids above 256 not being
  shared). Bytes compare with memcmp, so matching is faster too, and stays exact. 8, not 4: an image's
  tokens are keyed by ids above 2**32 derived from its content hash (`multimodal/prompt_images.py`).
- `ref_count` of a node = its own locks + the sum of its children's `ref_count`: a lock counts on the
  whole path to the root. A node with `ref_count > 0` is never evicted; one with `ref_count == 0` has an
  unlocked subtree, so all its pages are evictable (leaf first).
- `snapshot_slot` holds the state after the node's *last* token. Splitting a node keeps the snapshot on
  the lower half (same end position) and gives the upper half none: state is never copied or guessed.
  The lower half stays the same object, so handles to it (and its locks) survive a split.
- A node without a snapshot in a state spec is a "tombstone" (or was inserted without one): its pages
  serve deeper snapshots but a match never ends there.
- `page_keys`, where known, are the content keys of the node's pages (page_keys.py: each a hash of its
  chain root and every token up to the page's end), one per page; None where no insert gave them. A key
  is a function of the tokens on the path and the chain root alone, which every sequence through the node
  shares, so keys given by any insert are right for every later match.
"""

from __future__ import annotations

import heapq
import itertools
import sys
from array import array
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import torch

from morion.cache.page_keys import ROOT_KEY
from morion.cache.page_pool import PagePool
from morion.cache.prefix_cache import CacheIntegrityError, InsertResult, PrefixCache, PrefixMatch
from morion.cache.state_slots import StateSlots


class RadixNode:
    """One edge of the tree: a run of whole pages of token ids, the pages that hold them, and at most one
    state snapshot (valid after its last token)."""

    __slots__ = (
        "chain_root",
        "children",
        "last_access",
        "node_id",
        "own_locks",
        "page_keys",
        "pages",
        "parent",
        "ref_count",
        "snapshot_slot",
        "token_ids",
    )

    def __init__(
        self, token_ids: bytes, pages: list[int], parent: RadixNode | None, node_id: int, chain_root: bytes
    ):
        self.token_ids = token_ids  # packed uint64, TOKEN_BYTES a token
        self.pages = pages
        self.page_keys: list[bytes] | None = None  # the pages' content keys, where an insert gave them
        self.parent = parent  # None for the root, and for a node after it was evicted
        self.children: dict[bytes, RadixNode] = {}  # by their first page of packed token ids
        self.ref_count = 0
        self.own_locks = 0
        self.snapshot_slot: int | None = None
        self.last_access = 0
        self.node_id = node_id  # tie-break for equal access times: deterministic eviction order
        self.chain_root = chain_root  # the key chain its tokens belong to (page_keys.chain_root)

    @property
    def num_pages(self) -> int:
        return len(self.pages)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) // TOKEN_BYTES

    def __repr__(self) -> str:
        return (
            f"RadixNode(id={self.node_id}, pages={self.pages}, ref={self.ref_count}, "
            f"snapshot={self.snapshot_slot})"
        )


TOKEN_BYTES = 8
TOKEN_TYPECODE = "Q"  # array's C unsigned long long: what a request packs its ids as
_TOKEN_DTYPE = np.dtype(np.uint64)  # native order, as array("Q") packs
if array(TOKEN_TYPECODE).itemsize != TOKEN_BYTES:
    raise ImportError("the radix cache packs token ids as C unsigned long long, which is not 8 bytes here")


def pack_tokens(token_ids: Sequence[int] | torch.Tensor) -> bytes:
    """Token ids (and image keys, below 2**64) packed as uint64. An `array("Q")` (what a request keeps,
    `Request.packed_token_ids`) is packed already: a copy of its bytes."""
    if isinstance(token_ids, array) and token_ids.typecode == TOKEN_TYPECODE:
        return token_ids.tobytes()
    if isinstance(token_ids, torch.Tensor):
        values = token_ids.numpy(force=True)
        if values.size and values.min() < 0:
            raise OverflowError("token ids must be in [0, 2**64)")
        return values.astype(_TOKEN_DTYPE).tobytes()
    return array(
        TOKEN_TYPECODE, token_ids
    ).tobytes()  # 3x faster than numpy from a list; OverflowError below 0


EvictListener = Callable[[Sequence[int], list[int], "int | None", bytes], None]


class RadixCache(PrefixCache):
    """The radix tree over `page_pool`'s pages; snapshots live in `state_slots` (required exactly when the
    spec has state components). Eviction frees pages and slots straight into those pools.

    `evict_listener(prefix_tokens, pages, snapshot_slot, chain_root)`, if set, is called just before a
    node's pages and snapshot (or its snapshot alone, with no pages) go back to the free lists:
    `prefix_tokens` are the tokens from the root to the node's end, `pages` the node's own (the last ones
    of that prefix), `chain_root` its chain's. The host tier's write-back policy copies them out there;
    the pages are free as soon as it returns.
    """

    def __init__(self, page_pool: PagePool, state_slots: StateSlots | None = None) -> None:
        spec = page_pool.spec
        if spec.has_state and state_slots is None:
            raise ValueError("the spec has state components: the radix cache needs its StateSlots")
        if state_slots is not None and state_slots.spec != spec:
            raise ValueError("page_pool and state_slots were built for different CacheSpecs")
        self.page_pool = page_pool
        self.state_slots = state_slots
        self.spec = spec
        self.page_size = spec.page_size
        self._node_ids = itertools.count()
        self._clock = 0  # logical time for LRU: bumped once per match/insert
        self.root = RadixNode(b"", [], None, next(self._node_ids), ROOT_KEY)  # the root of every chain
        self._cached_pages = 0
        self._evictable_pages = 0
        self._cached_snapshots = 0
        self.evict_listener: EvictListener | None = None

    # -- queries ------------------------------------------------------------------------------------------

    @property
    def cached_pages(self) -> int:
        return self._cached_pages

    @property
    def evictable_pages(self) -> int:
        return self._evictable_pages

    @property
    def cached_snapshots(self) -> int:
        return self._cached_snapshots

    def match_prefix(
        self, token_ids: Sequence[int] | torch.Tensor, chain_root: bytes = ROOT_KEY
    ) -> PrefixMatch:
        tokens = pack_tokens(token_ids)
        node, partial_child, partial_pages = self._walk(tokens, chain_root)
        if self.spec.has_state:
            # Only a node with a snapshot is a valid end; a snapshot is always at a node's end, so no split.
            while node is not self.root and node.snapshot_slot is None:
                node = node.parent
        elif partial_child is not None:
            node = self._split(partial_child, partial_pages)
        path = self._path(node)
        self._clock += 1
        for n in path:
            n.last_access = self._clock
        pages = [page for n in path for page in n.pages]
        keys = None
        if all(n.page_keys is not None for n in path):
            keys = [key for n in path for key in n.page_keys]
        return PrefixMatch(node, len(pages) * self.page_size, pages, node.snapshot_slot, keys)

    # -- locks --------------------------------------------------------------------------------------------

    def lock(self, node: object) -> None:
        path = self._path(node)
        for n in path:
            if n.ref_count == 0:
                self._evictable_pages -= n.num_pages
            n.ref_count += 1
        if path:
            path[-1].own_locks += 1

    def unlock(self, node: object) -> None:
        path = self._path(node)
        if not path:
            return
        if path[-1].own_locks == 0:
            raise RuntimeError(f"unlock of {path[-1]!r}, which holds no lock")
        path[-1].own_locks -= 1
        for n in path:
            n.ref_count -= 1
            if n.ref_count == 0:
                self._evictable_pages += n.num_pages

    # -- insert -------------------------------------------------------------------------------------------

    def insert(
        self,
        token_ids: Sequence[int] | torch.Tensor,
        pages: Sequence[int],
        snapshot_slot: int | None = None,
        chain_root: bytes = ROOT_KEY,
        page_keys: Sequence[bytes] | None = None,
    ) -> InsertResult:
        """`page_keys`: the content keys of the full pages of `token_ids` in `chain_root`'s chain (at least
        one per page), for the nodes to keep (`PrefixMatch.page_keys`); None where the caller has none."""
        ps = self.page_size
        tokens = pack_tokens(token_ids)
        num_tokens = len(tokens) // TOKEN_BYTES
        n = num_tokens // ps * ps
        if len(pages) < n // ps:
            raise ValueError(f"{num_tokens} tokens need {n // ps} full pages, got {len(pages)} pages")
        if page_keys is not None and len(page_keys) < n // ps:
            raise ValueError(f"{num_tokens} tokens need {n // ps} page keys, got {len(page_keys)}")
        if snapshot_slot is not None:
            if self.state_slots is None:
                raise ValueError("a snapshot was given but the spec has no state components")
            if n == 0 or num_tokens != n:
                raise ValueError(
                    f"a snapshot needs a positive page-aligned length, got {num_tokens} tokens (page {ps})"
                )
            if self.state_slots.is_free(snapshot_slot):
                raise RuntimeError(f"snapshot slot {snapshot_slot} is free: the caller does not own it")
        page_bytes = ps * TOKEN_BYTES
        end = n * TOKEN_BYTES
        self._clock += 1
        node, pos, page, duplicate_pages = self.root, 0, 0, []  # pos in bytes, page = pos // page_bytes
        while pos < end:
            child = node.children.get(self._child_key(node, tokens[pos : pos + page_bytes], chain_root))
            if child is None:
                break
            num_matched = self._matched_pages(child, tokens, pos, end)
            if num_matched < child.num_pages:
                # Diverges inside child, or ends there: either way a node must end at this position.
                child = self._split(child, num_matched)
            # The caller's pages where the cache already has (other) pages: still the caller's to free.
            mine = pages[page : page + num_matched]
            duplicate_pages += [p for p, cached in zip(mine, child.pages, strict=True) if p != cached]
            if child.page_keys is None and page_keys is not None:
                child.page_keys = list(page_keys[page : page + num_matched])
            child.last_access = self._clock
            node, pos, page = child, pos + num_matched * page_bytes, page + num_matched
        num_cached_tokens = page * ps
        if pos < end:
            node = self._add_leaf(node, tokens[pos:end], list(pages[page : n // ps]), chain_root)
            if page_keys is not None:
                node.page_keys = list(page_keys[page : n // ps])
        unused_snapshot_slot = snapshot_slot
        if snapshot_slot is not None and node.snapshot_slot is None:
            node.snapshot_slot = snapshot_slot
            self._cached_snapshots += 1
            unused_snapshot_slot = None
        return InsertResult(num_cached_tokens, unused_snapshot_slot, duplicate_pages, node)

    # -- eviction -----------------------------------------------------------------------------------------

    def evict(self, num_pages: int) -> int:
        if num_pages <= 0:
            return 0
        heap = [
            self._eviction_key(n)
            for n in self._nodes()
            if n is not self.root and not n.children and n.ref_count == 0
        ]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            leaf = heapq.heappop(heap)[-1]
            parent = leaf.parent
            freed += self._remove_leaf(leaf)
            if parent is not self.root and not parent.children and parent.ref_count == 0:
                heapq.heappush(heap, self._eviction_key(parent))
        return freed

    def evict_snapshots(self, num_slots: int) -> int:
        if self.state_slots is None or num_slots <= 0:
            return 0
        # Only the locking request reads a node's snapshot (to restore its state); ancestors on a locked
        # path keep their pages but their snapshots are free to go.
        candidates = [n for n in self._nodes() if n.snapshot_slot is not None and n.own_locks == 0]
        victims = heapq.nsmallest(num_slots, candidates, key=lambda n: (n.last_access, n.node_id))
        for node in victims:
            if self.evict_listener is not None:
                self.evict_listener(self._prefix_tokens(node), [], node.snapshot_slot, node.chain_root)
            self.state_slots.free(node.snapshot_slot)
            node.snapshot_slot = None
        self._cached_snapshots -= len(victims)
        return len(victims)

    def index_bytes(self) -> int:
        """The nodes, their packed token ids, page lists and child tables (the page numbers are the pool's
        own ints): a walk over the nodes, which are few (one per run of pages shared or not)."""
        total = 0
        for node in self._nodes():
            total += sys.getsizeof(node) + sys.getsizeof(node.token_ids) + sys.getsizeof(node.pages)
            if node.page_keys is not None:
                total += sys.getsizeof(node.page_keys) + sum(sys.getsizeof(key) for key in node.page_keys)
            total += sys.getsizeof(node.children) + sum(sys.getsizeof(key) for key in node.children)
        return total

    # -- integrity ----------------------------------------------------------------------------------------

    def check_integrity(
        self, pages_held_by_requests: Iterable[int] = (), slots_held_by_requests: Iterable[int] = ()
    ) -> None:
        ps = self.page_size
        page_bytes = ps * TOKEN_BYTES
        if self.root.pages or self.root.token_ids or self.root.snapshot_slot is not None:
            raise CacheIntegrityError("the root must hold no tokens, pages or snapshot")
        node_pages: dict[str, list[int]] = {}  # by owner ("cache node N"), for the message of a failure
        node_slots: dict[str, list[int]] = {}
        evictable = 0
        for node in self._nodes():
            for key, child in node.children.items():
                if child.parent is not node or self._key_in_parent(child) != key:
                    raise CacheIntegrityError(f"{child!r} is linked wrongly under {node!r}")
                if node is not self.root and child.chain_root != node.chain_root:
                    raise CacheIntegrityError(f"{child!r} is in another key chain than its parent {node!r}")
            if node is self.root:
                continue
            if node.num_pages == 0 or len(node.token_ids) != node.num_pages * page_bytes:
                held = f"{len(node.token_ids) / TOKEN_BYTES:g} tokens in {node.num_pages} pages of {ps}"
                raise CacheIntegrityError(f"{node!r} holds {held}")
            if node.page_keys is not None and len(node.page_keys) != node.num_pages:
                raise CacheIntegrityError(f"{node!r} has {len(node.page_keys)} page keys")
            expected_refs = node.own_locks + sum(c.ref_count for c in node.children.values())
            if node.own_locks < 0 or node.ref_count != expected_refs:
                raise CacheIntegrityError(
                    f"{node!r}: ref_count {node.ref_count} != own locks {node.own_locks} + children's refs"
                )
            if node.ref_count == 0:
                evictable += node.num_pages
            node_pages[f"cache node {node.node_id}"] = node.pages
            if node.snapshot_slot is not None:
                node_slots[f"snapshot of cache node {node.node_id}"] = [node.snapshot_slot]
        cached = sum(len(pages) for pages in node_pages.values())
        snapshots = len(node_slots)
        page_owners = {
            **node_pages,
            "the free list": self.page_pool.free_pages(),
            "a request": list(pages_held_by_requests),
        }
        _check_places("page", page_owners, self.page_pool.num_pages)
        if self.state_slots is not None:
            slot_owners = {
                **node_slots,
                "the free list": self.state_slots.free_slots(),
                "a request": list(slots_held_by_requests),
            }
            _check_places("state slot", slot_owners, self.state_slots.num_slots)
        elif node_slots:
            raise CacheIntegrityError("snapshots in a cache whose spec has no state")
        counters = (self._cached_pages, self._evictable_pages, self._cached_snapshots)
        if counters != (cached, evictable, snapshots):
            raise CacheIntegrityError(
                f"counters (cached, evictable, snapshots) {counters} != tree {(cached, evictable, snapshots)}"
            )

    # -- internals ----------------------------------------------------------------------------------------

    def _walk(self, tokens: bytes, chain_root: bytes) -> tuple[RadixNode, RadixNode | None, int]:
        """Follow whole pages of `tokens` (packed) down the tree, in the chain `chain_root`. Returns the
        deepest fully matched node, and the child where the match goes on for some but not all pages (with
        how many), or (None, 0)."""
        page_bytes = self.page_size * TOKEN_BYTES
        end = len(tokens) // page_bytes * page_bytes
        node, pos = self.root, 0
        while pos < end:
            child = node.children.get(self._child_key(node, tokens[pos : pos + page_bytes], chain_root))
            if child is None:
                break
            num_matched = self._matched_pages(child, tokens, pos, end)
            if num_matched < child.num_pages:
                return node, child, num_matched
            node, pos = child, pos + num_matched * page_bytes
        return node, None, 0

    def _matched_pages(self, node: RadixNode, tokens: bytes, pos: int, end: int) -> int:
        """How many leading pages of `node` equal `tokens[pos:end]` (byte offsets, whole pages); at least
        1 (its key page matched)."""
        page_bytes = self.page_size * TOKEN_BYTES
        limit = min(node.num_pages, (end - pos) // page_bytes)
        size = limit * page_bytes
        if limit == node.num_pages:
            if tokens.startswith(node.token_ids, pos):  # memcmp, no copy
                return limit
        elif node.token_ids.startswith(tokens[pos : pos + size]):
            return limit
        # Some page before `limit` differs: the first differing byte says which.
        ours = np.frombuffer(node.token_ids, dtype=np.uint8, count=size)
        theirs = np.frombuffer(tokens, dtype=np.uint8, count=size, offset=pos)
        return int(np.argmax(ours != theirs)) // page_bytes

    def _split(self, node: RadixNode, num_pages: int) -> RadixNode:
        """Split `node` after `num_pages` pages and return the new upper half. `node` keeps the lower half
        with its snapshot, own locks and identity; the upper half carries the same path locks."""
        page_bytes = self.page_size * TOKEN_BYTES
        cut = num_pages * page_bytes
        parent = node.parent
        upper = RadixNode(
            node.token_ids[:cut], node.pages[:num_pages], parent, next(self._node_ids), node.chain_root
        )
        upper.ref_count = node.ref_count
        upper.last_access = node.last_access
        if node.page_keys is not None:
            upper.page_keys, node.page_keys = node.page_keys[:num_pages], node.page_keys[num_pages:]
        parent.children[self._key_in_parent(upper)] = upper  # in node's place: the same key
        node.token_ids, node.pages, node.parent = node.token_ids[cut:], node.pages[num_pages:], upper
        upper.children[node.token_ids[:page_bytes]] = node
        return upper

    def _add_leaf(self, parent: RadixNode, tokens: bytes, pages: list[int], chain_root: bytes) -> RadixNode:
        for page in pages:
            if self.page_pool.is_free(page):
                raise RuntimeError(f"insert of page {page}, which is free: the caller does not own it")
        leaf = RadixNode(tokens, pages, parent, next(self._node_ids), chain_root)
        leaf.last_access = self._clock
        parent.children[self._key_in_parent(leaf)] = leaf
        self._cached_pages += len(pages)
        self._evictable_pages += len(pages)
        return leaf

    def _remove_leaf(self, leaf: RadixNode) -> int:
        if self.evict_listener is not None:
            self.evict_listener(self._prefix_tokens(leaf), leaf.pages, leaf.snapshot_slot, leaf.chain_root)
        del leaf.parent.children[self._key_in_parent(leaf)]
        leaf.parent = None  # marks the handle dead: lock/unlock on it raise
        self.page_pool.free(leaf.pages)
        if leaf.snapshot_slot is not None:
            self.state_slots.free(leaf.snapshot_slot)
            leaf.snapshot_slot = None
            self._cached_snapshots -= 1
        self._cached_pages -= leaf.num_pages
        self._evictable_pages -= leaf.num_pages
        return leaf.num_pages

    def _child_key(self, parent: RadixNode, first_page: bytes, chain_root: bytes) -> bytes:
        """How `parent` keys a child whose first page is `first_page` (packed): the root by chain too."""
        return chain_root + first_page if parent is self.root else first_page

    def _key_in_parent(self, node: RadixNode) -> bytes:
        return self._child_key(node.parent, node.token_ids[: self.page_size * TOKEN_BYTES], node.chain_root)

    def _eviction_key(self, leaf: RadixNode) -> tuple[bool, int, int, RadixNode]:
        # In a state spec a leaf without a snapshot can never end a match and leads to none: dead weight,
        # so it goes first. Then least recently used; node_id makes the order total (nodes never compare).
        has_value = leaf.snapshot_slot is not None or not self.spec.has_state
        return (has_value, leaf.last_access, leaf.node_id, leaf)

    def _path(self, node: object) -> list[RadixNode]:
        """Nodes from below the root down to `node`; raises if `node` is not in this tree (any more)."""
        if not isinstance(node, RadixNode):
            raise TypeError(f"expected a RadixNode handle, got {type(node).__name__}")
        path = []
        while node is not self.root:
            if node.parent is None:
                raise RuntimeError(f"{node!r} is not in the cache: it was evicted or belongs to another tree")
            path.append(node)
            node = node.parent
        path.reverse()
        return path

    def _prefix_tokens(self, node: RadixNode) -> np.ndarray:
        """Every token from the root to the end of `node` (uint32)."""
        return np.frombuffer(b"".join(n.token_ids for n in self._path(node)), dtype=_TOKEN_DTYPE)

    def _nodes(self) -> list[RadixNode]:
        nodes, stack = [], [self.root]
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        return nodes


def _check_places(kind: str, owners: dict[str, Sequence[int]], total: int) -> None:
    """Every index in [0, total) has exactly one owner. Counted in numpy (a pool of the 80B model has
    264K pages, and the server checks whenever it goes idle); the owners are named only for a failure."""
    everything = np.fromiter(itertools.chain.from_iterable(owners.values()), dtype=np.int64)
    outside = everything[(everything < 0) | (everything >= total)]
    if outside.size:
        index = int(outside[0])
        where = [owner for owner, indices in owners.items() if index in indices]
        raise CacheIntegrityError(f"{kind} {index} is out of range (pool of {total}), found in {where}")
    counts = np.bincount(everything, minlength=total)
    if (counts > 1).any():
        index = int(np.flatnonzero(counts > 1)[0])
        where = [owner for owner, indices in owners.items() for i in indices if i == index]
        raise CacheIntegrityError(f"{kind} {index} is in several places: {', '.join(where)}")
    if (counts == 0).any():
        leaked = np.flatnonzero(counts == 0)
        raise CacheIntegrityError(
            f"{leaked.size} {kind}s are in no place (not free, not cached, not held): {leaked[:10].tolist()}"
        )
