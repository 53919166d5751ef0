"""Which tokens run in the next step, and the page and state-slot bookkeeping that makes them fit.

Policy, per step, under a token budget (`chunk_size`):
1. Running requests that decode (one uncomputed token) go first, oldest first, so a long prefill never
   stalls generation. A decode that needs a page and finds none evicts from the prefix cache, then
   retracts the newest running request (its pages go back; it re-queues and recomputes later).
2. Running requests still in prefill continue with what budget is left (chunked prefill), each with its
   next piece (`_chunk`): pieces are cut where the request alone says, never where the step's budget ran
   out, and a piece runs whole or waits for a later step. The step's first prefill piece always runs,
   even past what the decodes left of the budget (a step may hold `chunk_size` plus its decodes; its
   forward of prefill chunks never holds more than `chunk_size`: see `schedule`).
3. Waiting requests are admitted first-come first-served while budget, `max_running_requests` and pages
   allow. Admission matches the prefix cache and reserves pages for the whole remaining prompt, so a
   chunked prefill never stalls half-way; an admitted request whose first piece does not fit the step
   is computed from the next step on. A head that finds no pages blocks the ones behind it (no
   starvation). A request whose prefix another request is computing right now waits until those pages
   are cached (one step per prefill chunk) instead of computing them a second time.

Models with per-request state (Gated DeltaNet) also hold a working state slot while running. A state is
valid at exactly one position, so a cached prefix is usable only up to a node that carries a snapshot
(design §3). Snapshots are taken where a prefill chunk ends on a page boundary (chunks for state models
are cut at the prompt's last page boundary, so every prompt leaves one), and at the end of a request:
its working state if it ended on a page boundary, else the copy kept at the last page boundary it
crossed while decoding (`boundary_slot`).

With host/disk tiers (`CacheTiers`), admission continues the device match in host memory: the longest
run of the prompt's next pages found there (for a state model, ending at a host snapshot) is restored
into the pages and state slot just allocated, all or nothing, and inserted into the radix tree. A hit
that disk would extend is prefetched into host memory first; the request waits for it (a step or more)
without holding device memory, like a request waiting for a shared prefix. Pages handed to the radix
tree are backed up to the host as they go in (write-through), or when the device evicts them.

All of it happens in the request's key chain (`Request.chain_root`): a request with a cache salt matches,
waits for and restores only what requests with the same salt left.
"""

from __future__ import annotations

import time
from collections import deque
from enum import Enum
from typing import NamedTuple

from morion.cache.page_keys import extend_page_keys
from morion.cache.radix_cache import RadixCache
from morion.cache.tier_stats import CacheStats
from morion.cache.tiers import PREFETCHING, WAIT, CacheTiers, TierHit
from morion.engine.request import Request, RequestStatus
from morion.engine.thread_times import read_thread_times

# A request starts disk prefetches at most this many times (objects can be evicted from host memory again
# before it gets to them); then it takes what host memory holds.
MAX_PREFETCH_ROUNDS = 3


class ScheduledChunk(NamedTuple):
    """`num_tokens` tokens of `request`, from its first uncomputed one, run in this step."""

    request: Request
    num_tokens: int


class _Admission(Enum):
    ADMITTED = "admitted"
    NO_MEMORY = "no memory"  # blocks the queue: first come, first served
    WAITS_FOR_SHARED_PREFIX = "waits for a shared prefix"  # skipped for one step, keeps its place
    WAITS_FOR_TIERS = "waits for its prefix to arrive from disk"  # likewise


class Scheduler:
    def __init__(
        self,
        prefix_cache: RadixCache,
        chunk_size: int,
        max_running_requests: int,
        enable_prefix_cache: bool = True,
        tiers: CacheTiers | None = None,
        stats: CacheStats | None = None,
    ) -> None:
        self.cache = prefix_cache
        self.pool = prefix_cache.page_pool
        self.slots = prefix_cache.state_slots  # None for models without per-request state
        self.page_size = prefix_cache.page_size
        self.chunk_size = chunk_size
        self.max_running_requests = max_running_requests
        self.enable_prefix_cache = enable_prefix_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: oldest first
        self.num_retractions = 0
        self.tiers = tiers if enable_prefix_cache else None
        self.stats = stats or CacheStats()

    # ----------------------------------------------------------------- queues
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request, reason: str, working_state_valid: bool = True) -> None:
        """Ends a request wherever it is and returns its pages (its computed prefix goes to the cache).
        After a failed step, `working_state_valid` is False: the failed forward may have advanced some
        layers' recurrent state in place, so only snapshots taken before it may go to the cache."""
        if request.status is RequestStatus.RUNNING:
            self._release(request, working_state_valid)
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason

    # --------------------------------------------------------------- schedule
    def schedule(self) -> list[ScheduledChunk]:
        budget = self.chunk_size
        scheduled: list[ScheduledChunk] = []
        for request in [r for r in self.running if r.num_uncomputed == 1]:
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # retracted to make room for an older request in this loop
            if self._grow(request, 1):
                scheduled.append(ScheduledChunk(request, 1))
                budget -= 1
        # A piece runs whole or not at all (its cut points are the request's own, `_chunk`). The step's
        # first one runs even past what the decodes left of the budget: else a piece of a whole unit
        # could never run while anything decodes. So the step's prefill pieces add up to at most
        # `chunk_size` (the first is at most one unit, the others fit in what is left), and the step
        # to at most `chunk_size` plus its decodes; decodes run in forwards of their own
        # (forward_groups.py), so the forward of prefill chunks, the one the warm-up's full chunk
        # sizes activation memory for, never holds more than `chunk_size` tokens.
        prefilling = False
        for request in self.running:
            if request.num_uncomputed > 1:
                chunk = self._chunk(request)
                if chunk <= budget or not prefilling:
                    scheduled.append(ScheduledChunk(request, chunk))
                    budget -= chunk
                    prefilling = True
        deferred: list[Request] = []
        while (
            (budget > 0 or not prefilling) and self.waiting and len(self.running) < self.max_running_requests
        ):
            request = self.waiting.popleft()
            admission = self._admit(request)
            if admission in (_Admission.WAITS_FOR_SHARED_PREFIX, _Admission.WAITS_FOR_TIERS):
                deferred.append(request)
                continue
            if admission is _Admission.NO_MEMORY:
                self.waiting.appendleft(request)
                break
            chunk = self._chunk(request)
            if chunk > budget and prefilling:
                break  # admitted (its prefix and pages held), computed from the next step on
            scheduled.append(ScheduledChunk(request, chunk))
            budget -= chunk
            prefilling = True
        self.waiting.extendleft(reversed(deferred))
        return scheduled

    def _chunk(self, request: Request) -> int:
        """How many of the request's uncomputed tokens its next prefill piece runs: a function of the
        request alone (its tokens and how many of them are computed), never of the step's budget or of
        what else runs.

        Pieces end at the multiples of the alignment unit (`chunk_size` floored to whole pages, at least
        one page) counted from the prompt's token 0, so a request that starts mid-unit (a prefix hit)
        first runs up to the next multiple. The chunked kernels (chunked Gated DeltaNet, extend
        attention) compute a prefix's state differently when it is cut elsewhere, and the cache tiers
        hand that state to later requests and other processes: cut where the step's budget ran out, a
        prompt computed beside other traffic left other bits than the same prompt computed alone.

        And the last page boundary before the final token always ends a piece, so the prompt's *tail*
        (the 1 to page_size tokens after it) is a piece of its own. There a state model leaves a
        snapshot, every model leaves whole pages, and the same prompt sent again (from the device, host
        or disk tier) restores exactly up to there and recomputes exactly the tail, in a forward of the
        tail's own kind (forward_groups.py): as the cold run did, so it answers as the cold run did,
        whatever else runs.
        """
        start, end = request.num_computed, request.num_tokens
        page = self.page_size
        unit = max(page, self.chunk_size // page * page)
        tail = (end - 1) // page * page
        cut = min(end, (start // unit + 1) * unit)
        if start < tail < cut:
            cut = tail
        return cut - start

    def _pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def _alloc(self, num_pages: int) -> list[int] | None:
        if self.pool.num_free < num_pages:
            self.cache.evict(num_pages - self.pool.num_free)
        return self.pool.alloc(num_pages)

    def _alloc_slot(self) -> int | None:
        assert self.slots is not None
        if self.slots.num_free == 0:
            self.cache.evict_snapshots(1)
        return self.slots.alloc()

    def _grow(self, request: Request, num_tokens: int) -> bool:
        """Makes room for `num_tokens` more computed tokens, retracting newer requests if it must."""
        while not self._add_pages(request, num_tokens):
            victim = self.running[-1]
            self.retract(victim)
            if victim is request:
                return False
        return True

    def _add_pages(self, request: Request, num_tokens: int) -> bool:
        """Pages for `num_tokens` more computed tokens, evicting cached pages if needed (never retracting);
        False, with nothing taken, when the pool is short."""
        missing = self._pages_for(request.num_computed + num_tokens) - len(request.pages)
        if missing <= 0:
            return True
        pages = self._alloc(missing)
        if pages is None:
            return False
        request.pages.extend(pages)
        request.owned_pages.update(pages)
        return True

    def _admit(self, request: Request) -> _Admission:
        match_node, matched_tokens, matched_pages, snapshot = self.cache.root, 0, [], None
        hit: TierHit | None = None
        # A request that wants its prompt's logprobs computes every prompt token: a hit has no logits.
        if self.enable_prefix_cache and request.params.prompt_logprobs is None:
            # At least one token must run: its logits give the next token.
            match = self.cache.match_prefix(
                request.packed_token_ids(request.num_tokens - 1), request.chain_root
            )
            match_node, matched_tokens, matched_pages = match.node, match.num_tokens, match.pages
            snapshot = match.snapshot_slot
            if match.page_keys is not None and len(match.page_keys) > len(request.page_keys):
                request.page_keys = list(match.page_keys)  # the prefix's keys, never hashed again
            if self._shares_prefix_in_prefill(request, matched_tokens):
                return _Admission.WAITS_FOR_SHARED_PREFIX
            if self.tiers is not None:
                found = self._find_in_tiers(request, matched_tokens)
                if found in (WAIT, PREFETCHING):
                    return _Admission.WAITS_FOR_TIERS
                hit = found
        self.cache.lock(match_node)  # from here on, eviction cannot take the matched pages or snapshot
        state_slot = None
        if self.slots is not None:
            state_slot = self._alloc_slot()
            if state_slot is None:
                self._give_up(match_node, hit)
                return _Admission.NO_MEMORY
        new_pages = self._alloc(self._pages_for(request.num_tokens) - len(matched_pages))
        if new_pages is None:
            if state_slot is not None:
                self.slots.free(state_slot)
            self._give_up(match_node, hit)
            return _Admission.NO_MEMORY
        computed, tree_slot = matched_tokens, None
        if hit is not None:
            computed, tree_slot = self._restore(hit, new_pages, state_slot)
        elif state_slot is not None:
            # The state after exactly `matched_tokens` tokens: the snapshot, or zeros at the start.
            if snapshot is not None:
                if self.tiers is not None:
                    self.tiers.order_after_restores()  # the snapshot may have been restored this step
                self.slots.copy(snapshot, state_slot)
            else:
                self.slots.zero(state_slot)
        request.state_slot = state_slot
        request.prefix_node = match_node
        request.pages = list(matched_pages) + new_pages
        request.owned_pages = set(new_pages)
        request.num_computed = computed
        request.prefetch_rounds, request.tier_wait_started = 0, None
        if not request.admitted_once:
            request.num_cached_tokens = computed
            request.admitted_once = True
            request.admitted_at = time.perf_counter()
            request.admitted_thread = read_thread_times()
            self._count_hit(matched_tokens, hit)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        if hit is not None:
            self._insert(request, computed, tree_slot)  # restored pages are shareable at once
        return _Admission.ADMITTED

    def _give_up(self, match_node: object, hit: TierHit | None) -> None:
        if hit is not None:
            self.tiers.release(hit)
        self.cache.unlock(match_node)

    def _find_in_tiers(self, request: Request, matched_tokens: int) -> TierHit | str | None:
        keys = self._page_keys(request, (request.num_tokens - 1) // self.page_size)
        started = request.tier_wait_started or time.perf_counter()
        found = self.tiers.find(
            keys, matched_tokens // self.page_size, request.prefetch_rounds < MAX_PREFETCH_ROUNDS, started
        )
        if found in (WAIT, PREFETCHING):
            request.prefetch_rounds += found == PREFETCHING
            request.tier_wait_started = started
        return found

    def _restore(self, hit: TierHit, new_pages: list[int], state_slot: int | None) -> tuple[int, int | None]:
        """Issues the load-back of `hit` into the first of `new_pages` and the working `state_slot`, plus a
        second slot for the radix tree's snapshot when one is free. Returns (tokens computed, that slot)."""
        dst_slots, tree_slot = [], None
        if hit.snapshot_key is not None:
            tree_slot = self._alloc_slot()
            dst_slots = [state_slot] if tree_slot is None else [state_slot, tree_slot]
        self.tiers.restore(hit, new_pages[: hit.num_pages], dst_slots)
        return (hit.start_page + hit.num_pages) * self.page_size, tree_slot

    def _count_hit(self, device_tokens: int, hit: TierHit | None) -> None:
        stats = self.stats
        if device_tokens:
            stats.device_hits += 1
            stats.device_hit_tokens += device_tokens
        if hit is not None:
            disk_tokens = hit.disk_pages * self.page_size
            host_tokens = hit.num_pages * self.page_size - disk_tokens
            if host_tokens:
                stats.host_hits += 1
                stats.host_hit_tokens += host_tokens
            if disk_tokens:
                stats.disk_hits += 1
                stats.disk_hit_tokens += disk_tokens

    def _page_keys(self, request: Request, num_pages: int) -> list[bytes]:
        """Keys of the request's first `num_pages` pages (computed once per request, then extended)."""
        tokens = request.cache_token_ids
        keys = extend_page_keys(request.page_keys, tokens, self.page_size, num_pages, request.chain_root)
        return keys[:num_pages]

    def _shares_prefix_in_prefill(self, request: Request, matched_tokens: int) -> bool:
        """True while a running request's prefill is computing full pages this one could reuse: admitting
        now would compute them twice, one step later they are in the prefix cache."""
        tokens = request.cache_token_ids
        for other in self.running:
            if other.num_computed >= len(other.prompt_token_ids) or other.chain_root != request.chain_root:
                continue  # its prompt pages are cached already, or never shared with this request
            prompt = other.cache_token_ids[: len(other.prompt_token_ids)]
            reach = min(len(tokens) - 1, len(prompt))
            common = next((i for i in range(reach) if tokens[i] != prompt[i]), reach)
            if common // self.page_size * self.page_size > matched_tokens:
                return True
        return False

    # ------------------------------------------------------ speculative decoding
    def reserve_for_verify(self, request: Request, num_tokens: int, num_draft_slots: int) -> bool:
        """Pages for `num_tokens` more computed tokens and `num_draft_slots` draft state slots (models with
        state), evicting cached pages and snapshots if needed but never retracting a request (the
        step's batch is already chosen). False when they do not fit; what was taken stays with the
        request (its next steps need the pages, a later verify the slots)."""
        if not self._add_pages(request, num_tokens):
            return False
        if self.slots is not None:
            while len(request.draft_slots) < num_draft_slots:
                slot = self._alloc_slot()
                if slot is None:
                    return False
                request.draft_slots.append(slot)
        return True

    def after_verified_token(self, request: Request) -> None:
        """Bookkeeping once one more token of a verify forward is committed (`num_computed` + 1, the state
        after it already in `state_slot`): as a decode step, keep the state at a page boundary."""
        request.num_computed += 1
        if self.slots is not None and self.enable_prefix_cache and request.num_computed % self.page_size == 0:
            self._keep_boundary_state(request)

    # ------------------------------------------------------ cache hand-over
    def after_forward(self, request: Request, num_tokens: int) -> None:
        """Bookkeeping once `num_tokens` more tokens of `request` are computed."""
        request.num_computed += num_tokens
        is_decode = num_tokens == 1 and request.num_uncomputed == 0
        if self.slots is None:
            if not is_decode:
                self._cache_computed(request)  # a prefill chunk: its pages are shareable at once
        elif request.num_computed % self.page_size == 0 and self.enable_prefix_cache:
            if is_decode:
                self._keep_boundary_state(request)
            else:
                # Only the tail's snapshot goes to the host tier: the one a returning conversation
                # restores from. Earlier chunks' snapshots stay on the device (each is a whole recurrent
                # state: 75 MB on the 80B model, where a page of K/V is 200 KB), so host memory holds
                # many conversations rather than a few with every chunk's state.
                tail = (request.num_tokens - 1) // self.page_size * self.page_size
                self._cache_computed(
                    request, snapshot_working_state=True, snapshot_to_host=request.num_computed >= tail
                )

    def _keep_boundary_state(self, request: Request) -> None:
        if request.boundary_slot is None:
            request.boundary_slot = self._alloc_slot()
            if request.boundary_slot is None:
                return  # no slot to spare: this request's end will not be resumable past its prompt
        self.slots.copy(request.state_slot, request.boundary_slot)
        request.boundary_position = request.num_computed

    def _cache_computed(
        self,
        request: Request,
        snapshot_working_state: bool = False,
        donate: bool = False,
        snapshot_to_host: bool = True,
    ) -> None:
        """Hands the request's computed full pages to the prefix cache; a running request keeps using
        them, locked. With `snapshot_working_state`, the node at `num_computed` gets the current state
        (a copy, or the working slot itself when `donate`). Under write-through the pages go to the host
        tier too, and the snapshot with them when `snapshot_to_host`."""
        num_tokens = request.num_computed // self.page_size * self.page_size
        if not self.enable_prefix_cache or num_tokens == 0:
            return  # (no full page: a request that failed in its first forward)
        snapshot = None
        if self.slots is not None:
            if snapshot_working_state and num_tokens == request.num_computed:
                snapshot = request.state_slot if donate else self._alloc_slot()
                if snapshot is not None and not donate:
                    self.slots.copy(request.state_slot, snapshot)
            elif request.boundary_slot is not None:
                # Only pages with a snapshot at their end can ever be matched: stop at the boundary.
                num_tokens, snapshot = request.boundary_position, request.boundary_slot
                request.boundary_slot = None
            else:
                return  # pages without a snapshot at their end could never be matched
        if self.tiers is not None and self.tiers.write_through and num_tokens:
            keys = self._page_keys(request, num_tokens // self.page_size)
            pages = request.pages[: num_tokens // self.page_size]
            to_host = snapshot if snapshot_to_host else None
            self.tiers.backup(keys, pages, to_host, keys[-1] if to_host is not None else None)
        self._insert(request, num_tokens, snapshot)

    def _insert(self, request: Request, num_tokens: int, snapshot: int | None) -> None:
        """Inserts the request's first `num_tokens` tokens (page aligned) with `snapshot` at their end, and
        moves the request's lock to the node ending there."""
        pages = request.pages[: num_tokens // self.page_size]
        keys = request.page_keys[: len(pages)] if len(request.page_keys) >= len(pages) else None
        result = self.cache.insert(
            request.packed_token_ids(num_tokens), pages, snapshot, request.chain_root, page_keys=keys
        )
        if snapshot is not None and snapshot == request.state_slot:
            request.state_slot = None  # donated: the cache owns it now (or frees it just below)
        if result.unused_snapshot_slot is not None:
            self.slots.free(result.unused_snapshot_slot)
        request.owned_pages.difference_update(pages[result.num_cached_tokens // self.page_size :])
        self.cache.lock(result.node)
        self.cache.unlock(request.prefix_node)
        request.prefix_node = result.node

    def retract(self, request: Request) -> None:
        """Takes a running request back to the waiting queue; it recomputes its K/V when readmitted."""
        self._release(request)
        self.running.remove(request)
        request.status = RequestStatus.WAITING
        request.num_computed = 0
        # Back in arrival order, ahead of requests that came after it.
        position = next(
            (i for i, r in enumerate(self.waiting) if r.arrival > request.arrival), len(self.waiting)
        )
        self.waiting.insert(position, request)
        self.num_retractions += 1

    def _release(self, request: Request, working_state_valid: bool = True) -> None:
        # Whatever the request computed stays reusable: full pages (and the latest usable snapshot) go
        # to the cache, the rest is freed.
        self._cache_computed(request, snapshot_working_state=working_state_valid, donate=True)
        self.pool.free(sorted(request.owned_pages))
        for slot in (request.state_slot, request.boundary_slot, *request.draft_slots):
            if slot is not None:
                self.slots.free(slot)
        request.draft_slots = []
        self.cache.unlock(request.prefix_node)
        request.pages, request.owned_pages, request.prefix_node = [], set(), None
        request.state_slot, request.boundary_slot, request.boundary_position = None, None, 0

    def pages_held_by_requests(self) -> list[int]:
        return [page for request in self.running for page in request.owned_pages]

    def slots_held_by_requests(self) -> list[int]:
        held = [(r.state_slot, r.boundary_slot, *r.draft_slots) for r in self.running]
        return [slot for group in held for slot in group if slot is not None]
