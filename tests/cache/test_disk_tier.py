"""The disk tier without a model: object files, the namespace manifest, budget cleanup, write errors, and
the operator commands (`morion cache ls | verify | purge`)."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from morion.cache import disk_admin, disk_format
from morion.cache.disk_format import BLOCK, KIND_PAGE, KIND_SNAPSHOT, CorruptObject, object_path
from morion.cache.disk_store import DiskStore
from morion.errors import MorionError

PAYLOAD = 1000  # not a multiple of the block: the padding is exercised
IDENTITY = {"format_version": 1, "model": {"weights_digest": "abc", "dtype": "float32"}, "page_size": 8}
INFO = {"model_name": "tiny", "model_type": "llama"}


def _store(root, budget=1 << 30, identity=IDENTITY) -> DiskStore:
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
    assert not store.has(KIND_PAGE, _key(0)) and not path.exists()
    store.close()


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


def test_a_failed_write_is_counted_and_frees_room(tmp_path, monkeypatch) -> None:
    store = _store(tmp_path)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("morion.cache.disk_store.write_object", full)
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
