"""The disk tier's writer process (`cache/disk_writer.py`, `cache/disk_writer_process.py`): objects written
by another process, each payload read only after its `before`, errors and the process's death reported
on the futures, signals to the writer ignored."""

from __future__ import annotations

import errno
import os
import signal

import numpy as np
import pytest

from morion.cache import disk_format
from morion.cache.disk_format import KIND_PAGE, KIND_SNAPSHOT, object_path, read_object
from morion.cache.disk_writer import DiskWriter

NAMESPACE = "ab" * 16
TIMEOUT_S = 30


def _key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def _payload(i: int, size: int = 5000) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8)


@pytest.fixture
def writer():
    made = []

    def make(direct: bool = False) -> DiskWriter:
        made.append(DiskWriter(NAMESPACE, direct, threads=2))
        return made[-1]

    yield make
    for each in made:
        each.close()


def _read(path, kind: int, key: bytes, size: int) -> np.ndarray:
    out = np.zeros(size, dtype=np.uint8)
    read_object(path, kind, key, NAMESPACE, out)
    return out


def test_objects_are_written_by_another_process_after_their_before(tmp_path, writer) -> None:
    """Each file holds the payload as `before` left it: the sender reads it only after."""
    disk = writer()
    futures, payloads = [], {}
    for i, kind in enumerate([KIND_PAGE, KIND_SNAPSHOT, KIND_PAGE]):
        payload = np.zeros(5000 + i, dtype=np.uint8)  # what the row holds before its backup copy lands
        payloads[i] = _payload(i, payload.size)
        path = object_path(tmp_path, kind, _key(i))
        future = disk.submit(str(path), kind, _key(i), payload, _filler(payload, payloads[i]))
        futures.append((path, kind, future))
    for i, (path, kind, future) in enumerate(futures):
        assert (
            future.result(TIMEOUT_S) == disk_format.object_file_size(payloads[i].size) == path.stat().st_size
        )
        assert np.array_equal(_read(path, kind, _key(i), payloads[i].size), payloads[i])
    assert disk._process.pid != os.getpid()


def _filler(row: np.ndarray, values: np.ndarray):
    def fill() -> None:  # the backup copy, done
        row[:] = values

    return fill


def test_an_error_is_the_futures_and_the_writer_goes_on(tmp_path, writer) -> None:
    disk = writer()
    (tmp_path / "objects").write_bytes(b"a file where the objects' directory belongs")
    bad = disk.submit(
        str(object_path(tmp_path, KIND_PAGE, _key(1))), KIND_PAGE, _key(1), _payload(1), lambda: None
    )
    error = bad.exception(TIMEOUT_S)
    assert isinstance(error, OSError) and error.errno in (errno.ENOTDIR, errno.EEXIST)
    assert _submit(disk, tmp_path / "elsewhere", 2).result(TIMEOUT_S) > 0
    failing = _submit(disk, tmp_path / "elsewhere", 3, _raise)
    assert isinstance(failing.exception(TIMEOUT_S), RuntimeError)  # its `before` failed: nothing sent


def _raise() -> None:
    raise RuntimeError("the backup copy failed")


def _submit(disk: DiskWriter, root, i: int, before=lambda: None):
    return disk.submit(str(object_path(root, KIND_PAGE, _key(i))), KIND_PAGE, _key(i), _payload(i), before)


def test_signals_leave_the_writer_serving_and_its_death_fails_the_futures(tmp_path, writer) -> None:
    disk = writer()
    assert _submit(disk, tmp_path, 0).result(TIMEOUT_S) > 0  # started: its handlers are in place
    os.kill(disk._process.pid, signal.SIGTERM)  # ignored: the front end decides when serving stops
    os.kill(disk._process.pid, signal.SIGINT)
    assert _submit(disk, tmp_path, 1).result(TIMEOUT_S) > 0
    disk._process.kill()
    disk._process.wait()
    for future in [_submit(disk, tmp_path, i) for i in (2, 3)]:
        error = future.exception(TIMEOUT_S)
        assert isinstance(error, OSError) and "disk writer process" in str(error)
