"""Stray files in a disk cache never stop a start nor hang a read (issue 21, items 4 and 5), with real
files and FIFOs: a manifest that is valid JSON but not an object, an identity that is not a mapping, a
temp file named with an impossible pid, a FIFO where an object or the manifest belongs, and the operator
commands on all of them (`morion cache ls | verify | purge`: the functions they print, in-process)."""

from __future__ import annotations

import contextlib
import json
import os
import threading

import numpy as np
import pytest

from morion.cache import disk_admin
from morion.cache.disk_format import KIND_PAGE, object_path
from morion.errors import MorionError
from tests.cache.test_disk_tier import _key, _payload, _read, _store, _write

HANG_S = 10  # a read or a command still running after this long is hung


def _run_bounded(function, *args):
    """Runs `function(*args)` in a thread; fails (without hanging the test) when it does not return."""
    result: list = []
    thread = threading.Thread(target=lambda: result.append(function(*args)), daemon=True)
    thread.start()
    thread.join(HANG_S)
    assert not thread.is_alive(), f"{function.__name__} hung"
    return result[0]


@pytest.fixture
def release_fifos():
    """FIFOs a test makes; afterwards each is opened for writing once, which releases a reader that
    blocked on it (before the fix), so that no thread hangs the test session."""
    fifos: list = []
    yield fifos
    for fifo in fifos:
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


def _ls(root) -> list[str]:
    """What `morion cache ls` prints."""
    return [disk_admin.describe(info) for info in disk_admin.list_namespaces(root)]


WRONG_SHAPES = ["[1, 2, 3]", "42", '"text"', '{"identity": [1, 2]}', '{"identity": {"model": 5}}']


@pytest.mark.parametrize("manifest", WRONG_SHAPES)
def test_a_manifest_of_the_wrong_shape_skips_the_tier_and_the_commands_still_work(tmp_path, caplog, manifest):
    _write(_store(tmp_path), 2)
    namespace_dir = _store(tmp_path).dir
    (namespace_dir / "manifest.json").write_text(manifest)
    store = _store(tmp_path)
    assert not store.enabled and store.skip_reason
    assert "NOT used" in caplog.text
    [line] = _ls(tmp_path)
    assert line.startswith(namespace_dir.name)
    [report] = disk_admin.verify(tmp_path)
    assert report.checked == 2 and len(report.bad) == 2  # layout unknown: never trusted


def test_a_temp_file_with_an_impossible_pid_is_removed(tmp_path):
    _write(_store(tmp_path), 1)
    final = object_path(_store(tmp_path).dir, KIND_PAGE, _key(0))
    stray = final.parent / f".{final.name}.99999999999999999999.0.tmp"  # used to raise OverflowError
    stray.write_bytes(b"partial")
    store = _store(tmp_path)
    assert store.enabled and store.num_objects == 1 and not stray.exists()
    store.close()


def test_a_fifo_where_an_object_belongs_is_a_miss_not_a_hang(tmp_path, release_fifos):
    _write(_store(tmp_path), 3)
    running = _store(tmp_path)  # indexed all three; then one turns into a FIFO under it
    fifo = object_path(running.dir, KIND_PAGE, _key(1))
    fifo.unlink()
    os.mkfifo(fifo)
    release_fifos.append(fifo)
    _, [result] = _run_bounded(_read, running, 1)
    assert result.error is not None and not running.has(KIND_PAGE, _key(1))
    good, [ok] = _run_bounded(_read, running, 2)  # the workers are free
    assert ok.error is None and np.array_equal(good, _payload(2))
    running.close()
    assert not fifo.exists()  # an unreadable object is removed, as a corrupt one is
    os.mkfifo(fifo)
    restarted = _store(tmp_path)  # found at start: never indexed
    assert restarted.enabled and restarted.num_objects == 2 and not restarted.has(KIND_PAGE, _key(1))
    restarted.close()
    [report] = _run_bounded(disk_admin.verify, tmp_path)
    assert [(path, "not a regular file" in why) for path, why in report.bad] == [(fifo, True)]
    assert len(_run_bounded(_ls, tmp_path)) == 1


def test_a_fifo_where_the_manifest_belongs_skips_the_tier(tmp_path, release_fifos):
    _write(_store(tmp_path), 1)
    manifest = _store(tmp_path).dir / "manifest.json"
    manifest.unlink()
    os.mkfifo(manifest)
    release_fifos.append(manifest)
    store = _run_bounded(_store, tmp_path)
    assert not store.enabled
    assert "no manifest" in _run_bounded(_ls, tmp_path)[0]


def test_purging_a_symlinked_namespace_is_refused_with_a_clear_error(tmp_path):
    _write(_store(tmp_path / "elsewhere"), 1)
    real = _store(tmp_path / "elsewhere").dir
    root = tmp_path / "cache"
    root.mkdir()
    (root / real.name).symlink_to(real, target_is_directory=True)
    with pytest.raises(MorionError, match="symbolic link; nothing was purged"):  # one CLI line
        disk_admin.purge(root)
    assert real.exists() and (real / "manifest.json").exists()


def test_an_unreadable_objects_directory_skips_the_tier(tmp_path):
    _write(_store(tmp_path), 1)
    objects = _store(tmp_path).dir / "objects"
    for subdir in objects.iterdir():
        for entry in subdir.iterdir():
            entry.unlink()
        subdir.rmdir()
    objects.rmdir()
    objects.write_text("not a directory")
    store = _store(tmp_path)
    assert not store.enabled and "objects" in store.skip_reason
    assert json.loads((store.dir / "manifest.json").read_text())["namespace"] == store.namespace
