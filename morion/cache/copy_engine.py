"""Copies between the device pools and the host arena, behind one small interface.

`SyncCopyEngine` copies at once on the calling thread (CPU devices, and the CPU tests); `CudaCopyEngine`
copies on its own stream with events, so the forward overlaps the transfer. Both return a `Transfer`,
which says when the copies are done and lets a layer wait for its own part of a restore.

The async copy rules of design §3 are enforced here and in `tiers.py`; each is written where it holds:
1. Hold host references on the source and destination of every copy until its finish event. Device
   buffers allocated on the copy stream and used by it alone (staging, token slot indices) go back to
   torch's caching allocator as soon as their copies are queued: it hands a freed block only to later
   work of the same stream (which the stream orders after those copies) or, short of memory, frees cached
   blocks to the driver only after synchronizing the device. Holding them until the engine next polled
   the tiers kept up to ~0.5 GiB of staging through the whole next forward, outside the activation
   reserve. The pools' own storage is not the transfer's to hold.
2. A host→device restore into reused pages waits for the forward stream's earlier work on those pages.
3. A device→host backup completes (event) before anything may overwrite its source.
4. A layer that reads restored data waits on that layer's copy event on the GPU (`wait_event`), never on
   the CPU, and for every component it reads.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import torch

from morion.cache.host_store import HostObjectStore
from morion.cache.page_pool import PagePool
from morion.cache.state_slots import StateSlots


class Transfer(ABC):
    """A batch of copies issued together."""

    @abstractmethod
    def done(self) -> bool:
        """True once every copy finished (polled by the engine thread; never blocks)."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block the calling thread until every copy finished (the forward never calls it)."""

    @abstractmethod
    def completion_waiter(self) -> Callable[[], None]:
        """`synchronize` without the transfer: a callable that blocks until every copy finished and holds
        none of the transfer's buffers. A queued disk write keeps it until the writer gets to it, and a
        backup's buffers must not wait for that: on the H200 the writes queued behind a burst of prompts
        once held their backups' device staging (~115 MiB per Flash-Next snapshot) and the next prefill ran
        out of device memory (staging is no longer the transfer's at all: rule 1)."""

    @abstractmethod
    def wait(self, component: str, layer: int) -> None:
        """Order the current stream's later work after the copies of (component, layer): on the GPU,
        without blocking the CPU. A component or layer this transfer does not touch waits for nothing."""

    @abstractmethod
    def wait_all(self) -> None:
        """Order the current stream's later work after every copy of this transfer (GPU-side)."""


class CompletedTransfer(Transfer):
    def done(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def completion_waiter(self) -> Callable[[], None]:
        return _nothing_to_wait_for

    def wait(self, component: str, layer: int) -> None:
        pass

    def wait_all(self) -> None:
        pass


COMPLETED = CompletedTransfer()


def _nothing_to_wait_for() -> None:
    pass


class CopyEngine(ABC):
    """Moves page objects and snapshots between device pools and host stores.

    `backup` copies device pages (and optionally one state slot) into reserved host rows; its sources may
    be reused by the caller as soon as it returns (the engine orders any later device writes after the
    copy has read them, rule 3), its host rows only once the transfer is done. `restore` copies host rows
    into device pages (and a snapshot into one or more state slots); the forward reads them only after
    `wait` for the layer it reads, and the host rows stay pinned until the transfer is done (rule 1).
    """

    @abstractmethod
    def backup(
        self,
        pool: PagePool,
        pages: Sequence[int],
        page_store: HostObjectStore,
        page_rows: Sequence[int],
        slots: StateSlots | None = None,
        slot: int | None = None,
        snapshot_store: HostObjectStore | None = None,
        snapshot_row: int | None = None,
    ) -> Transfer: ...

    @abstractmethod
    def restore(
        self,
        page_store: HostObjectStore,
        page_rows: Sequence[int],
        pool: PagePool,
        pages: Sequence[int],
        snapshot_store: HostObjectStore | None = None,
        snapshot_row: int | None = None,
        slots: StateSlots | None = None,
        dst_slots: Sequence[int] = (),
    ) -> Transfer: ...


def _page_tensors(pool: PagePool, pages: Sequence[int], name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(the component's storage, the flat token slots of `pages`)."""
    return pool.storage(name), pool.token_slots(pages, len(pages) * pool.page_size)


class SyncCopyEngine(CopyEngine):
    """Every copy runs on the calling thread before the call returns; transfers are born done, so rules
    1-4 hold trivially. `_run` is the seam a test uses to keep copies in flight."""

    def _run(self, copies: list[Callable[[], None]]) -> Transfer:
        for copy in copies:
            copy()
        return COMPLETED

    def backup(
        self,
        pool,
        pages,
        page_store,
        page_rows,
        slots=None,
        slot=None,
        snapshot_store=None,
        snapshot_row=None,
    ):
        copies: list[Callable[[], None]] = []
        if pages:
            rows = torch.tensor(list(page_rows), dtype=torch.long)
            n, ps = len(pages), pool.page_size
            for c in pool.spec.token_components:
                storage, token_slots = _page_tensors(pool, pages, c.name)
                dst = page_store.views[c.name]

                def copy(storage=storage, token_slots=token_slots, dst=dst, c=c) -> None:
                    src = storage.index_select(1, token_slots).view(c.num_layers, n, ps, *c.token_shape)
                    dst[rows] = src.transpose(0, 1)

                copies.append(copy)
        if slot is not None:
            for c in pool.spec.state_components:
                storage, dst = slots.storage(c.name), snapshot_store.views[c.name]
                copies.append(lambda storage=storage, dst=dst: dst[snapshot_row].copy_(storage[:, slot]))
        return self._run(copies)

    def restore(
        self,
        page_store,
        page_rows,
        pool,
        pages,
        snapshot_store=None,
        snapshot_row=None,
        slots=None,
        dst_slots=(),
    ):
        copies: list[Callable[[], None]] = []
        if pages:
            rows = torch.tensor(list(page_rows), dtype=torch.long)
            n, ps = len(pages), pool.page_size
            for c in pool.spec.token_components:
                storage, token_slots = _page_tensors(pool, pages, c.name)
                src = page_store.views[c.name]

                def copy(storage=storage, token_slots=token_slots, src=src, c=c) -> None:
                    flat = src[rows].transpose(0, 1).reshape(c.num_layers, n * ps, *c.token_shape)
                    storage[:, token_slots] = flat

                copies.append(copy)
        if snapshot_row is not None:
            for c in pool.spec.state_components:
                storage, src = slots.storage(c.name), snapshot_store.views[c.name]
                for dst in dst_slots:
                    copies.append(
                        lambda storage=storage, src=src, dst=dst: storage[:, dst].copy_(src[snapshot_row])
                    )
        return self._run(copies)


class CudaTransfer(Transfer):
    """Events of copies on the copy stream. `keepalive` holds the pinned host buffers the copies read
    (index tensors' sources) until the transfer is dropped, which the engine does only after `done()`
    (rule 1); device staging is not held (rule 1: the copy stream's own allocations)."""

    def __init__(
        self,
        finished: torch.cuda.Event,
        layer_events: dict[tuple[str, int], torch.cuda.Event],
        keepalive: list[torch.Tensor],
    ) -> None:
        self._finished = finished
        self._layer_events = layer_events
        self._keepalive = keepalive

    def done(self) -> bool:
        return self._finished.query()

    def synchronize(self) -> None:
        self._finished.synchronize()

    def completion_waiter(self) -> Callable[[], None]:
        return self._finished.synchronize  # the event alone, not the host buffers in `_keepalive`

    def wait(self, component: str, layer: int) -> None:
        event = self._layer_events.get((component, layer))
        if event is not None:
            # Rule 4: a GPU-side wait; the CPU goes on queueing the layer's kernels.
            torch.cuda.current_stream().wait_event(event)

    def wait_all(self) -> None:
        torch.cuda.current_stream().wait_event(self._finished)


def _token_slots_async(pool: PagePool, pages: Sequence[int], keepalive: list[torch.Tensor]) -> torch.Tensor:
    """The flat token slots of `pages` on the pool's device, copied from pinned memory without a CPU
    sync (a plain `torch.tensor(..., device=cuda)` would block until the current stream drains). The
    pinned source joins `keepalive` (rule 1)."""
    ps = pool.page_size
    page_ids = torch.tensor(list(pages), dtype=torch.long)
    host = (page_ids[:, None] * ps + torch.arange(ps)).reshape(-1).pin_memory()
    keepalive.append(host)
    return host.to(pool.device, non_blocking=True)


def _runs(rows: Sequence[int]) -> list[tuple[int, int, int]]:
    """Consecutive host rows grouped: (index of the first in `rows`, first row, count)."""
    runs: list[tuple[int, int, int]] = []
    for i, row in enumerate(rows):
        if runs and runs[-1][1] + runs[-1][2] == row:
            start, first, count = runs[-1]
            runs[-1] = (start, first, count + 1)
        else:
            runs.append((i, row, 1))
    return runs


class CudaCopyEngine(CopyEngine):
    """Copies on a dedicated stream between the device pools and pinned host arenas.

    A backup gathers the pages (all layers, every token component) into a device staging buffer laid out
    like host rows, then copies it to the host in as few transfers as the host rows allow. A restore does
    the reverse, scattering layer by layer and recording one event per (component, layer) so that each
    layer of the forward waits only for its own data. Staging and index tensors are allocated inside
    `torch.cuda.stream(self.stream)` and read by the copy stream alone: dropped when the copies are
    queued (rule 1).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def backup(
        self,
        pool,
        pages,
        page_store,
        page_rows,
        slots=None,
        slot=None,
        snapshot_store=None,
        snapshot_row=None,
    ):
        forward = torch.cuda.current_stream(self.device)
        written = torch.cuda.Event()
        written.record(forward)  # the pages hold what every forward queued so far wrote into them
        keepalive: list[torch.Tensor] = []
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(written)
            staged = []  # (staging rows on the device, host store, host rows)
            if pages:
                n, ps = len(pages), pool.page_size
                staging = torch.empty((n, page_store.layout.row_bytes), dtype=torch.uint8, device=self.device)
                views = page_store.layout.views(staging)
                token_slots = _token_slots_async(pool, pages, keepalive)
                for c in pool.spec.token_components:
                    src = pool.storage(c.name).index_select(1, token_slots)
                    views[c.name].copy_(src.view(c.num_layers, n, ps, *c.token_shape).transpose(0, 1))
                staged.append((staging, page_store, list(page_rows)))
            if slot is not None:
                staging = torch.empty(
                    (1, snapshot_store.layout.row_bytes), dtype=torch.uint8, device=self.device
                )
                views = snapshot_store.layout.views(staging)
                for c in pool.spec.state_components:
                    views[c.name][0].copy_(slots.storage(c.name)[:, slot])
                staged.append((staging, snapshot_store, [snapshot_row]))
            gathered = torch.cuda.Event()
            gathered.record(self.stream)
            for staging, store, rows in staged:
                for start, first, count in _runs(rows):
                    store.arena[first : first + count].copy_(
                        staging[start : start + count], non_blocking=True
                    )
            # Blocking: the disk writers wait for it on the CPU (the write job's `before`, cache/tiers.py),
            # and a default event's synchronize spins in the driver, four writers at once beside the
            # engine thread that launches the forward's kernels; a blocking one sleeps until it fires.
            finished = torch.cuda.Event(blocking=True)
            finished.record(self.stream)
        # Rule 3: the pages and the slot may be reused as soon as this returns (they were evicted, or a
        # request goes on writing its working state), so every later forward-stream write waits until
        # the gather above has read them. Copy-stream work (a restore into them) is ordered by the stream.
        forward.wait_event(gathered)
        return CudaTransfer(finished, {}, keepalive)

    def restore(
        self,
        page_store,
        page_rows,
        pool,
        pages,
        snapshot_store=None,
        snapshot_row=None,
        slots=None,
        dst_slots=(),
    ):
        forward = torch.cuda.current_stream(self.device)
        # Rule 2: the destination pages and slots come off the free lists; forward work queued earlier may
        # still read or write them (the request that freed them). The copies start after all of it.
        self.stream.wait_stream(forward)
        keepalive: list[torch.Tensor] = []
        layer_events: dict[tuple[str, int], torch.cuda.Event] = {}
        with torch.cuda.stream(self.stream):
            scatters = []  # (order key, component, layer, copy)
            if pages:
                n, ps = len(pages), pool.page_size
                staging = torch.empty((n, page_store.layout.row_bytes), dtype=torch.uint8, device=self.device)
                for start, first, count in _runs(list(page_rows)):
                    staging[start : start + count].copy_(
                        page_store.arena[first : first + count], non_blocking=True
                    )
                views = page_store.layout.views(staging)
                token_slots = _token_slots_async(pool, pages, keepalive)
                for c in pool.spec.token_components:
                    storage = pool.storage(c.name)
                    for layer in range(c.num_layers):

                        def copy(storage=storage, layer=layer, src=views[c.name][:, layer], c=c) -> None:
                            flat = src.reshape(n * ps, *c.token_shape)
                            # As bytes: index_copy_ has no float8 kernels (an FP8 K/V pool).
                            storage[layer].view(torch.uint8).index_copy_(
                                0, token_slots, flat.view(torch.uint8)
                            )

                        scatters.append((layer / c.num_layers, c.name, layer, copy))
            if snapshot_row is not None:
                staging = torch.empty(
                    (1, snapshot_store.layout.row_bytes), dtype=torch.uint8, device=self.device
                )
                staging.copy_(snapshot_store.arena[snapshot_row : snapshot_row + 1], non_blocking=True)
                views = snapshot_store.layout.views(staging)
                for c in pool.spec.state_components:
                    storage = slots.storage(c.name)
                    for layer in range(c.num_layers):

                        def copy(storage=storage, layer=layer, src=views[c.name][0, layer]) -> None:
                            for dst in dst_slots:
                                storage[layer, dst].copy_(src)

                        scatters.append((layer / c.num_layers, c.name, layer, copy))
            # The model does not tell the cache its layer order; scattering every component at the same
            # relative depth together approximates it (interleaved attention and linear layers).
            scatters.sort(key=lambda item: item[0])
            for _, name, layer, copy in scatters:
                copy()
                event = torch.cuda.Event()
                event.record(self.stream)
                layer_events[(name, layer)] = event
            finished = torch.cuda.Event()
            finished.record(self.stream)
        return CudaTransfer(finished, layer_events, keepalive)


def make_copy_engine(device: torch.device) -> CopyEngine:
    return CudaCopyEngine(device) if device.type == "cuda" else SyncCopyEngine()
