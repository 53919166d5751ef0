"""The disk tier's object writes, done by a process of their own (`disk_writer_process.py`).

Why a process: Python threads share one GIL. Written by worker threads of the engine process, each object
(a page of K/V, ~200 KB on the 80B preset, or a 75 MB state snapshot) took that GIL back after each of
its system calls (mkdir, open, hash, write, close, rename), and the engine thread, which releases the GIL
at every kernel launch, then waited for each such turn to end. A prompt's write-through queues one
object per page, so a prefill's launches met thousands of them: on the H200 (80B, host and disk tiers)
the 8K prefill's engine thread was 28 to 238 ms off the CPU, 8K prefill 14.7K to 30.9K tok/s against 31.5K
without the tiers (`results/2026-12-04-h200-session-notes-06c310f.md`).

Here one sender thread hands each object to the writer process in one `writev` (header, path, key and
payload; the GIL is released for the whole copy into the pipe), and one reader thread takes the replies,
many in one `read`: by construction two or three GIL turns an object in this process (after the backup's
event, after the `writev`, a share of a `read`), each short, where a worker took one after each of about
eight system calls. On the H200 (same machine, 80B, host and disk tiers) the 8K prefill's engine thread
went from 37-48 ms off the CPU with worker threads to 0-3 ms
(`results/2026-12-04-h200-session-notes-f001919.md`). The sender first waits for the object's backup
copy (`before`, asleep on a blocking event; it holds the copy's event, never its device staging), as the
worker threads did. Each write is a `concurrent.futures.Future`, finished with the file's size or the
error the writer met (an `OSError` with its errno, so a full disk is still recognised).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from queue import SimpleQueue

import numpy as np

from morion.cache.disk_format import write_all
from morion.cache.disk_writer_process import REPLY, REQUEST

PIPE_BYTES = 1 << 20
_Job = tuple[Future, str, int, bytes, np.ndarray, Callable[[], None]]


class DiskWriter:
    """A writer process for the objects of one namespace directory (`namespace`, O_DIRECT or not)."""

    def __init__(self, namespace: str, direct: bool, threads: int) -> None:
        to_writer, self._requests = os.pipe()
        with contextlib.suppress(OSError):  # fewer, larger copies a payload (Linux lets a user ask 1 MiB)
            fcntl.fcntl(self._requests, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        self._replies, from_writer = os.pipe()
        self._process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "morion.cache.disk_writer_process",
                str(to_writer),
                str(from_writer),
                namespace,
                "1" if direct else "0",
                str(threads),
            ],
            pass_fds=(to_writer, from_writer),
            stdin=subprocess.DEVNULL,
        )
        os.close(to_writer)
        os.close(from_writer)
        self._jobs: SimpleQueue[_Job | None] = SimpleQueue()
        self._pending: dict[int, Future] = {}
        self._pending_lock = threading.Lock()
        self._next_sequence = 0
        self._gone: str | None = None  # why the writer process can take no more writes
        self._sender = threading.Thread(target=self._send, name="morion-disk-sender", daemon=True)
        self._reader = threading.Thread(target=self._read, name="morion-disk-replies", daemon=True)
        self._sender.start()
        self._reader.start()

    def submit(
        self, path: str, kind: int, key: bytes, payload: np.ndarray, before: Callable[[], None]
    ) -> Future:
        """Queue a write of `payload` (uint8, contiguous; read once `before()` has returned) to `path`."""
        future: Future = Future()
        self._jobs.put((future, path, kind, key, payload, before))
        return future

    def _send(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, path, kind, key, payload, before = job
            if self._gone is not None:
                future.set_exception(OSError(0, self._gone))
                continue
            try:
                before()
            except Exception as error:
                future.set_exception(error)
                continue
            with self._pending_lock:
                sequence = self._next_sequence
                self._next_sequence += 1
                self._pending[sequence] = future
            path_bytes = path.encode()
            request = REQUEST.pack(sequence, kind, payload.nbytes, len(path_bytes), len(key))
            header = request + path_bytes + key
            try:
                write_all(self._requests, [memoryview(header), memoryview(payload).cast("B")])
            except OSError as error:
                self._fail_all(f"the disk writer process takes no writes: {error}")

    def _read(self) -> None:
        buffer = b""
        while chunk := os.read(self._replies, 1 << 16):
            buffer += chunk
            while len(buffer) >= REPLY.size:
                sequence, size, number, message_bytes = REPLY.unpack_from(buffer)
                end = REPLY.size + message_bytes
                if len(buffer) < end:
                    break
                message = buffer[REPLY.size : end].decode()
                buffer = buffer[end:]
                with self._pending_lock:
                    future = self._pending.pop(sequence)
                if not message:
                    future.set_result(size)
                elif number:
                    future.set_exception(OSError(number, message))
                else:
                    future.set_exception(RuntimeError(message))
        self._fail_all(f"the disk writer process exited (status {self._process.poll()})")

    def _fail_all(self, reason: str) -> None:
        self._gone = self._gone or reason
        with self._pending_lock:
            pending, self._pending = self._pending, {}
        for future in pending.values():
            future.set_exception(OSError(0, reason))

    def close(self) -> None:
        """Send what is queued, let the process finish its writes and exit; every future is then done."""
        self._jobs.put(None)
        self._sender.join()
        os.close(self._requests)  # the process's end of input: it writes what it has, then exits
        self._reader.join()
        os.close(self._replies)
        self._process.wait()
