"""The front end's handle on the engine process: spawn it, send it requests, route its outputs.

Two one-way pipes. The outbox is read by an event-loop reader callback (no thread, no future per
message) that hands each engine step's deltas to the `RequestStream`s they belong to, one queue put per
stream per step. Inbox writes go through one worker thread, in order, so that a full pipe (the engine in a
long step while requests pour in) blocks that thread and never the event loop.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from array import array
from collections.abc import AsyncIterator, Callable, MutableMapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from morion.config import EngineConfig
from morion.engine.sampling_params import SamplingParams
from morion.multimodal.image_decode import PreparedImage
from morion.server.arrivals import Arrivals
from morion.server.engine_messages import (
    AbortRequest,
    AddRequest,
    CacheEvicted,
    EngineFailed,
    EngineInfo,
    EngineOutputs,
    EngineStats,
    EvictDeviceCache,
    InboxMessage,
    RequestDelta,
    Shutdown,
)
from morion.server.engine_spawn import EngineProcess
from morion.server.errors import APIError
from morion.server.metrics import ServerMetrics

# Client-side states; /health is 200 only in READY.
LOADING, READY, DRAINING, STOPPED, FAILED = "loading", "ready", "draining", "stopped", "failed"

Batch = list[tuple[int, RequestDelta]]  # (choice index, delta) pairs of one engine step


def delta_error(delta: RequestDelta) -> APIError | None:
    """What the client is told when its engine request ended without an answer, else None: 400 (the engine
    refused the request), 500 (the engine failed on it) or 503 (the server aborted it while shutting down;
    "abort" is no OpenAI finish_reason, and a cut answer must not look like a finished one)."""
    if delta.finish_reason == "abort":
        return APIError(
            503, "the server is shutting down and stopped this request before it finished", code="aborted"
        )
    if delta.finish_reason != "error":
        return None
    if delta.internal:
        return APIError(500, f"the engine failed on this request: {delta.error}", code="engine_error")
    return APIError(400, delta.error or "the engine rejected the request")


class RequestStream:
    """The engine requests behind one HTTP request (one per choice). Their deltas arrive on one queue;
    `close` aborts whatever has not finished and is safe to call more than once."""

    def __init__(
        self, client: EngineClient, request_ids: list[str], arrival: float, submitted: float
    ) -> None:
        """`arrival`: the HTTP request's (perf_counter seconds); `submitted`: when its engine requests were
        handed to the pipe's sender."""
        self.request_ids = request_ids
        self._client = client
        self._arrival = arrival
        self._submitted = submitted
        self._choice = {request_id: index for index, request_id in enumerate(request_ids)}
        self._unfinished = set(request_ids)
        self._last_token_at: dict[str, float] = {}
        self._queue: asyncio.Queue[Batch] = asyncio.Queue()
        self.closed = False
        self.time_to_first_token: float | None = None  # of any of its choices, from the HTTP arrival

    def deliver(self, deltas: list[RequestDelta], now: float) -> None:
        metrics = self._client.metrics
        for delta in deltas:
            if delta.token_ids:
                previous = self._last_token_at.get(delta.request_id)
                if previous is None:
                    metrics.time_to_first_token.observe(now - self._arrival)
                    if delta.first_token_times is not None:
                        metrics.first_token_parts(delta.first_token_times, self._submitted, now)
                    if self.time_to_first_token is None:
                        self.time_to_first_token = now - self._arrival
                else:
                    metrics.inter_token_latency.observe((now - previous) / len(delta.token_ids))
                self._last_token_at[delta.request_id] = now
            if delta.finish_reason is not None:
                metrics.request_finished(delta.finish_reason, delta.usage, now - self._arrival)
        if not self.closed:
            self._queue.put_nowait([(self._choice[d.request_id], d) for d in deltas])

    async def batches(self) -> AsyncIterator[Batch]:
        """Yields every delta, a step's worth at a time (more if the consumer fell behind), until all
        requests have finished."""
        while self._unfinished:
            batch = await self._queue.get()
            while not self._queue.empty():
                batch += self._queue.get_nowait()
            for _, delta in batch:
                if delta.finish_reason is not None:
                    self._unfinished.discard(delta.request_id)
            yield batch

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._client.release(self, sorted(self._unfinished))


class EngineClient:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.state = LOADING
        self.info: EngineInfo | None = None
        self.stats: EngineStats | None = None
        self.failure: str | None = None
        self.metrics = ServerMetrics(
            lambda: (self.info, self.stats), lambda: self._process.pid if self._process else None
        )
        self.open_streams: set[RequestStream] = set()
        self.arrivals = Arrivals()
        self._streams: dict[str, RequestStream] = {}
        self._process: BaseProcess | None = None
        self._inbox: Connection | None = None  # the write end
        self._outbox: Connection | None = None  # the read end
        self._connected = False
        self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="morion-engine-inbox")
        self._evictions: dict[str, asyncio.Future[int]] = {}  # EvictDeviceCache sent, not yet answered
        self._on_ready: Callable[[EngineInfo], None] = lambda info: None
        self._on_fatal: Callable[[str], None] = lambda error: None

    def attach(self, engine: EngineProcess) -> None:
        """Takes over the engine process (`server/engine_spawn.py`: it starts loading at once, and what it
        sends waits in the pipe until `connect`, so the model loads while the front end gets ready)."""
        self._process, self._inbox, self._outbox = engine

    async def connect(self, on_ready: Callable[[EngineInfo], None], on_fatal: Callable[[str], None]) -> None:
        assert self._process is not None and self._outbox is not None
        self._on_ready, self._on_fatal = on_ready, on_fatal
        loop = asyncio.get_running_loop()
        loop.add_reader(self._outbox.fileno(), self._drain_outbox)
        loop.add_reader(self._process.sentinel, self._on_process_exit)
        self._connected = True

    # --------------------------------------------------------------- requests
    def submit(
        self,
        work: Sequence[tuple[list[int], SamplingParams, tuple[PreparedImage, ...]]],
        arrival: float,
        scope: MutableMapping[str, Any],
    ) -> RequestStream:
        """Each (prompt token ids, sampling parameters, the prompt's images) as an engine request, for the
        HTTP request of ASGI `scope` (its count among the arrivals ends here: server/arrivals.py)."""
        prefix = uuid.uuid4().hex
        submitted = time.perf_counter()
        self.metrics.first_token_part["prepare"].observe(submitted - arrival)
        stream = RequestStream(self, [f"{prefix}-{i}" for i in range(len(work))], arrival, submitted)
        self.open_streams.add(stream)
        self.arrivals.handed_over(scope)
        others = self.arrivals.waiting > 0
        requests = list(zip(stream.request_ids, work, strict=True))
        for index, (request_id, (prompt, params, images)) in enumerate(requests):
            self._streams[request_id] = stream
            more = others or index < len(requests) - 1  # other requests, or this one's other choices
            self._send(AddRequest(request_id, array("q", prompt), params, images, more_coming=more))
        return stream

    def release(self, stream: RequestStream, unfinished: list[str]) -> None:
        # The aborted requests stay routed to the closed stream until their last delta, which only
        # updates the metrics.
        if self.state not in (FAILED, STOPPED):
            for request_id in unfinished:
                self._send(AbortRequest(request_id))
        self.open_streams.discard(stream)

    async def evict_device_cache(self) -> int:
        """Asks the engine to drop its device prefix cache's unused pages (cached conversations stay in
        the host and disk tiers); returns how many pages it freed."""
        reply_id = uuid.uuid4().hex
        done = self._evictions[reply_id] = asyncio.get_running_loop().create_future()
        self._send(EvictDeviceCache(reply_id))
        try:
            return await done
        finally:
            self._evictions.pop(reply_id, None)

    def abort_all(self) -> None:
        """Ends every open stream's requests; each stream then ends with a 503 error (serving.py)."""
        for request_id in list(self._streams):
            self._send(AbortRequest(request_id))

    def _send(self, message: InboxMessage) -> None:
        # A failed send (the engine died) is reported by the process sentinel, not here.
        if self._inbox is not None:
            self._sender.submit(self._inbox.send, message)

    # ---------------------------------------------------------------- outputs
    def _drain_outbox(self) -> None:
        # The engine writes each message whole, so a readable pipe holds at least the start of one and
        # recv() waits at most for the rest of a write already in progress.
        outbox = self._outbox
        assert outbox is not None
        while outbox.poll():
            try:
                message = outbox.recv()
            except EOFError:  # the engine has exited; _on_process_exit says how
                asyncio.get_running_loop().remove_reader(outbox.fileno())
                return
            if isinstance(message, EngineOutputs):
                self._deliver(message)
            elif isinstance(message, EngineInfo):
                self._ready(message)
            elif isinstance(message, CacheEvicted):
                done = self._evictions.get(message.reply_id)
                if done is not None and not done.done():
                    done.set_result(message.pages)
            elif isinstance(message, EngineFailed):
                self._fail(message.error)

    def _ready(self, info: EngineInfo) -> None:
        # READY only once the ready path has run: an error there must stop the server, not leave it
        # half alive (/health 200 while the rest of start-up never happened).
        try:
            self._on_ready(info)
        except Exception as error:
            detail = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
            self._fail(f"start-up failed after the engine loaded: {detail}")
            return
        self.info = info
        if self.state == LOADING:
            self.state = READY

    def _deliver(self, message: EngineOutputs) -> None:
        if message.stats is not None:  # else the last ones still stand (the engine sends them periodically)
            self.stats = message.stats
        now = time.perf_counter()
        by_stream: dict[RequestStream, list[RequestDelta]] = {}
        for delta in message.deltas:
            stream = self._streams.get(delta.request_id)
            if stream is None:
                continue  # routes are only dropped by _fail, after which nothing arrives
            if delta.finish_reason is not None:
                del self._streams[delta.request_id]
            by_stream.setdefault(stream, []).append(delta)
        for stream, deltas in by_stream.items():
            stream.deliver(deltas, now)

    def _on_process_exit(self) -> None:
        assert self._process is not None
        asyncio.get_running_loop().remove_reader(self._process.sentinel)
        if self.state != STOPPED:
            self._process.join(1)  # the sentinel fired: it has exited, reaping it is immediate
            self._fail(f"the engine process exited unexpectedly (exit code {self._process.exitcode})")

    def _fail(self, error: str) -> None:
        if self.state == FAILED:
            return
        self.state, self.failure = FAILED, error
        now = time.perf_counter()
        by_stream: dict[RequestStream, list[RequestDelta]] = {}
        for request_id, stream in self._streams.items():
            delta = RequestDelta(request_id, [], "", None, None, "error", None, error, internal=True)
            by_stream.setdefault(stream, []).append(delta)
        self._streams.clear()
        for stream, deltas in by_stream.items():
            stream.deliver(deltas, now)
        for done in self._evictions.values():
            if not done.done():
                done.set_exception(RuntimeError(error))
        self._on_fatal(error)

    # --------------------------------------------------------------- shutdown
    def kill_now(self) -> None:
        """Kills the engine without waiting or reaping (a forced exit; callable from a signal handler). Its
        requests get no last delta: the process is about to end with their connections."""
        self.state = STOPPED  # its exit is expected: no "exited unexpectedly" failure
        if self._process is not None:
            self._process.kill()  # SIGKILL; returns at once

    async def close(self, timeout: float = 10.0) -> None:
        """Stops the engine (it aborts what is left), waits up to `timeout` s, then kills it."""
        previous, self.state = self.state, STOPPED
        process = self._process
        assert process is not None and self._outbox is not None
        if self._connected:
            loop = asyncio.get_running_loop()
            loop.remove_reader(self._outbox.fileno())
            loop.remove_reader(process.sentinel)
        if previous == LOADING:
            process.kill()  # nothing in flight, and loading could take minutes
        elif process.is_alive():  # also after a failure on the front end's side: the engine is fine
            self._send(Shutdown())
        await asyncio.to_thread(process.join, timeout)
        if process.is_alive():
            process.kill()
            await asyncio.to_thread(process.join, 5)
        await asyncio.to_thread(self._close_pipes)

    def _close_pipes(self) -> None:
        # The engine is gone, so a send still queued fails at once instead of blocking the shutdown.
        self._sender.shutdown(wait=True)
        for connection in (self._inbox, self._outbox):
            if connection is not None:
                connection.close()
        self._inbox = self._outbox = None
