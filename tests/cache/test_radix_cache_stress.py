"""Random request traffic against the radix cache, checking integrity and data after every step.

Each simulated request "computes" its tokens by writing, into its page slots, a hash of the prefix up to
and including that token (attention K/V depend on the whole prefix); its working state slot holds the hash
of the prefix it has consumed. Every match is then checked against those hashes: a page that was reused
while still in use, or a snapshot that moved to the wrong position, shows up as a wrong value.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from morion.cache import (
    CacheSpec,
    PagePool,
    PrefixMatch,
    RadixCache,
    StateComponent,
    StateSlots,
    TokenComponent,
)

MODULUS = (1 << 61) - 1


def prefix_hashes(tokens: list[int]) -> list[int]:
    """hashes[i] identifies tokens[:i]."""
    hashes, h = [0], 0
    for token in tokens:
        h = (h * 1_000_003 + token + 1) % MODULUS
        hashes.append(h)
    return hashes


@dataclass
class Request:
    tokens: list[int]
    node: object  # the locked node, covering at least the cache's pages in `pages`
    locked_tokens: int
    pages: list[int]  # the page table: the cache's pages and the request's own
    own: set[int]  # the pages this request owns
    slot: int | None  # working state


class Simulation:
    def __init__(self, seed: int, page_size: int, has_state: bool) -> None:
        self.rng = random.Random(seed)
        self.ps = page_size
        self.has_state = has_state
        spec = CacheSpec(
            page_size,
            (TokenComponent("kv", 1, (), torch.int64),),
            (StateComponent("state", 1, (), torch.int64),) if has_state else (),
        )
        self.pool = PagePool(spec, 40 // page_size + 8)
        self.slots = StateSlots(spec, 12) if has_state else None
        self.cache = RadixCache(self.pool, self.slots)
        self.running: list[Request] = []
        # A few shared stems so that requests share prefixes and branch inside nodes.
        self.stems = [[self.rng.randrange(4) for _ in range(24)] for _ in range(3)]

    # -- helpers ---------------------------------------------------------------------------------------------

    def kv_values(self, pages: list[int], num_tokens: int) -> list[int]:
        return self.pool.storage("kv")[0, self.pool.token_slots(pages, num_tokens)].tolist()

    def write_kv(self, req: Request, start: int) -> None:
        slots = self.pool.token_slots(req.pages, len(req.tokens))[start:]
        values = prefix_hashes(req.tokens)[start + 1 :]
        self.pool.storage("kv")[0, slots] = torch.tensor(values, dtype=torch.int64)

    def state(self, slot: int) -> int:
        return int(self.slots.storage("state")[0, slot])

    def set_state(self, slot: int, tokens: list[int]) -> None:
        self.slots.storage("state")[0, slot] = prefix_hashes(tokens)[-1]

    def verify_match(self, tokens: list[int], match: PrefixMatch) -> None:
        n, hashes = match.num_tokens, prefix_hashes(tokens)
        assert n == len(match.pages) * self.ps <= len(tokens)
        assert self.kv_values(match.pages, n) == hashes[1 : n + 1]
        if self.has_state and n > 0:
            assert self.state(match.snapshot_slot) == hashes[n]
        else:
            assert match.snapshot_slot is None

    def verify_request(self, req: Request) -> None:
        assert self.kv_values(req.pages, len(req.tokens)) == prefix_hashes(req.tokens)[1:]
        if self.has_state:
            assert self.state(req.slot) == prefix_hashes(req.tokens)[-1]

    def alloc_pages(self, n: int) -> list[int] | None:
        pages = self.pool.alloc(n)
        if pages is None:
            self.cache.evict(n - self.pool.num_free)
            pages = self.pool.alloc(n)
        return pages

    def alloc_slot(self) -> int | None:
        slot = self.slots.alloc()
        if slot is None:
            self.cache.evict_snapshots(1)
            slot = self.slots.alloc()
        return slot

    def insert(self, req: Request, num_tokens: int, snapshot: int | None) -> object:
        """Insert tokens[:num_tokens] of a request that keeps running; returns the new node to lock."""
        full = num_tokens // self.ps
        result = self.cache.insert(req.tokens[:num_tokens], req.pages[:full], snapshot)
        taken = req.pages[result.num_cached_tokens // self.ps : full]
        assert set(taken) <= req.own and set(result.duplicate_pages) <= req.own
        req.own -= set(taken)  # duplicates stay ours: we keep using them and free them at the end
        if result.unused_snapshot_slot is not None:
            self.slots.free(result.unused_snapshot_slot)
        return result.node

    # -- operations ------------------------------------------------------------------------------------------

    def start(self) -> None:
        stem = self.rng.choice(self.stems)
        tail = [self.rng.randrange(4) for _ in range(self.rng.randrange(10))]
        tokens = stem[: self.rng.randrange(1, len(stem) + 1)] + tail
        match = self.cache.match_prefix(tokens)
        self.cache.lock(match.node)  # before any eviction: the match is only lent
        self.verify_match(tokens, match)
        new_pages = self.alloc_pages(-(-len(tokens) // self.ps) - len(match.pages))
        slot = self.alloc_slot() if self.has_state else None
        if new_pages is None or (self.has_state and slot is None):
            self.pool.free(new_pages or [])
            if slot is not None:
                self.slots.free(slot)
            self.cache.unlock(match.node)
            return
        req = Request(tokens, match.node, match.num_tokens, match.pages + new_pages, set(new_pages), slot)
        self.write_kv(req, match.num_tokens)
        if self.has_state:
            if match.snapshot_slot is None:
                self.slots.zero(slot)
            else:
                self.slots.copy(match.snapshot_slot, slot)
            assert self.state(slot) == prefix_hashes(tokens)[match.num_tokens]  # restored, not guessed
            self.set_state(slot, tokens)
        self.running.append(req)

    def decode(self, req: Request) -> None:
        if len(req.tokens) == len(req.pages) * self.ps:
            page = self.alloc_pages(1)
            if page is None:
                return
            req.pages += page
            req.own |= set(page)
        req.tokens.append(self.rng.randrange(4))
        self.write_kv(req, len(req.tokens) - 1)
        if self.has_state:
            self.set_state(req.slot, req.tokens)

    def insert_unfinished(self, req: Request) -> None:
        """Chunked prefill: cache a page-aligned prefix (maybe with a grid snapshot) and keep running."""
        lowest, highest = -(-req.locked_tokens // self.ps), len(req.tokens) // self.ps
        if lowest > highest or highest == 0:
            return
        num_tokens = self.rng.randint(max(lowest, 1), highest) * self.ps
        snapshot = None
        if self.has_state and self.rng.random() < 0.7:
            snapshot = self.alloc_slot()
            if snapshot is not None:
                self.set_state(snapshot, req.tokens[:num_tokens])
        node = self.insert(req, num_tokens, snapshot)
        # Lock the new node before unlocking the old: the pages just given to the cache are in use.
        self.cache.lock(node)
        self.cache.unlock(req.node)
        req.node, req.locked_tokens = node, num_tokens

    def finish(self, req: Request) -> None:
        self.verify_request(req)
        num_tokens = len(req.tokens) // self.ps * self.ps
        snapshot = None
        if self.has_state:
            if num_tokens == len(req.tokens) and num_tokens > 0:
                snapshot = req.slot  # donate the working state: it is valid exactly at the end
            else:
                self.slots.free(req.slot)
        result = self.cache.insert(req.tokens, req.pages, snapshot)
        taken = req.pages[result.num_cached_tokens // self.ps : num_tokens // self.ps]
        tail = req.pages[num_tokens // self.ps :]
        # Everything the request owned is now exactly: taken by the cache, a duplicate, or the tail.
        assert req.own == set(taken) | set(result.duplicate_pages) | set(tail)
        self.pool.free(result.duplicate_pages + tail)
        if result.unused_snapshot_slot is not None:
            self.slots.free(result.unused_snapshot_slot)
        self.cache.unlock(req.node)
        self.running.remove(req)

    def step(self) -> None:
        roll = self.rng.random()
        if roll < 0.25 or not self.running:
            self.start()
        elif roll < 0.45:
            self.decode(self.rng.choice(self.running))
        elif roll < 0.55:
            self.insert_unfinished(self.rng.choice(self.running))
        elif roll < 0.75:
            self.finish(self.rng.choice(self.running))
        elif roll < 0.85:
            tokens = self.rng.choice(self.stems)[: self.rng.randrange(30)]
            self.verify_match(tokens, self.cache.match_prefix(tokens))  # unlocked: use before any evict
        elif roll < 0.95:
            self.cache.evict(self.rng.randrange(6))
        else:
            self.cache.evict_snapshots(self.rng.randrange(3))

    def check(self) -> None:
        held_pages = [page for req in self.running for page in req.own]
        held_slots = [req.slot for req in self.running if req.slot is not None]
        self.cache.check_integrity(held_pages, held_slots)
        assert self.pool.num_free + self.cache.cached_pages + len(held_pages) == self.pool.num_pages
        if self.has_state:
            assert self.slots.num_free + self.cache.cached_snapshots + len(held_slots) == self.slots.num_slots
        for req in self.running:
            self.verify_request(req)


@pytest.mark.parametrize("has_state", [False, True], ids=["kv", "hybrid"])
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("seed", range(4))
def test_random_traffic_keeps_every_invariant(seed: int, page_size: int, has_state: bool) -> None:
    sim = Simulation(seed, page_size, has_state)
    for _ in range(300):
        sim.step()
        sim.check()
    while sim.running:
        sim.finish(sim.running[0])
        sim.check()
    assert sim.cache.evictable_pages == sim.cache.cached_pages  # nothing is locked any more
    sim.cache.evict(sim.pool.num_pages)
    sim.check()
    assert sim.pool.num_free == sim.pool.num_pages and sim.cache.cached_pages == 0
    if has_state:
        assert sim.slots.num_free == sim.slots.num_slots
