"""`morion serve`: spawn the engine, load the tokenizer, run uvicorn, drain on SIGTERM.

Start-up order: the model path is resolved (pulling the default model once), the engine process is
spawned and starts loading, the front end imports its own modules and reads the tokenizer meanwhile (this
module imports nothing heavy before the spawn), then uvicorn listens; /health answers 503 until the
engine reports ready and the ready path (the startup summary) has run. An error in that path stops the
server with one `morion: error:` line and exit status 1, never a half-started server.

`preset:NAME` serves random weights of a preset's shapes with no tokenizer: /v1/completions takes token
ids and answers with `token_ids`; text prompts and chat get a 400 that says why.

Shutdown: the first SIGTERM or SIGINT stops admission (/health 503, new completions 503), lets in-flight
requests finish for up to `shutdown_timeout` seconds, aborts the rest, then stops uvicorn and the engine
and exits 0. A second signal kills the engine and grammar processes and ends the front end at once, by
that signal: waiting for anything (uvicorn's connections, the engine, which ignores SIGTERM, or Python's
exit-time join of its children) is what a second signal is sent to cut short.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import socket
import sys
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, NoReturn

import uvicorn

from morion.errors import MorionError
from morion.loader.model_store import DEFAULT_MODEL
from morion.loader.resolve import is_model_name, resolve_model_path
from morion.logs import LEVEL_VARIABLE, show_morion_logs
from morion.models.presets import is_preset, preset_config
from morion.server.engine_spawn import kill_engine, spawn_engine
from morion.server.options import ServeOptions

if TYPE_CHECKING:
    from morion.server.app import ServerContext
    from morion.server.engine_client import EngineClient
    from morion.server.engine_messages import EngineInfo

_ABORT_GRACE_S = 2.0  # after aborting what outlived the drain, how long its streams get to end


def served_names(requested: str | None, model: str | None, path: Path | None) -> list[str]:
    """The name /v1/models lists first, then aliases a client may also send (the --model text).
    `path` is None for a preset, which is served by its `preset:NAME`."""
    if requested:
        primary = requested
    elif path is None:
        primary = model
    elif is_model_name(model):  # the default, a known name or a Hugging Face id: the name, not a path
        primary = model or DEFAULT_MODEL
    else:
        primary = path.name if path.is_dir() else path.stem
    return list(dict.fromkeys(name for name in (primary, model) if name))


def serve(options: ServeOptions) -> None:
    """Runs until shut down; raises MorionError when the engine cannot start or dies."""
    _check_can_listen(options.host, options.port)  # before minutes of loading, not after
    model = options.engine.model
    path = None
    if is_preset(model):
        preset_config(model)  # an unknown preset fails here, before the engine starts
    else:
        path = resolve_model_path(model)
        options = dataclasses.replace(options, engine=dataclasses.replace(options.engine, model=str(path)))
    names = served_names(options.served_model_name, model, path)
    os.environ[LEVEL_VARIABLE] = options.log_level  # the engine process reads it
    show_morion_logs(options.log_level)
    engine = spawn_engine(options.engine)
    print(
        f"morion serve: loading {names[0]} in the engine process (pid {engine.process.pid}); "
        "/health answers 503 until it is ready",
        file=sys.stderr,
        flush=True,
    )
    try:
        # The front end's own imports (fastapi, its request models, torch through the engine's messages)
        # run here, while the engine loads: before the spawn they delayed it by seconds.
        from uvicorn.protocols.http.auto import AutoHTTPProtocol

        from morion.loader.tokenizer_loader import load_tokenizer
        from morion.server.app import ServerContext, create_app
        from morion.server.describe import startup_summary
        from morion.server.engine_client import EngineClient
        from morion.server.heap_freeze import freeze_startup_heap
        from morion.server.http_guards import with_header_deadline

        client = EngineClient(options.engine)
        client.attach(engine)
        tokenizer = load_tokenizer(path) if path is not None else None
    except BaseException:
        kill_engine(engine)
        raise
    fatal: list[str] = []

    def on_ready(info: EngineInfo) -> None:
        summary = startup_summary(options, names, info, has_tokenizer=tokenizer is not None)
        print(summary, file=sys.stderr, flush=True)
        freeze_startup_heap()  # fastapi, the tokenizer, torch's modules: no full collection walks them

    def on_fatal(error: str) -> None:
        fatal.append(error)
        server.should_exit = True

    context = ServerContext(options, client, tokenizer, names, on_ready, on_fatal)
    config = uvicorn.Config(
        create_app(context),
        host=options.host,
        port=options.port,
        http=with_header_deadline(AutoHTTPProtocol, options.read_timeout),
        access_log=False,  # a log line per request costs more than a token; /metrics counts requests
        timeout_graceful_shutdown=5,
        log_level=options.log_level,
    )
    server = _DrainingServer(config, context, options.shutdown_timeout)
    server.run()
    if fatal:
        raise MorionError(fatal[0])


def _check_can_listen(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.create_server((host, port), family=family):
            pass
    except OSError as error:
        raise MorionError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None


class _DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, context: ServerContext, drain_timeout: float) -> None:
        super().__init__(config)
        self._context = context
        self._client = context.client
        self._drain_timeout = drain_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._signalled = False
        self._draining: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:  # type: ignore[override]
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # uvicorn's own handler records the signal and re-raises it after shutdown, which would end the
        # process with the signal's status; a drained shutdown exits 0 instead.
        if self._loop is None or self._signalled:
            self._stop_at_once(sig)
        self._signalled = True
        self._loop.call_soon_threadsafe(self._start_drain)

    def _stop_at_once(self, sig: int) -> NoReturn:
        print(
            f"morion serve: {signal.Signals(sig).name} again: stopping at once, "
            f"{len(self._client.open_streams)} request(s) cut off",
            file=sys.stderr,
            flush=True,
        )
        self._context.stop_at_once()
        sys.stdout.flush()
        signal.signal(sig, signal.SIG_DFL)
        signal.raise_signal(sig)  # ends the process as the signal does by default
        os._exit(128 + sig)  # for a signal whose default action is not to end the process

    def _start_drain(self) -> None:
        if self._draining is None:
            self._draining = asyncio.create_task(self._drain())

    async def _drain(self) -> None:
        from morion.server.engine_client import DRAINING, READY  # imported by serve() before this runs

        client = self._client
        if client.state == READY:
            client.state = DRAINING
            pending = len(client.open_streams)
            print(
                f"morion serve: draining {pending} request(s) for up to {self._drain_timeout:g} s",
                file=sys.stderr,
                flush=True,
            )
            await _wait_until_no_streams(client, self._drain_timeout)
            if client.open_streams:
                print(
                    f"morion serve: aborting {len(client.open_streams)} request(s)",
                    file=sys.stderr,
                    flush=True,
                )
                client.abort_all()
                await _wait_until_no_streams(client, _ABORT_GRACE_S)
        self.should_exit = True


async def _wait_until_no_streams(client: EngineClient, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while client.open_streams and time.monotonic() < deadline:
        await asyncio.sleep(0.05)  # only while draining, never on the serving path
