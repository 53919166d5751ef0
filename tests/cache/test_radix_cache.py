from __future__ import annotations

import random
import tracemalloc
from array import array

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from morion.cache import (
    CacheIntegrityError,
    CacheSpec,
    PagePool,
    RadixCache,
    StateComponent,
    StateSlots,
    TokenComponent,
)
from morion.cache.page_keys import ROOT_KEY, chain_root, page_keys

PS = 4
KV = TokenComponent("kv", 2, (2, 1, 4), torch.float32)
STATE = StateComponent("ssm", 2, (4, 4), torch.float32)


def make_cache(*, state: bool = False, num_pages: int = 32, num_slots: int = 8, page_size: int = PS):
    spec = CacheSpec(page_size, (KV,), (STATE,) if state else ())
    pool = PagePool(spec, num_pages)
    slots = StateSlots(spec, num_slots) if state else None
    return RadixCache(pool, slots), pool, slots


def seq(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def insert_fresh(cache: RadixCache, pool: PagePool, tokens: list[int], snapshot: int | None = None):
    """Insert as a request that matched nothing and holds its own pages; free what the cache did not take."""
    pages = pool.alloc(-(-len(tokens) // PS))
    result = cache.insert(tokens, pages, snapshot)
    pool.free(result.duplicate_pages + pages[len(tokens) // PS :])
    return result, pages


def test_insert_then_match() -> None:
    cache, pool, _ = make_cache()
    result, pages = insert_fresh(cache, pool, seq(12))
    assert (result.num_cached_tokens, result.duplicate_pages, result.unused_snapshot_slot) == (0, [], None)
    match = cache.match_prefix([*seq(12), 99, 98])
    assert (match.num_tokens, match.pages, match.snapshot_slot) == (12, pages, None)
    assert match.node is result.node
    assert cache.cached_pages == cache.evictable_pages == 3
    cache.check_integrity()


def test_match_ignores_a_partial_last_page() -> None:
    cache, pool, _ = make_cache()
    _, pages = insert_fresh(cache, pool, seq(12))
    assert cache.match_prefix(seq(7)).pages == pages[:1]
    assert cache.match_prefix(seq(3)).num_tokens == 0
    assert cache.match_prefix(torch.tensor(seq(11))).num_tokens == 8  # tensors work too
    assert cache.match_prefix([]).node is cache.root


def test_match_splits_inside_a_node_keeping_handles_valid() -> None:
    cache, pool, _ = make_cache()
    result, pages = insert_fresh(cache, pool, seq(12))
    cache.lock(result.node)
    match = cache.match_prefix([*seq(8), 50, 51, 52, 53])
    assert (match.num_tokens, match.pages) == (8, pages[:2])
    assert match.node.parent is cache.root and result.node.parent is match.node
    assert match.node.ref_count == 1  # the split copied the path lock
    cache.check_integrity()
    cache.unlock(result.node)
    assert cache.evictable_pages == 3
    cache.check_integrity()


def test_insert_reports_duplicates_and_keeps_the_tail_with_the_caller() -> None:
    cache, pool, _ = make_cache()
    _, first = insert_fresh(cache, pool, seq(12))
    # A second request computed the same first two pages itself, then diverged; 10 tokens: 2 full pages.
    tokens = [*seq(8), 70, 71]
    pages = pool.alloc(3)
    result = cache.insert(tokens, pages)
    assert result.num_cached_tokens == 8
    assert result.duplicate_pages == pages[:2]  # the cache keeps its own copies
    cache.check_integrity(pages_held_by_requests=pages)  # nothing taken: all three still the caller's
    pool.free(result.duplicate_pages)
    cache.check_integrity(pages_held_by_requests=pages[2:])
    pool.free(pages[2:])
    # With a diverging third page the cache takes exactly that page.
    tokens = [*seq(8), 70, 71, 72, 73]
    pages = [*first[:2], *pool.alloc(1)]  # matched pages are the cache's own: not duplicates
    result = cache.insert(tokens, pages)
    assert (result.num_cached_tokens, result.duplicate_pages) == (8, [])
    cache.check_integrity()
    assert cache.match_prefix(tokens).pages == pages


def test_keeping_duplicates_and_reinserting_reports_them_again() -> None:
    cache, pool, _ = make_cache()
    insert_fresh(cache, pool, seq(8))
    pages = pool.alloc(4)
    first = cache.insert(seq(12), pages)  # chunked prefill: insert 12 of 16 tokens, keep running
    cache.lock(first.node)
    assert first.duplicate_pages == pages[:2]
    final = cache.insert(seq(16), pages)
    assert (final.num_cached_tokens, final.duplicate_pages) == (12, pages[:2])
    assert final.node.parent is first.node
    cache.check_integrity(pages_held_by_requests=pages[:2])
    pool.free(final.duplicate_pages)
    cache.unlock(first.node)
    cache.check_integrity()
    assert cache.cached_pages == 4


def test_insert_validates_its_input() -> None:
    cache, pool, _ = make_cache()
    with pytest.raises(ValueError, match="need 2 full pages"):
        cache.insert(seq(9), pool.alloc(1))
    with pytest.raises(ValueError, match="no state components"):
        cache.insert(seq(8), pool.alloc(2), snapshot_slot=0)
    free_page = pool.free_pages()[-1]
    with pytest.raises(RuntimeError, match=f"page {free_page}, which is free"):
        cache.insert(seq(4), [free_page])
    assert cache.insert(seq(3), []).num_cached_tokens == 0


def test_lock_protects_from_eviction() -> None:
    cache, pool, _ = make_cache(num_pages=8)
    a, _ = insert_fresh(cache, pool, seq(8))
    insert_fresh(cache, pool, seq(8, start=100))
    cache.lock(a.node)
    cache.lock(a.node)  # locks nest
    assert cache.evictable_pages == 2
    assert cache.evict(10) == 2
    assert cache.cached_pages == 2 and pool.num_free == 6
    cache.unlock(a.node)
    assert cache.evict(10) == 0
    cache.unlock(a.node)
    assert cache.evict(1) == 2  # whole nodes: may free more than asked
    assert pool.num_free == 8 and cache.cached_pages == 0
    cache.check_integrity()


def test_lock_errors() -> None:
    cache, pool, _ = make_cache()
    a, _ = insert_fresh(cache, pool, seq(8))
    with pytest.raises(RuntimeError, match="holds no lock"):
        cache.unlock(a.node)
    cache.lock(cache.root)  # the root: a no-op
    cache.unlock(cache.root)
    cache.evict(2)
    with pytest.raises(RuntimeError, match="not in the cache"):
        cache.lock(a.node)
    with pytest.raises(TypeError):
        cache.lock("node")


def test_path_lock_blocks_ancestors_but_not_siblings() -> None:
    cache, pool, _ = make_cache()
    trunk, _ = insert_fresh(cache, pool, seq(8))
    left, _ = insert_fresh(cache, pool, [*seq(8), 1, 1, 1, 1])
    insert_fresh(cache, pool, [*seq(8), 2, 2, 2, 2])
    cache.lock(left.node)
    assert cache.evictable_pages == 1
    assert cache.evict(100) == 1
    assert left.node.parent is trunk.node and trunk.node.parent is cache.root
    cache.check_integrity()


def test_evict_is_lru_and_cascades_to_parents() -> None:
    cache, pool, _ = make_cache()
    insert_fresh(cache, pool, seq(4))
    insert_fresh(cache, pool, [*seq(4), *seq(4, start=10)])  # a child of the first node
    insert_fresh(cache, pool, seq(8, start=50))
    cache.match_prefix(seq(4))  # touch only the first node: its child is now the oldest leaf
    assert cache.evict(1) == 1
    assert cache.match_prefix([*seq(4), *seq(4, start=10)]).num_tokens == 4
    assert cache.evict(1) == 2  # the other branch (older than the first node, now a leaf again)
    assert cache.match_prefix(seq(8, start=50)).num_tokens == 0
    assert cache.evict(1) == 1
    assert cache.cached_pages == 0 and pool.num_free == pool.num_pages
    assert cache.evict(1) == 0 and cache.evict(0) == 0
    cache.check_integrity()


def test_chains_share_no_node() -> None:
    """A cache salt's chain (page_keys.chain_root) matches only what was inserted in it."""
    cache, pool, slots = make_cache(state=True)
    salted = chain_root("tenant-a")
    unsalted, _ = insert_fresh(cache, pool, seq(8), snapshot=slots.alloc())
    assert cache.match_prefix(seq(12), salted).num_tokens == 0
    assert cache.match_prefix(seq(12), chain_root("tenant-b")).num_tokens == 0
    pages = pool.alloc(2)
    mine = cache.insert(seq(8), pages, slots.alloc(), chain_root=salted)
    assert (mine.num_cached_tokens, mine.duplicate_pages) == (0, [])  # nothing shared with the unsalted run
    assert cache.match_prefix(seq(12), salted).pages == pages
    assert cache.match_prefix(seq(12)).node is unsalted.node
    # A split keeps the upper half in its chain; eviction tells the listener which chain it hashes from.
    cache.insert(seq(4), pages[:1], slots.alloc(), chain_root=salted)
    assert cache.match_prefix(seq(7), salted).pages == pages[:1]
    evicted = []
    cache.evict_listener = lambda tokens, node_pages, slot, root: evicted.append((list(tokens), root))
    cache.match_prefix(seq(8))  # the unsalted chain is the most recently used
    cache.evict(2)
    assert evicted == [(seq(8), salted), (seq(4), salted)]
    assert cache.match_prefix(seq(8)).num_tokens == 8 and cache.match_prefix(seq(8), salted).num_tokens == 0
    cache.check_integrity()


def test_nodes_keep_the_page_keys_their_inserts_gave() -> None:
    """A match returns its pages' content keys where every node on its path was given them (a later turn
    of a conversation does not hash its prefix again), split with their pages, filled in by a later insert
    that has them, and None where a node has none."""
    cache, pool, slots = make_cache(state=True)
    salt = chain_root("tenant")
    first = seq(16)
    pages = pool.alloc(4)
    cache.insert(first, pages, slots.alloc(), salt, page_keys=page_keys(first, PS, salt))
    match = cache.match_prefix([*first, 7], salt)
    assert match.num_tokens == 16 and match.page_keys == page_keys(first, PS, salt)
    # A sequence that parts from it inside its node splits it: both halves keep their own pages' keys.
    other = [*seq(8), 50, 51, 52, 53]
    mine = pool.alloc(3)
    result = cache.insert(other, mine, slots.alloc(), salt, page_keys=page_keys(other, PS, salt))
    pool.free(result.duplicate_pages)
    assert cache.match_prefix([*other, 1], salt).page_keys == page_keys(other, PS, salt)
    assert cache.match_prefix([*first, 1], salt).page_keys == page_keys(first, PS, salt)
    # Inserted without keys (no tiers): no keys to give; a later insert with keys fills them in.
    plain = seq(8, start=100)
    cache.insert(plain, pool.alloc(2), slots.alloc())
    assert cache.match_prefix([*plain, 1]).page_keys is None
    cache.insert(plain, cache.match_prefix(plain).pages, None, page_keys=page_keys(plain, PS))
    assert cache.match_prefix([*plain, 1]).page_keys == page_keys(plain, PS, ROOT_KEY)
    assert cache.match_prefix([1, 2, 3]).page_keys == []  # nothing matched: no pages, no keys
    spare = pool.alloc(3)
    with pytest.raises(ValueError, match="page keys"):
        cache.insert(seq(12, start=200), spare, None, page_keys=page_keys(seq(8), PS))
    pool.free(spare)
    cache.check_integrity()


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 24), st.lists(st.integers(0, 1), max_size=12)), min_size=1, max_size=12)
)
def test_matched_keys_are_the_hash_of_the_matched_tokens(shapes: list[tuple[int, list[int]]]) -> None:
    """Whatever inserts, splits and evictions came before, a match's keys are the keys of its tokens.
    Sequences share prefixes of one conversation and part anywhere, inside nodes too."""
    cache, pool, _ = make_cache(num_pages=64)
    for shared, tail in shapes:
        tokens = seq(shared) + tail
        if not tokens:
            continue
        match = cache.match_prefix(tokens)
        if match.page_keys is not None:
            assert match.page_keys == page_keys(tokens[: match.num_tokens], PS)
        if pool.num_free < -(-len(tokens) // PS):
            cache.evict(64)
        pages = match.pages + pool.alloc(len(tokens) // PS - len(match.pages))
        result = cache.insert(tokens, pages, None, page_keys=page_keys(tokens, PS))
        pool.free(result.duplicate_pages)
        assert cache.match_prefix(tokens).page_keys == page_keys(tokens[: len(tokens) // PS * PS], PS)
        cache.check_integrity()


# -- state specs -------------------------------------------------------------------------------------------


def test_state_match_ends_at_the_deepest_snapshot() -> None:
    cache, pool, slots = make_cache(state=True)
    assert cache.match_prefix(seq(16))[:4] == (cache.root, 0, [], None)
    snap = slots.alloc()
    _, pages = insert_fresh(cache, pool, seq(8), snapshot=snap)
    insert_fresh(cache, pool, seq(16))  # pages up to 16, but no state there
    match = cache.match_prefix(seq(16))
    assert (match.num_tokens, match.pages, match.snapshot_slot) == (8, pages, snap)
    assert cache.match_prefix(seq(12)).num_tokens == 8
    assert cache.match_prefix(seq(7)).num_tokens == 0
    nodes_before = len(cache._nodes())
    cache.match_prefix(seq(12))
    assert len(cache._nodes()) == nodes_before  # no split: a state match only ends at node ends
    cache.check_integrity()


def test_snapshot_stays_with_the_lower_half_of_a_split() -> None:
    cache, pool, slots = make_cache(state=True)
    s12, s8, s12_again = slots.alloc(), slots.alloc(), slots.alloc()
    deep, pages = insert_fresh(cache, pool, seq(12), snapshot=s12)
    mid = cache.insert(seq(8), pages[:2], s8)  # a snapshot at 8 tokens splits the node
    assert (mid.num_cached_tokens, mid.unused_snapshot_slot, mid.duplicate_pages) == (8, None, [])
    assert deep.node.parent is mid.node and deep.node.snapshot_slot == s12 and mid.node.snapshot_slot == s8
    assert cache.match_prefix(seq(12)).snapshot_slot == s12
    assert cache.match_prefix(seq(11)).snapshot_slot == s8
    again = cache.insert(seq(12), cache.match_prefix(seq(12)).pages, s12_again)
    assert again.unused_snapshot_slot == s12_again  # the cache keeps its own; the caller frees this one
    slots.free(s12_again)
    assert cache.cached_snapshots == 2
    cache.check_integrity()


def test_snapshot_insert_needs_a_page_aligned_length() -> None:
    cache, pool, slots = make_cache(state=True)
    slot = slots.alloc()
    with pytest.raises(ValueError, match="page-aligned"):
        cache.insert(seq(10), pool.alloc(3), slot)
    with pytest.raises(ValueError, match="page-aligned"):
        cache.insert([], [], slot)
    slots.free(slot)
    with pytest.raises(RuntimeError, match="free"):
        cache.insert(seq(4), pool.alloc(1), slot)


def test_tombstones_keep_pages_but_end_no_match() -> None:
    cache, pool, slots = make_cache(state=True)
    s4, s8 = slots.alloc(), slots.alloc()
    _, pages4 = insert_fresh(cache, pool, seq(4), snapshot=s4)
    deep, pages8 = insert_fresh(cache, pool, seq(8), snapshot=s8)
    cache.match_prefix(seq(8))  # touches both nodes at once: the older node goes first
    assert cache.evict_snapshots(1) == 1
    assert slots.is_free(s4) and cache.cached_pages == 2 and cache.cached_snapshots == 1
    assert cache.match_prefix(seq(8)).snapshot_slot == s8
    assert cache.match_prefix(seq(7)).num_tokens == 0  # the tombstone at 4 ends no match
    assert cache.evict_snapshots(5) == 1
    match = cache.match_prefix(seq(8))
    assert (match.node, match.num_tokens) == (cache.root, 0)  # pages still cached, but no state
    assert cache.cached_pages == 2 and slots.num_free == slots.num_slots
    cache.check_integrity()
    # A new snapshot at a tombstone's end revives it.
    s8_again = slots.alloc()
    revived = cache.insert(seq(8), [*pages4, pages8[1]], s8_again)
    assert (revived.node, revived.unused_snapshot_slot, revived.duplicate_pages) == (deep.node, None, [])
    assert cache.match_prefix(seq(8)).snapshot_slot == s8_again
    cache.check_integrity()


def test_evict_snapshots_spares_the_locked_node_but_not_its_ancestors() -> None:
    cache, pool, slots = make_cache(state=True)
    s4, s8 = slots.alloc(), slots.alloc()
    insert_fresh(cache, pool, seq(4), snapshot=s4)
    deep, _ = insert_fresh(cache, pool, seq(8), snapshot=s8)
    cache.lock(deep.node)
    assert cache.evict_snapshots(2) == 1
    assert deep.node.snapshot_slot == s8 and slots.is_free(s4)
    assert cache.evict(100) == 0  # the pages are path-locked
    cache.unlock(deep.node)
    assert cache.evict_snapshots(2) == 1
    cache.check_integrity()


def test_evict_prefers_dead_leaves_in_a_state_spec() -> None:
    cache, pool, slots = make_cache(state=True)
    insert_fresh(cache, pool, seq(4), snapshot=slots.alloc())  # older, but useful
    insert_fresh(cache, pool, seq(4, start=20))  # newer, but can never end a match
    assert cache.evict(1) == 1
    assert cache.match_prefix(seq(4)).num_tokens == 4
    assert cache.evict(1) == 1
    assert slots.num_free == slots.num_slots  # evicting a leaf frees its snapshot too
    cache.check_integrity()


def test_state_cache_needs_its_slots() -> None:
    spec = CacheSpec(PS, (KV,), (STATE,))
    with pytest.raises(ValueError, match="needs its StateSlots"):
        RadixCache(PagePool(spec, 4))
    with pytest.raises(ValueError, match="different CacheSpecs"):
        RadixCache(PagePool(CacheSpec(PS * 2, (KV,), (STATE,)), 4), StateSlots(spec, 2))


# -- integrity check ---------------------------------------------------------------------------------------


def test_integrity_catches_leaks_and_double_ownership() -> None:
    cache, pool, slots = make_cache(state=True, num_pages=8)
    held = pool.alloc(2)
    with pytest.raises(CacheIntegrityError, match=r"2 pages are in no place.*\[0, 1\]"):
        cache.check_integrity()
    with pytest.raises(CacheIntegrityError, match="page 7 is in several places: the free list, a request"):
        cache.check_integrity(pages_held_by_requests=[*held, 7])
    with pytest.raises(CacheIntegrityError, match="page 9 is out of range"):
        cache.check_integrity(pages_held_by_requests=[*held, 9])
    slot = slots.alloc()
    with pytest.raises(CacheIntegrityError, match="state slot"):
        cache.check_integrity(pages_held_by_requests=held)
    cache.check_integrity(pages_held_by_requests=held, slots_held_by_requests=[slot])
    result = cache.insert(seq(8), held, slot)
    cache.check_integrity()
    slots._is_free[slot] = 1  # corrupt: the snapshot's slot is also on the free list
    slots._free.append(slot)
    with pytest.raises(CacheIntegrityError, match=r"snapshot of cache node .* the free list"):
        cache.check_integrity()
    slots._free.pop()
    slots._is_free[slot] = 0
    result.node.ref_count = 1  # corrupt: a lock count without a lock
    with pytest.raises(CacheIntegrityError, match="ref_count 1 != own locks 0"):
        cache.check_integrity()
    result.node.ref_count = 0
    result.node.pages.append(5)  # corrupt: more pages than tokens
    with pytest.raises(CacheIntegrityError, match="holds 8 tokens in 3 pages"):
        cache.check_integrity()


def test_the_tree_keeps_eight_bytes_a_token() -> None:
    """Token ids are packed: 32 prompts of 512 vocabulary-sized ids (fresh int objects, as a request's come
    from the engine's inbox) cost the tree about 8 bytes a token. A tuple of Python ints kept about 40: a
    pointer and an int object per token, which a 1.2M-token qualification run's tree held as 48 MB."""
    page_size = 16
    cache, pool, _ = make_cache(num_pages=32 * 512 // page_size, page_size=page_size)
    rng = random.Random(0)
    tracemalloc.start()
    try:
        for _ in range(32):
            tokens = [rng.randrange(2**17) for _ in range(512)]
            cache.insert(tokens, pool.alloc(512 // page_size))
            del tokens
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert cache.cached_pages * page_size == 32 * 512
    assert held / (32 * 512) < 10, f"{held / (32 * 512):.1f} bytes a cached token"
    cache.check_integrity()


def test_ids_match_exactly_in_every_byte_and_must_fit_64_bits() -> None:
    """Image keys (multimodal/prompt_images.py) are above 2**32: every byte of a 64-bit id counts."""
    cache, pool, _ = make_cache()
    high = [2**64 - 1, 2**32 + 5, 256, 1]
    _, pages = insert_fresh(cache, pool, [*high, *high])
    # Differing only in a high byte of one id is a different page; a packed array is the same as a list.
    assert cache.match_prefix([*high, 2**64 - 1, 2**32 + 5, 257, 1]).num_tokens == 4
    assert cache.match_prefix([*high, 2**64 - 1, 5, 256, 1]).num_tokens == 4  # only the high word differs
    assert cache.match_prefix(array("Q", [*high, *high])).pages == pages
    tensor_ids = [2**63 - 1, 2**32 + 5, 256, 1]  # torch has no uint64 tensors of such values: int64
    _, tensor_pages = insert_fresh(cache, pool, [*tensor_ids, *tensor_ids])
    assert cache.match_prefix(torch.tensor([*tensor_ids, *tensor_ids])).pages == tensor_pages
    for bad in ([-1, 0, 0, 0], [2**64, 0, 0, 0]):
        with pytest.raises(OverflowError):
            cache.match_prefix(bad)
    with pytest.raises(OverflowError):
        cache.match_prefix(torch.tensor([-1, 0, 0, 0]))


# -- properties against a brute-force oracle ---------------------------------------------------------------

# Three ids whose packed bytes agree in some places and differ in others (ids are stored as uint64 bytes).
sequences = st.lists(
    st.lists(st.sampled_from([1, 256, 2**64 - 1]), min_size=0, max_size=14), min_size=1, max_size=8
)
# Pages for every inserted sequence unshared at page size 1 (8 x 14): an allocation never comes back empty.
ROOM = 8 * 14


def common_pages(a: list[int], b: list[int], page_size: int) -> int:
    n = 0
    while (n + 1) * page_size <= min(len(a), len(b)) and a[: (n + 1) * page_size] == b[: (n + 1) * page_size]:
        n += 1
    return n


@settings(max_examples=60, deadline=None)
@given(inserted=sequences, queries=sequences, page_size=st.sampled_from([1, 2, 4]))
def test_match_is_the_longest_cached_page_prefix(inserted, queries, page_size) -> None:
    cache, pool, _ = make_cache(num_pages=ROOM, page_size=page_size)
    for tokens in inserted:
        pages = pool.alloc(len(tokens) // page_size)
        pool.free(cache.insert(tokens, pages).duplicate_pages)
        cache.check_integrity()
    for query in [*queries, *inserted]:
        expected = max(common_pages(query, tokens, page_size) for tokens in inserted)
        assert cache.match_prefix(query).num_tokens == expected * page_size
        cache.check_integrity()


@settings(max_examples=60, deadline=None)
@given(inserted=sequences, queries=sequences, page_size=st.sampled_from([1, 2, 4]))
def test_state_match_is_the_longest_snapshotted_prefix(inserted, queries, page_size) -> None:
    cache, pool, slots = make_cache(state=True, num_pages=ROOM, num_slots=16, page_size=page_size)
    snapshotted = []  # insert whole sequences; a snapshot only where the length is page aligned
    for tokens in inserted:
        pages = pool.alloc(len(tokens) // page_size)
        aligned = len(tokens) > 0 and len(tokens) % page_size == 0
        result = cache.insert(tokens, pages, slots.alloc() if aligned else None)
        pool.free(result.duplicate_pages)
        if result.unused_snapshot_slot is not None:
            slots.free(result.unused_snapshot_slot)
        if aligned:
            snapshotted.append(tokens)
        cache.check_integrity()
    for query in [*queries, *inserted]:
        full = len(query) // page_size * page_size
        expected = max(
            [len(s) for s in snapshotted if len(s) <= full and query[: len(s)] == s],
            default=0,
        )
        match = cache.match_prefix(query)
        assert match.num_tokens == expected
        assert (match.snapshot_slot is None) == (expected == 0)
