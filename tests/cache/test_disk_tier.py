"""The disk tier without a model: object files, the namespace manifest, budget cleanup, write errors, and
the operator commands (`morion cache ls | verify | purge`)."""

from __future__ import annotations

import errno
import os
import shutil
import threading
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest

from morion.cache import disk_admin, disk_format, disk_store
from morion.cache.disk_format import BLOCK, KIND_PAGE, KIND_SNAPSHOT, CorruptObject, object_path
from morion.cache.disk_store import LOW_WATERMARK, DiskStore
from morion.errors import MorionError

PAYLOAD = 1000  # not a multiple of the block: the padding is exercised
IDENTITY = {"format_version": 1, "model": {"weights_digest": "abc", "dtype": "float32"}, "page_size": 8}
INFO = {"model_name": "tiny", "model_type": "llama"}


def _store(root, budget: int | None = 1 << 30, identity=IDENTITY) -> DiskStore:
    return DiskStore(
        root, identity, INFO, budget, {KIND_PAGE: PAYLOAD, KIND_SNAPSHOT: 2 * PAYLOAD}, num_threads=2
    )


def _key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def _payload(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, PAYLOAD, dtype=np.uint8)


def _write(store: DiskStore, count: int, start: int = 0) -> list:
    for i in range(start, start + count):
        assert store.submit_write(KIND_PAGE, _key(i), _payload(i), lambda: None)
    return store.close()


def _read(store: DiskStore, i: int) -> tuple[np.ndarray, list]:
    out = np.zeros(PAYLOAD, dtype=np.uint8)
    assert store.submit_read(KIND_PAGE, _key(i), out)
    results = []
    while not results:
        results = store.poll(timeout=1.0)
    return out, results


@pytest.mark.parametrize("direct", [False, True])
def test_object_files_round_trip_and_detect_damage(tmp_path, direct) -> None:
    if direct and not disk_format.probe_direct_io(tmp_path):
        pytest.skip("this filesystem does not take O_DIRECT")
    namespace = "ab" * 16
    path = object_path(tmp_path, KIND_PAGE, _key(1))
    assert disk_format.write_object(path, KIND_PAGE, _key(1), namespace, _payload(1), direct) == 2 * BLOCK
    out = np.zeros(PAYLOAD, dtype=np.uint8)
    disk_format.read_object(path, KIND_PAGE, _key(1), namespace, out)
    assert np.array_equal(out, _payload(1))
    for wrong in [
        (KIND_SNAPSHOT, _key(1), namespace),
        (KIND_PAGE, _key(2), namespace),
        (KIND_PAGE, _key(1), "cd" * 16),
    ]:
        with pytest.raises(CorruptObject):
            disk_format.read_object(path, *wrong, out)
    data = bytearray(path.read_bytes())
    data[BLOCK + PAYLOAD - 1] ^= 0x80
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptObject, match="checksum"):
        disk_format.read_object(path, KIND_PAGE, _key(1), namespace, out)
    path.write_bytes(bytes(data[: BLOCK + 10]))
    with pytest.raises(CorruptObject):
        disk_format.read_object(path, KIND_PAGE, _key(1), namespace, out)
    assert not list(path.parent.glob(".*.tmp"))


def test_a_buffered_object_file_is_the_staged_one_byte_for_byte(tmp_path, monkeypatch) -> None:
    """Buffered writes go straight from the payload (no staging buffer), resuming writes that stop short,
    even inside a part; the file is the O_DIRECT path's staged bytes: header block, payload, zero padding."""
    namespace, payload = "ab" * 16, _payload(3)
    real_writev = os.writev
    calls = []

    def short_writev(fd, parts):
        calls.append(len(parts))
        return real_writev(fd, [bytes(parts[0][:777])])

    monkeypatch.setattr(disk_format.os, "writev", short_writev)
    path = object_path(tmp_path, KIND_PAGE, _key(3))
    size = disk_format.write_object(path, KIND_PAGE, _key(3), namespace, payload, direct=False)
    assert size == 2 * BLOCK and len(calls) > 3 and max(calls) == 3  # one vector: header, payload, padding
    staged = tmp_path / "staged"
    fd = os.open(staged, os.O_WRONLY | os.O_CREAT)
    header = disk_format._header(KIND_PAGE, _key(3), namespace, payload)
    disk_format._write_staged(fd, header, payload, size)
    os.close(fd)
    assert path.read_bytes() == staged.read_bytes()
    out = np.zeros(PAYLOAD, dtype=np.uint8)
    disk_format.read_object(path, KIND_PAGE, _key(3), namespace, out)
    assert np.array_equal(out, payload)


def test_store_writes_reads_and_survives_a_restart(tmp_path) -> None:
    store = _store(tmp_path)
    assert store.enabled and (store.dir / "manifest.json").exists()
    results = _write(store, 3)
    assert sorted(r.key for r in results) == sorted(_key(i) for i in range(3)) and not any(
        r.error for r in results
    )
    again = _store(tmp_path)
    assert again.num_objects == 3 and again.has(KIND_PAGE, _key(2)) and not again.has(KIND_SNAPSHOT, _key(2))
    out, results = _read(again, 2)
    assert results[0].error is None and np.array_equal(out, _payload(2))
    again.close()


def test_a_corrupt_object_is_removed_on_read(tmp_path) -> None:
    _write(_store(tmp_path), 1)
    store = _store(tmp_path)
    path = object_path(store.dir, KIND_PAGE, _key(0))
    data = bytearray(path.read_bytes())
    data[BLOCK] ^= 1
    path.write_bytes(bytes(data))
    _, results = _read(store, 0)
    assert results[0].corrupt and "checksum" in results[0].error
    assert not store.has(KIND_PAGE, _key(0))
    store.close()  # a worker unlinks the file
    assert not path.exists()


def test_budget_cleanup_evicts_least_recently_used(tmp_path) -> None:
    object_bytes = 2 * BLOCK
    store = _store(tmp_path, budget=5 * object_bytes)
    _write(store, 5)
    for i in range(5):  # written in this order: the next start orders by modification time
        os.utime(object_path(store.dir, KIND_PAGE, _key(i)), (1e9 + i, 1e9 + i))
    store = _store(tmp_path, budget=5 * object_bytes)
    _read(store, 0)  # now the most recently used
    _write(store, 1, start=5)  # over budget: cleanup to 90% first
    assert store.used_bytes <= store.budget_bytes and store.num_evicted >= 1
    assert (
        store.has(KIND_PAGE, _key(0)) and store.has(KIND_PAGE, _key(5)) and not store.has(KIND_PAGE, _key(1))
    )


def test_cleanup_unlinks_its_victims_in_a_worker_and_spares_one_written_again(tmp_path, monkeypatch) -> None:
    """A cleanup frees a tenth of the budget at once, thousands of files on a large cache: unlinked on the
    engine thread, they stalled every running request for 2.9 s on the H200 machine's virtual disk. The
    index drops them at once and a worker unlinks them; an object written again before its file went keeps
    the new file."""
    object_bytes = 2 * BLOCK
    store = _store(tmp_path, budget=5 * object_bytes)
    for i in range(5):
        assert store.submit_write(KIND_PAGE, _key(i), _payload(i), lambda: None)
    while store.busy():
        store.poll(timeout=1.0)
    release = threading.Event()
    unlinking_threads: set[str] = set()
    relative_path = disk_store.object_relative_path

    def held_back(kind: int, key: bytes) -> str:  # the worker's unlink job waits before its first file
        unlinking_threads.add(threading.current_thread().name)
        release.wait(10)
        return relative_path(kind, key)

    monkeypatch.setattr(disk_store, "object_relative_path", held_back)
    assert store.submit_write(KIND_PAGE, _key(5), _payload(5), lambda: None)  # over budget: cleanup first
    evicted = [i for i in range(5) if not store.has(KIND_PAGE, _key(i))]
    assert evicted == [0, 1] and store.num_evicted == 2  # down to 90% of the budget, oldest first
    assert all(object_path(store.dir, KIND_PAGE, _key(i)).exists() for i in evicted)  # left to the worker
    assert store.submit_write(KIND_PAGE, _key(0), _payload(0), lambda: None)  # written again meanwhile
    while store.busy():
        store.poll(timeout=1.0)
    release.set()
    store.close()
    assert unlinking_threads and threading.current_thread().name not in unlinking_threads
    assert object_path(store.dir, KIND_PAGE, _key(0)).exists()
    assert not object_path(store.dir, KIND_PAGE, _key(1)).exists()
    restarted = _store(tmp_path, budget=5 * object_bytes)
    out, results = _read(restarted, 0)
    assert results[0].error is None and np.array_equal(out, _payload(0))
    restarted.close()


def test_a_poll_looks_only_at_finished_jobs(tmp_path, monkeypatch) -> None:
    """The engine polls once a step, and a long prompt's write-through queues thousands of pages: looking at
    every pending job cost 0.4 us each a step (2 ms a step for a 64K-token prompt's 4,096 pages)."""
    store = _store(tmp_path)
    gate = threading.Event()
    for i in range(50):
        assert store.submit_write(KIND_PAGE, _key(i), _payload(i), gate.wait)
    looked_at = []
    done = Future.done
    monkeypatch.setattr(Future, "done", lambda future: looked_at.append(future) or done(future))
    assert [store.poll() for _ in range(10)] == [[]] * 10 and not looked_at
    gate.set()
    results = []
    while len(results) < 50:
        results += store.poll(timeout=1.0)
    assert sorted(r.key for r in results) == sorted(_key(i) for i in range(50))
    assert not any(r.error for r in results) and not store.busy()
    store.close()


def _small_filesystem(monkeypatch, root: Path, capacity: int) -> None:
    """As if `root` were alone on a filesystem of `capacity` bytes: its free space is what root's files
    leave (a real filesystem this small cannot be made here without privileges)."""
    real = shutil.disk_usage

    def usage(path):
        used = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
        return real(path)._replace(total=capacity, used=used, free=capacity - used)

    monkeypatch.setattr(shutil, "disk_usage", usage)


def test_the_automatic_budget_counts_its_own_objects_and_a_restart_keeps_them(tmp_path, monkeypatch) -> None:
    object_bytes = 2 * BLOCK
    _small_filesystem(monkeypatch, tmp_path, capacity=40 * object_bytes)
    first = _store(tmp_path, budget=None)
    assert 19 * object_bytes < first.budget_bytes <= 20 * object_bytes  # half of the free space
    _write(first, 15)  # under the budget's low watermark: nothing evicted
    assert first.num_objects == 15 and first.num_evicted == 0
    again = _store(tmp_path, budget=None)
    # Half of (free space + its own objects): the same budget as the run that wrote them, so the restart
    # trims nothing. (Half of the free space alone would be 12.5 objects and evict four of them.)
    assert again.budget_bytes == first.budget_bytes
    assert again.num_objects == 15 and again.num_evicted == 0
    assert all(again.has(KIND_PAGE, _key(i)) for i in range(15))
    again.close()


def test_a_trim_takes_chains_from_their_end(tmp_path) -> None:
    """Two conversations, each backed up in two runs as the tiers do it: the run's pages and the snapshot
    at its end are written, then the chain so far is touched. A restart under a smaller budget evicts the
    older conversation's second run (its snapshot first), so what stays of it is still a hit."""
    object_bytes = 2 * BLOCK  # pages and snapshots alike, at these payload sizes
    chains = [[_key(100 * c + i) for i in range(8)] for c in (1, 2)]
    store = _store(tmp_path)
    for keys in chains:
        for run in (keys[:4], keys[4:]):
            for key in run:
                assert store.submit_write(KIND_PAGE, key, _payload(1), lambda: None)
            assert store.submit_write(KIND_SNAPSHOT, run[-1], np.zeros(2 * PAYLOAD, np.uint8), lambda: None)
            store.touch_chain(keys[: keys.index(run[-1]) + 1])
        store.poll(timeout=5.0)
    store.close()  # saves the order into the files' modification times

    budget = 17 * object_bytes  # 20 objects; the trim frees down to 15.3 of them
    assert int(budget * LOW_WATERMARK) // object_bytes == 15
    trimmed = _store(tmp_path, budget=budget)
    assert trimmed.num_evicted == 5 and trimmed.num_objects == 15
    older, newer = chains
    assert not any(trimmed.has(KIND_PAGE, key) for key in older[4:])
    assert not trimmed.has(KIND_SNAPSHOT, older[7])
    assert all(trimmed.has(KIND_PAGE, key) for key in older[:4]) and trimmed.has(KIND_SNAPSHOT, older[3])
    assert all(trimmed.has(KIND_PAGE, key) for key in newer)
    assert trimmed.has(KIND_SNAPSHOT, newer[3]) and trimmed.has(KIND_SNAPSHOT, newer[7])
    trimmed.close()


class _FullDisk:
    """A writer process's stand-in whose every write meets a full disk."""

    def __init__(self, *args) -> None:
        pass

    def submit(self, *args) -> Future:
        future: Future = Future()
        future.set_exception(OSError(errno.ENOSPC, "No space left on device"))
        return future

    def close(self) -> None:
        pass


def test_a_failed_write_is_counted_and_frees_room(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(disk_store, "DiskWriter", _FullDisk)
    store = _store(tmp_path)
    store.submit_write(KIND_PAGE, _key(1), _payload(1), lambda: None)
    [result] = store.close()
    assert result.error is not None and "No space" in result.error
    assert store.num_objects == 0 and store.used_bytes == 0


def test_a_foreign_or_missing_manifest_disables_the_tier(tmp_path, caplog) -> None:
    _write(_store(tmp_path), 1)
    store = _store(tmp_path)
    manifest = disk_format.read_manifest(store.dir)
    store.close()
    manifest["identity"] = {**IDENTITY, "page_size": 16}
    disk_format.write_manifest(store.dir, manifest)
    skipped = _store(tmp_path)
    assert not skipped.enabled and "page_size" in skipped.skip_reason
    assert "NOT used" in caplog.text
    assert not skipped.has(KIND_PAGE, _key(0)) and not skipped.submit_write(
        KIND_PAGE, _key(9), _payload(9), lambda: None
    )
    (store.dir / "manifest.json").unlink()
    assert not _store(tmp_path).enabled  # objects without a manifest: unknown provenance


def test_operator_commands(tmp_path) -> None:
    _write(_store(tmp_path), 3)
    other_identity = {**IDENTITY, "page_size": 16}
    other = _store(tmp_path, identity=other_identity)
    _write(other, 1)
    (tmp_path / "not-a-namespace").mkdir()
    infos = {info.namespace: info for info in disk_admin.list_namespaces(tmp_path)}
    assert len(infos) == 2
    mine = infos[_store(tmp_path).namespace]
    assert (mine.pages, mine.snapshots, mine.bytes) == (3, 0, 3 * 2 * BLOCK)
    assert mine.manifest["model_name"] == "tiny" and "tiny (llama, float32, page 8)" in disk_admin.describe(
        mine
    )

    bad = object_path(mine.path, KIND_PAGE, _key(1))
    data = bytearray(bad.read_bytes())
    data[BLOCK + 5] ^= 0xFF
    bad.write_bytes(bytes(data))
    [report] = disk_admin.verify(tmp_path, mine.namespace[:6])
    assert report.checked == 3 and [p for p, _ in report.bad] == [bad] and report.removed == 0
    [report] = disk_admin.verify(tmp_path, mine.namespace, remove_bad=True)
    assert report.removed == 1 and not bad.exists()
    assert all(not r.bad for r in disk_admin.verify(tmp_path))

    with pytest.raises(MorionError, match="no namespace"):
        disk_admin.purge(tmp_path, "ffff")
    assert disk_admin.purge(tmp_path, mine.namespace) == [mine.path]
    assert [i.namespace for i in disk_admin.list_namespaces(tmp_path)] == [other.namespace]
    assert len(disk_admin.purge(tmp_path)) == 1 and (tmp_path / "not-a-namespace").exists()
    with pytest.raises(MorionError, match="does not exist"):
        disk_admin.list_namespaces(tmp_path / "nowhere")


def test_temp_files_of_dead_writers_are_removed_at_start(tmp_path) -> None:
    _write(_store(tmp_path), 1)
    store = _store(tmp_path)
    store.close()
    final = object_path(store.dir, KIND_PAGE, _key(0))
    dead_pid = 2**22 + 12345  # above the kernel's pid_max default: never a live process
    while disk_format.process_alive(dead_pid):
        dead_pid += 1
    mine = final.parent / f".{final.name}.{os.getpid()}.7.tmp"
    dead = final.parent / f".{final.name}.{dead_pid}.0.tmp"
    mine.write_bytes(b"x")
    dead.write_bytes(b"partial")
    restarted = _store(tmp_path)
    assert restarted.removed_temp_files == 1 and not dead.exists() and mine.exists()
    assert restarted.num_objects == 1
    restarted.close()
