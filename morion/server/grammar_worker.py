"""Grammar compilation in a child process that the front end bounds in time, memory and output size.

xgrammar's compile time and memory grow faster than a schema does (on the project's CPU machine: 200
required string properties take 0.9 s and give an 8.7 MB grammar; 1,000 take 32 s and 3.4 GB; a 43 KB
schema of 100 objects of 10 properties takes 30 s, 2.3 GB and gives 312 MB), and a 13-character regex,
`[a-z]{1,3000}`, takes a second. A thread cannot be stopped nor its memory bounded, so the compiler runs
in a child process: `GrammarWorker.compile` waits for its answer while watching the clock and the child's
resident memory, and kills it past either bound (the next compilation starts a fresh child). A compiled
grammar over `MAX_COMPILED_BYTES` is refused as well, as it travels to the engine with every request
that uses it. Each refusal is a `GrammarTooLarge` naming the bound, which the server answers with a 400.

Memory is watched through /proc (Linux); elsewhere only the time and size bounds hold.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path

from morion.engine.grammar import GrammarError, GrammarSpec, compile_spec

MAX_COMPILED_BYTES = 32 * 2**20
_WATCH_INTERVAL_S = 0.02
_START_TIMEOUT_S = 120.0  # importing torch and xgrammar on a busy machine
# A child that kept this share of its memory bound after a compilation is replaced, so that what one huge
# grammar left in its heap is not carried on.
_RECYCLE_SHARE = 0.5
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class GrammarTooLarge(GrammarError):
    """The grammar was refused because compiling it passed a bound (time, memory or size)."""


class GrammarWorker:
    """One compiler child, started on first use; `compile` is thread-safe and compiles one at a time."""

    def __init__(self, tokenizer_info_json: str, timeout_s: float, memory_bytes: int) -> None:
        self._tokenizer_info_json = tokenizer_info_json
        self.timeout_s = timeout_s
        self.memory_bytes = memory_bytes
        self._process: multiprocessing.process.BaseProcess | None = None
        self._connection: Connection | None = None
        self._baseline_bytes = 0
        self._lock = threading.Lock()
        self.restarts = 0  # children killed or replaced so far

    def compile(self, spec: GrammarSpec) -> str:
        """The serialized compiled grammar. Raises GrammarError (invalid spec) or GrammarTooLarge."""
        with self._lock:
            connection = self._started()
            connection.send((spec.kind, spec.source))
            reply = self._wait_for_reply(connection)
            if self._resident_bytes() > self._baseline_bytes + self.memory_bytes * _RECYCLE_SHARE:
                self._stop()
        status, value = reply
        if status == "ok":
            return value
        if status == "too_large":
            raise GrammarTooLarge(
                f"the compiled grammar would be {value / 2**20:.0f} MiB, over the "
                f"{MAX_COMPILED_BYTES / 2**20:.0f} MiB limit; simplify the schema"
            )
        raise GrammarError(value)

    def _wait_for_reply(self, connection: Connection) -> tuple[str, object]:
        deadline = time.monotonic() + self.timeout_s
        limit = self._baseline_bytes + self.memory_bytes
        while not connection.poll(_WATCH_INTERVAL_S):
            if time.monotonic() > deadline:
                self._stop()
                raise GrammarTooLarge(
                    f"compiling the grammar took longer than {self.timeout_s:g} s (the server's "
                    "--grammar-timeout); simplify the schema"
                )
            if self._resident_bytes() > limit:
                self._stop()
                raise GrammarTooLarge(
                    f"compiling the grammar needed more than {self.memory_bytes / 2**30:g} GiB (the "
                    "server's --grammar-memory-gb); simplify the schema"
                )
        try:
            return connection.recv()
        except EOFError:  # killed from outside (the kernel's OOM killer, an operator)
            self._stop()
            raise GrammarTooLarge("the grammar compiler stopped while compiling this grammar") from None

    def _started(self) -> Connection:
        if self._connection is not None and self._process is not None and self._process.is_alive():
            return self._connection
        self._stop()
        context = multiprocessing.get_context("spawn")
        ours, theirs = context.Pipe(duplex=True)
        process = context.Process(
            target=_serve,
            args=(theirs, self._tokenizer_info_json, MAX_COMPILED_BYTES),
            name="morion-grammar",
            daemon=True,
        )
        process.start()
        theirs.close()
        self._process, self._connection = process, ours
        try:
            if not ours.poll(_START_TIMEOUT_S):
                raise EOFError
            ours.recv()  # "ready"
        except EOFError:
            self._stop()
            raise RuntimeError(
                f"the grammar compiler process did not start within {_START_TIMEOUT_S:g} s"
            ) from None
        self._baseline_bytes = self._resident_bytes()
        return ours

    def _resident_bytes(self) -> int:
        process = self._process
        if process is None or process.pid is None:
            return 0
        try:
            pages = int(Path(f"/proc/{process.pid}/statm").read_text().split()[1])
        except (OSError, ValueError, IndexError):
            return 0  # no /proc (not Linux), or the child is gone: the time bound still holds
        return pages * _PAGE_BYTES

    def _stop(self) -> None:
        process, connection = self._process, self._connection
        self._process = self._connection = None
        if process is not None:
            self.restarts += 1
            process.kill()
            process.join(5)
        if connection is not None:
            connection.close()

    def kill(self) -> None:
        """Ends the child at once without waiting (for a forced exit; callable from a signal handler)."""
        if self._process is not None:
            self._process.kill()  # SIGKILL; returns at once

    def close(self) -> None:
        with self._lock:
            self._stop()


def _serve(connection: Connection, tokenizer_info_json: str, max_compiled_bytes: int) -> None:
    """The child: compile what arrives, one at a time, until the front end closes the pipe."""
    # Ctrl-C reaches the whole process group; the front end decides when this process ends.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import xgrammar

    compiler = xgrammar.GrammarCompiler(
        xgrammar.TokenizerInfo.deserialize_json(tokenizer_info_json), max_threads=1, cache_enabled=False
    )
    connection.send("ready")
    while True:
        try:
            kind, source = connection.recv()
        except EOFError:
            return
        try:
            serialized = compile_spec(compiler, GrammarSpec(kind, source)).serialize_json()
        except GrammarError as error:
            connection.send(("error", str(error)))
            continue
        except Exception:  # xgrammar failing otherwise on this input: the traceback goes to the log
            traceback.print_exc()
            connection.send(("error", "the grammar could not be compiled"))
            continue
        if len(serialized) > max_compiled_bytes:
            connection.send(("too_large", len(serialized)))
        else:
            connection.send(("ok", serialized))
