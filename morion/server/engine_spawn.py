"""Starting the engine process, light enough to run before the front end imports anything heavy.

`morion serve` spawns the engine first, so that the engine's imports (torch alone takes 3 s on a 2-core
CPU) and its model load overlap the front end's own imports and tokenizer read. Nothing here imports
torch: the config is pickled as it is, and the engine's entry point is imported in the engine process.
"""

from __future__ import annotations

import multiprocessing
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import NamedTuple

from morion.config import EngineConfig


class EngineProcess(NamedTuple):
    process: BaseProcess
    inbox: Connection  # the front end's write end: requests, aborts, shutdown
    outbox: Connection  # the front end's read end: EngineInfo, then one EngineOutputs per step


def spawn_engine(config: EngineConfig) -> EngineProcess:
    """The engine starts loading at once; what it sends waits in the pipe until the front end reads."""
    context = multiprocessing.get_context("spawn")
    inbox_read, inbox_write = context.Pipe(duplex=False)
    outbox_read, outbox_write = context.Pipe(duplex=False)
    process = context.Process(
        target=_engine_main,
        args=(config, inbox_read, outbox_write),
        name="morion-engine",
        daemon=True,  # never outlive the front end
    )
    process.start()
    # The engine holds its own copies; with ours closed, end-of-file on a pipe means the peer is gone.
    inbox_read.close()
    outbox_write.close()
    return EngineProcess(process, inbox_write, outbox_read)


def kill_engine(engine: EngineProcess) -> None:
    """For a start-up that fails before the front end runs: the engine has nothing in flight."""
    if engine.process.is_alive():
        engine.process.kill()
        engine.process.join(5)
    engine.inbox.close()
    engine.outbox.close()


def _engine_main(config: EngineConfig, inbox: Connection, outbox: Connection) -> None:
    from morion.server.engine_process import run_engine_process  # imported in the engine process only

    run_engine_process(config, inbox, outbox)
