"""Operator commands on a disk cache root: list namespaces, verify objects, purge (`morion cache ...`).

These work on the files alone (no model is loaded). Run `verify --remove-bad` and `purge` while no
engine uses the namespace: a running engine keeps its own index of what is on disk.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from pathlib import Path
from typing import NamedTuple

from morion.cache.disk_format import OBJECT_NAME, read_manifest, temp_file_writer_pid, verify_object_file
from morion.errors import MorionError

_NAMESPACE_NAME = re.compile(r"^[0-9a-f]{32}$")


class NamespaceInfo(NamedTuple):
    namespace: str
    path: Path
    manifest: dict | None  # None: missing or unreadable (an engine will not use this namespace)
    pages: int
    snapshots: int
    bytes: int
    temp_files: int
    last_used: float | None  # newest object modification time (reads refresh it), seconds since the epoch


class VerifyReport(NamedTuple):
    namespace: str
    checked: int
    bad: list[tuple[Path, str]]  # (file, why)
    removed: int  # bad files deleted (with remove_bad)


def _namespace_dirs(root: Path, namespace: str | None) -> list[Path]:
    root = Path(root).expanduser()
    if not root.is_dir():
        raise MorionError(f"disk cache directory {root} does not exist")
    found = sorted(p for p in root.iterdir() if p.is_dir() and _NAMESPACE_NAME.match(p.name))
    if namespace is None:
        return found
    chosen = [p for p in found if p.name.startswith(namespace)]
    if len(chosen) != 1:
        what = "no" if not chosen else "more than one"
        raise MorionError(f"{what} namespace under {root} starts with {namespace!r}")
    return chosen


def _object_files(namespace_dir: Path) -> list[os.DirEntry]:
    objects = namespace_dir / "objects"
    if not objects.is_dir():
        return []
    return [entry for sub in sorted(objects.iterdir()) if sub.is_dir() for entry in os.scandir(sub)]


def list_namespaces(root: str | Path) -> list[NamespaceInfo]:
    """`morion cache ls`: every namespace under `root` with what it holds."""
    infos = []
    for path in _namespace_dirs(Path(root), None):
        pages = snapshots = size = temp = 0
        newest = None
        for entry in _object_files(path):
            if temp_file_writer_pid(entry.name) is not None:
                temp += 1
                continue
            match = OBJECT_NAME.match(entry.name)
            if match is None:
                continue
            try:
                stat = entry.stat(follow_symlinks=False)
            except OSError:
                continue  # removed meanwhile
            size += stat.st_size
            newest = stat.st_mtime if newest is None else max(newest, stat.st_mtime)
            if match.group(2) == "page":
                pages += 1
            else:
                snapshots += 1
        infos.append(
            NamespaceInfo(path.name, path, read_manifest(path), pages, snapshots, size, temp, newest)
        )
    return infos


def _payload_bytes(manifest: dict) -> dict[str, int]:
    """Payload bytes of a page ("page") and a snapshot ("snap") object in the namespace."""
    sizes = {kind: int(size) for kind, size in manifest["payload_bytes"].items()}
    if any(size <= 0 for size in sizes.values()):
        raise ValueError("payload sizes must be positive")
    return sizes


def verify(root: str | Path, namespace: str | None = None, remove_bad: bool = False) -> list[VerifyReport]:
    """`morion cache verify`: read every object of each namespace (or the one whose name starts with
    `namespace`) and check header and checksum; with `remove_bad`, delete the objects that fail. A
    namespace without a readable manifest reports every object as bad (its layout is unknown)."""
    reports = []
    for path in _namespace_dirs(Path(root), namespace):
        manifest = read_manifest(path)
        try:
            sizes = _payload_bytes(manifest) if manifest is not None else None
        except (KeyError, TypeError, ValueError, AttributeError):
            sizes = None
        checked, bad, removed = 0, [], 0
        for entry in _object_files(path):
            match = OBJECT_NAME.match(entry.name)
            if match is None:
                continue
            checked += 1
            file = Path(entry.path)
            if sizes is None:
                why = "the namespace has no valid manifest"
            elif match.group(2) not in sizes:
                why = "a snapshot in a namespace without state"
            else:
                why = verify_object_file(file, path.name, sizes[match.group(2)])
            if why is None:
                continue
            bad.append((file, why))
            if remove_bad:
                with contextlib.suppress(OSError):
                    file.unlink()
                    removed += 1
        reports.append(VerifyReport(path.name, checked, bad, removed))
    return reports


def purge(root: str | Path, namespace: str | None = None) -> list[Path]:
    """`morion cache purge`: delete every namespace directory under `root` (or the one whose name starts
    with `namespace`). Only namespace directories are touched. Returns the deleted directories."""
    paths = _namespace_dirs(Path(root), namespace)
    links = [path for path in paths if path.is_symlink()]
    if links:
        raise MorionError(
            f"{links[0]} is a symbolic link; nothing was purged (remove the link, or purge the cache "
            "directory it points to)"
        )
    removed = []
    for path in paths:
        try:
            shutil.rmtree(path)
        except OSError as error:
            raise MorionError(f"cannot purge {path}: {error.strerror or error}") from None
        removed.append(path)
    return removed


def describe(info: NamespaceInfo) -> str:
    """One line per namespace, for `morion cache ls`."""
    manifest = info.manifest or {}
    model = manifest.get("model_name", "?")
    dtype = _field(manifest, "identity", "model", "dtype")
    page_size = _field(manifest, "identity", "page_size")
    state = "no manifest (unused) " if info.manifest is None else ""
    temp = f", {info.temp_files} temp files" if info.temp_files else ""
    return (
        f"{info.namespace}  {state}{model} ({manifest.get('model_type', '?')}, {dtype}, page {page_size})  "
        f"{info.pages} pages + {info.snapshots} snapshots, {info.bytes / 2**20:.1f} MiB{temp}"
    )


def _field(manifest: dict, *path: str) -> object:
    """A nested manifest field, or "?" where the manifest (written by anyone) lacks it or is shaped
    otherwise."""
    value: object = manifest
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return "?"
        value = value[key]
    return value
