"""The disk tier's writer process: `python -m morion.cache.disk_writer_process REQUESTS REPLIES NAMESPACE
DIRECT THREADS`, started by `disk_writer.DiskWriter` with the two pipe ends it names.

It reads write requests from REQUESTS (a header, the object's path and key, its payload), writes each
object file with `disk_format.write_object` on a few threads of its own, and answers each request on
REPLIES with the file's size or the error. Its threads take this process's GIL, never the engine's: in
the engine process, each object written by worker threads there took its GIL between every system call,
and the engine thread, which gives the GIL up at each kernel launch, waited for those turns while it
launched a prefill (disk_writer.py). It ignores SIGINT and SIGTERM (as the engine process does: the front
end decides when serving stops) and exits once REQUESTS reaches its end and every write is done, so a
killed engine's queued objects still reach the disk.
"""

from __future__ import annotations

import os
import signal
import struct
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from morion.cache.disk_format import write_all, write_object

# A request: sequence number, kind, payload bytes, path bytes, key bytes; then path, key and payload.
REQUEST = struct.Struct("<QIQHH")
# A reply: sequence number, file size, errno (0: none; with a message and errno 0, another error), message
# bytes; then the message.
REPLY = struct.Struct("<QQiI")
# Requests read but not yet written, at most: the pipe then fills and the engine's sender waits (asleep,
# in its write), so a slow disk holds payloads in the engine's host tier, not in this process.
MAX_QUEUED = 8


def read_exact(fd: int, count: int) -> bytes | None:
    """`count` bytes from `fd`, or None at its end (before the first byte)."""
    parts, left = [], count
    while left:
        chunk = os.read(fd, left)
        if not chunk:
            if left == count:
                return None
            raise EOFError(f"the stream ended {left} bytes short of a {count}-byte record")
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def read_into(fd: int, buffer: np.ndarray) -> None:
    view, done = memoryview(buffer).cast("B"), 0
    while done < len(view):
        count = os.readv(fd, [view[done:]])
        if count == 0:
            raise EOFError("the stream ended inside a payload")
        done += count


def reply(fd: int, lock: threading.Lock, sequence: int, size: int, error: BaseException | None) -> None:
    number, message = 0, b""
    if error is not None:
        number = getattr(error, "errno", None) or 0
        message = (error.strerror or str(error)) if isinstance(error, OSError) else repr(error)
        message = message.encode()
    with lock:
        write_all(fd, [memoryview(REPLY.pack(sequence, size, number, len(message)) + message)])


def serve(requests: int, replies: int, namespace: str, direct: bool, threads: int) -> None:
    lock = threading.Lock()
    room = threading.BoundedSemaphore(MAX_QUEUED)

    def write(sequence: int, path: str, kind: int, key: bytes, payload: np.ndarray) -> None:
        try:
            size = write_object(Path(path), kind, key, namespace, payload, direct)
        except Exception as error:
            reply(replies, lock, sequence, 0, error)
        else:
            reply(replies, lock, sequence, size, None)
        finally:
            room.release()

    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="morion-disk-writer") as pool:
        while (header := read_exact(requests, REQUEST.size)) is not None:
            sequence, kind, nbytes, path_bytes, key_bytes = REQUEST.unpack(header)
            path = read_exact(requests, path_bytes).decode()
            key = read_exact(requests, key_bytes)
            payload = np.empty(nbytes, dtype=np.uint8)
            read_into(requests, payload)
            room.acquire()
            pool.submit(write, sequence, path, kind, key, payload)


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    requests, replies, namespace, direct, threads = argv
    serve(int(requests), int(replies), namespace, direct == "1", int(threads))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
