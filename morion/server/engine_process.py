"""The engine process of `morion serve`: owns the Engine, steps it while there is work, blocks on its inbox
when idle. The front end never imports this module (it imports torch and the engine); `engine_spawn.py`
names it for the spawned process.

The front end spawns `run_engine_process` and talks to it over two one-way pipes (`engine_messages.py`):
requests and aborts come in on the inbox, one `EngineOutputs` per step goes out on the outbox. They are
plain pipes, written and read by the threads that make and use the messages: no I/O thread wakes per
token to compete with the model's threads for the cores. A request whose own sampling or output
handling raises is failed alone by the engine (`Engine._fail`); an unexpected error of a whole step (the
forward) fails the requests that were in flight. Either way each gets an internal error (HTTP 500) whose
text names no internals, the traceback goes to the log, and the loop keeps serving.
"""

from __future__ import annotations

import signal
import sys
import time
import traceback
from multiprocessing.connection import Connection

import torch

from morion.config import EngineConfig
from morion.engine.engine import Engine
from morion.engine.outputs import internal_error
from morion.errors import InvalidRequestError, MorionError
from morion.logs import show_morion_logs
from morion.server.engine_messages import (
    AbortRequest,
    AddRequest,
    CacheEvicted,
    EngineFailed,
    EngineInfo,
    EngineOutputs,
    EngineStats,
    EvictDeviceCache,
    ImageInputs,
    InboxMessage,
    RequestDelta,
    Shutdown,
    SpecSnapshot,
)
from morion.server.heap_freeze import freeze_startup_heap
from morion.server.heap_trim import HEAP_TRIM_IDLE_S, release_free_heap
from morion.spec.speculative import SpeculativeDecoding

_CUDA_ALLOCATED_PERIOD_S = 1.0
STATS_PERIOD_S = 0.05  # while busy, outputs carry the engine stats at most this often (serve)
IDLE_CHECK_DELAY_S = 0.1  # the idle integrity check runs once nothing has come for this long (serve)
# How long an idle engine told that more requests are coming waits for them before its first step
# (`gather_burst`): the front end hands a burst over within a few ms (a 33K-token prompt's parsing is ~3).
BURST_WAIT_S = 0.01


class EngineLoop:
    """Turns inbox messages and engine steps into `RequestDelta`s; the transport lives in `serve`."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.stopped = False
        # Every request the engine holds, by id, in arrival order (what Shutdown aborts, a failed step fails).
        self._live: dict[str, None] = {}
        self._integrity = "ok"
        self._cache_memory_bytes = engine.cache_memory_bytes()
        self.replies: list[CacheEvicted] = []  # answers to control messages, sent before the next outputs
        self._cuda_allocated = 0
        self._cuda_allocated_due = 0.0  # time.monotonic() after which the next stats read it again
        self.more_coming = False  # the last request handled said others were on their way (arrivals.py)

    # ----------------------------------------------------------------- inbox
    def handle(self, message: InboxMessage) -> list[RequestDelta]:
        if isinstance(message, AddRequest):
            self.more_coming = message.more_coming
            return self._add(message)
        if isinstance(message, AbortRequest):
            return self._abort(message.request_id)
        if isinstance(message, Shutdown):
            self.stopped = True
            return [delta for request_id in list(self._live) for delta in self._abort(request_id)]
        if isinstance(message, EvictDeviceCache):
            self.replies.append(CacheEvicted(message.reply_id, self.engine.evict_device_cache()))
            return []
        raise TypeError(f"unknown inbox message {message!r}")

    def _add(self, message: AddRequest) -> list[RequestDelta]:
        try:
            self.engine.add_request(
                message.prompt_token_ids, message.params, message.request_id, images=message.images
            )
        except InvalidRequestError as error:
            return [_error_delta(message.request_id, str(error), internal=False)]
        except Exception:
            traceback.print_exc()
            return [_error_delta(message.request_id, internal_error(message.request_id), internal=True)]
        self._live[message.request_id] = None
        return []

    def _abort(self, request_id: str) -> list[RequestDelta]:
        if request_id not in self._live:
            return []  # finished already; its last delta is on its way
        del self._live[request_id]
        final = self.engine.abort(request_id)
        usage = final.usage if final is not None else None
        return [RequestDelta(request_id, [], "", None, None, "abort", usage)]

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestDelta]:
        try:
            steps = self.engine.step()
        except Exception:
            traceback.print_exc()
            return self._fail_all()
        deltas = []
        for step in steps:
            if step.request_id not in self._live:
                continue  # failed earlier (`_fail_all`) while the engine still held it: its error is sent
            ending = {}
            if step.final is not None:
                del self._live[step.request_id]
                final = step.final
                ending = {
                    "finish_reason": final.finish_reason,
                    "usage": final.usage,
                    "error": final.error,
                    "stop_reason": final.stop_reason,
                    "internal": final.finish_reason == "error",  # the engine's own failure on this request
                }
            deltas.append(
                RequestDelta(
                    step.request_id,
                    step.new_token_ids,
                    step.new_text,
                    step.logprobs,
                    step.top_logprobs,
                    prompt_logprobs=step.prompt_logprobs,
                    first_token_times=step.first_token_times,
                    **ending,
                )
            )
        return deltas

    def _fail_all(self) -> list[RequestDelta]:
        deltas = []
        for request_id in list(self._live):
            del self._live[request_id]
            try:
                self.engine.abort(request_id, after_failed_step=True)
            except Exception:
                traceback.print_exc()  # the engine is in trouble; the integrity check will say how much
            deltas.append(_error_delta(request_id, internal_error(request_id), internal=True))
        return deltas

    # ----------------------------------------------------------------- state
    def check_integrity(self) -> None:
        """Only meaningful while idle: then every page is free or cached."""
        try:
            self.engine.check_integrity()
        except Exception as error:
            traceback.print_exc()
            self._integrity = _describe(error)
        else:
            self._integrity = "ok"

    def measure_cache_memory(self) -> None:
        """Only meaningful while idle: what the caches hold then is what a soak may subtract."""
        self._cache_memory_bytes = self.engine.cache_memory_bytes()

    def stats(self) -> EngineStats:
        return EngineStats(
            **self.engine.load()._asdict(),  # running, waiting, pages free / cached / held, retractions
            integrity=self._integrity,
            cache_memory_bytes=self._cache_memory_bytes,
            cache=self.engine.cache_stats.snapshot(),
            cuda_allocated_bytes=self._cuda_allocated_bytes(),
            spec=_spec_snapshot(self.engine.speculative),
            step_times=self.engine.step_times.snapshot(),
            forwards=self.engine.forward_counts(),
        )

    def _cuda_allocated_bytes(self) -> int:
        """torch's CUDA allocations, read at most once a second: `memory_allocated` builds the allocator's
        whole statistics dict (0.15 ms a call on the H200 box, 2 % of an 80B decode step when read every
        step), and a gauge scraped every few seconds needs no fresher value."""
        if self.engine.device.type != "cuda":
            return 0
        now = time.monotonic()
        if now >= self._cuda_allocated_due:
            self._cuda_allocated = torch.cuda.memory_allocated(self.engine.device)
            self._cuda_allocated_due = now + _CUDA_ALLOCATED_PERIOD_S
        return self._cuda_allocated


def _spec_snapshot(speculative: SpeculativeDecoding | None) -> SpecSnapshot | None:
    if speculative is None:
        return None
    stats = speculative.stats
    return SpecSnapshot(
        method=speculative.drafter.name,
        verify_steps=stats.verify_steps,
        drafted_tokens=stats.drafted_tokens,
        accepted_tokens=stats.accepted_tokens,
        emitted_tokens=stats.emitted_tokens,
        drafted_by_position=tuple(stats.drafted_by_position),
        accepted_by_position=tuple(stats.accepted_by_position),
        active_width=stats.active_width,
        max_width=speculative.policy.max_width,
        mean_accepted_length=stats.mean_accepted_length,
    )


def _error_delta(request_id: str, message: str, internal: bool) -> RequestDelta:
    return RequestDelta(request_id, [], "", None, None, "error", None, message, internal)


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def engine_info(engine: Engine) -> EngineInfo:
    model_config = engine.model.config
    pool = engine.pool
    return EngineInfo(
        config=engine.config,
        model_path=str(engine.model_path),
        model_type=model_config.model_type,
        device=str(engine.device),
        dtype=str(engine.config.torch_dtype).removeprefix("torch."),
        context_length=model_config.max_position_embeddings,
        vocab_size=model_config.vocab_size,
        max_model_len=engine.max_model_len,
        max_model_len_limit=engine.max_model_len_limit,
        num_pages=pool.num_pages,
        pool_tokens=engine.pool_tokens,
        bytes_per_token=pool.num_bytes // (pool.num_pages * engine.config.page_size),
        pool_bytes=pool.num_bytes,
        device_name=torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else "cpu",
        images=_image_inputs(engine),
    )


def _image_inputs(engine: Engine) -> ImageInputs | None:
    encoder = engine.image_encoder
    if encoder is None:
        return None
    return ImageInputs(encoder.processing, engine.model.config.image_tokens.image)


def serve(loop: EngineLoop, inbox: Connection, outbox: Connection) -> None:
    """Runs until Shutdown. Raises EOFError or BrokenPipeError when the front end is gone."""
    times = loop.engine.step_times
    stats_due = 0.0  # time.monotonic() from which the next outputs carry stats
    worked = False  # since the heap was last trimmed
    unchecked = False  # gone idle since the last integrity check
    while not loop.stopped:
        if not loop.engine.has_unfinished():
            # Idle. The pool's integrity check walks every page and host object (30 ms on the CPU at the
            # 80B preset's 263K pages and a full host tier of 98K objects) and so waits until nothing has
            # come for IDLE_CHECK_DELAY_S: a client's next request, sent a few ms after its last answer,
            # must not wait for it. Its result follows in a message of its own, with what the caches hold
            # (cache_memory.py).
            if unchecked and not inbox.poll(IDLE_CHECK_DELAY_S):
                loop.check_integrity()
                loop.measure_cache_memory()
                outbox.send(EngineOutputs([], loop.stats()))
                unchecked = False
            # Once nothing has come for HEAP_TRIM_IDLE_S, the heap memory the work freed goes back to the OS
            # (heap_trim.py: resident memory is then what is in use). Not at once, for the same reason:
            # back-to-back requests would pay the trim (up to 14 ms measured on the CPU) and fault the
            # pages in again.
            if worked and not inbox.poll(HEAP_TRIM_IDLE_S):
                release_free_heap()
                worked = False
            inbox.poll(None)  # sleep until a message arrives (or the front end's end closes)
        busy_since = time.perf_counter()
        was_idle = not loop.engine.has_unfinished()
        deltas: list[RequestDelta] = []
        handled = False
        loop.more_coming = False
        while inbox.poll():
            deltas += loop.handle(inbox.recv())
            handled = True
        if was_idle:
            deltas += gather_burst(loop, inbox)
        if loop.stopped:
            break
        for reply in loop.replies:
            outbox.send(reply)
        loop.replies.clear()
        if loop.engine.has_unfinished():
            deltas += loop.step()
        if deltas or handled:
            worked = True
            # Stats ride along at most every STATS_PERIOD_S while busy, and always once idle: building and
            # pickling them every step cost ~0.1 ms of the serving path's per-token time.
            now = time.monotonic()
            stats = None
            if now >= stats_due or not loop.engine.has_unfinished():
                stats, stats_due = loop.stats(), now + STATS_PERIOD_S
            outbox.send(EngineOutputs(deltas, stats))
            times.busy_seconds += time.perf_counter() - busy_since  # the next stats carry it
            if not loop.engine.has_unfinished():
                # Gone idle: the stats with the loop's busy time follow at once, the integrity check later
                # (above).
                outbox.send(EngineOutputs([], loop.stats()))
                unchecked = True


def gather_burst(loop: EngineLoop, inbox: Connection) -> list[RequestDelta]:
    """An idle engine's wait for the rest of a burst (server/arrivals.py): while the last request handled
    says more are on their way, up to BURST_WAIT_S in all, the inbox's next messages are handled before the
    first step, so that the burst's prompts share its prefill forward instead of the first one running
    alone. A busy engine never waits: what comes joins its next step anyway."""
    deltas: list[RequestDelta] = []
    deadline = time.perf_counter() + BURST_WAIT_S
    while loop.more_coming and not loop.stopped:
        remaining = deadline - time.perf_counter()
        if remaining <= 0 or not inbox.poll(remaining):
            break
        while inbox.poll():
            deltas += loop.handle(inbox.recv())
    return deltas


def run_engine_process(config: EngineConfig, inbox: Connection, outbox: Connection) -> None:
    """Entry point of the spawned engine process."""
    # Ctrl-C, and a SIGTERM sent to the whole process group or cgroup (timeout, systemd), also reach the
    # engine; it must keep serving while the front end drains, so only the front end decides when it stops
    # (Shutdown, or closing its end of the pipes).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    show_morion_logs()
    try:
        try:
            engine = Engine(config)
            info = engine_info(engine)
        except MorionError as error:  # a user-fixable problem: one line is enough
            outbox.send(EngineFailed(str(error)))
            sys.exit(1)
        except Exception as error:
            traceback.print_exc()
            outbox.send(EngineFailed(_describe(error)))
            sys.exit(1)
        # The model, torch and the pool: no full collection walks them mid-step. Before the front end hears
        # the engine is ready, so that no request waits for the collection this starts with.
        freeze_startup_heap()
        outbox.send(info)
        loop = EngineLoop(engine)
        # Load and cache figures from the start (/metrics, /v1/server_info), not only after a first request:
        # a soak's starting point needs them.
        outbox.send(EngineOutputs([], loop.stats()))
        try:
            serve(loop, inbox, outbox)
        finally:
            # Whatever ended serving: finish the disk tier's writes, so the next start finds this run's
            # conversations.
            engine.close()
    except (EOFError, BrokenPipeError):
        pass  # the front end has gone; nobody is left to serve
    finally:
        inbox.close()
        outbox.close()
