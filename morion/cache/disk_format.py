"""The disk tier's on-disk format: namespaces, manifests, and checksummed object files.

Layout under the cache root (`--disk-cache-dir`):

    <root>/<namespace>/manifest.json                      what made these objects (must match to be used)
    <root>/<namespace>/objects/<kk>/<key hex>.page         one page object (a host row), kk = key[:2]
    <root>/<namespace>/objects/<kk>/<key hex>.snap         one state snapshot object
    <root>/<namespace>/objects/<kk>/.<name>.<pid>.<n>.tmp  a write in progress (never read)

The namespace is the first 32 hex digits of SHA-256 over the canonical JSON of the *identity*: format
version, model config digest, weights digest, model dtype, page size, the CacheSpec, and the exact byte
layout of page and snapshot objects. The manifest repeats the identity (plus informative fields); a
namespace whose manifest is missing, unreadable or different is not used (fail closed).

An object file is a 4 KiB header block, then the payload padded to a 4 KiB multiple (so O_DIRECT can
write and read it). The header holds a magic, the format version, the kind (page / snapshot), the
payload length, the namespace, the key, and the payload's SHA-256; a read checks every one of them. A
file is written under a temporary name and renamed into place, so a killed writer leaves only a
`.tmp` file, which is never read and is removed at the next start.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import itertools
import json
import mmap
import os
import re
import stat
import struct
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # imported where weights are read: `morion cache` and the validate suites need no torch
    import torch

FORMAT_VERSION = 1
BLOCK = 4096
MAGIC = b"MORIONC1"
KIND_PAGE, KIND_SNAPSHOT = 1, 2
SUFFIX = {KIND_PAGE: ".page", KIND_SNAPSHOT: ".snap"}
_HEADER = struct.Struct("<8sIIQ16s32s32s")  # magic, version, kind, payload length, namespace, key, sha256
OBJECT_NAME = re.compile(r"^([0-9a-f]{64})\.(page|snap)$")
_TMP_NAME = re.compile(r"^\..+\.(\d+)\.\d+\.tmp$")
_tmp_counter = itertools.count()
_MAX_MANIFEST_BYTES = 2**20
_MAX_PID = 2**31 - 1


class CorruptObject(Exception):
    """An object file failed a check: wrong magic/version/kind/namespace/key, short, or bad checksum."""


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def object_file_size(payload_bytes: int) -> int:
    return BLOCK + _round_up(payload_bytes, BLOCK)


def object_relative_path(kind: int, key: bytes) -> str:
    """`objects/<kk>/<key hex>.page|.snap` within the namespace directory: a string, cheap to make by the
    thousand (pathlib takes microseconds per join)."""
    name = key.hex()
    return f"objects/{name[:2]}/{name}{SUFFIX[kind]}"


def object_path(namespace_dir: Path, kind: int, key: bytes) -> Path:
    return namespace_dir / object_relative_path(kind, key)


# -- identity ------------------------------------------------------------------------------------------------


def weights_digest(model: torch.nn.Module, samples_per_tensor: int = 1024) -> str:
    """A cheap fingerprint of loaded weights: for every state-dict tensor (sorted by name) its name, shape
    and dtype, and the bytes of up to `samples_per_tensor` elements at evenly spaced flat positions
    (always the first and the last). Reading a sample instead of every byte keeps it fast on an 80B model
    (about a millisecond per tensor); any re-quantization, dtype change, different seed or checkpoint
    changes the sample with near certainty. Not a security boundary: it stops a cache from being reused
    by a different model by accident."""
    import torch

    digest = hashlib.sha256()
    with torch.no_grad():
        for name, tensor in sorted(model.state_dict().items()):
            digest.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}\n".encode())
            flat = tensor.detach().reshape(-1)
            if flat.numel() > samples_per_tensor:
                # Integer arithmetic: a float32 linspace rounds the last index past the end (28M elements).
                positions = torch.arange(samples_per_tensor, dtype=torch.int64, device=flat.device)
                index = positions * (flat.numel() - 1) // (samples_per_tensor - 1)
                flat = flat[index]
            digest.update(flat.contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return digest.hexdigest()


def config_digest(hf_config: dict) -> str:
    return hashlib.sha256(json.dumps(hf_config, sort_keys=True, default=str).encode()).hexdigest()


def namespace_of(identity: dict) -> str:
    canonical = json.dumps(identity, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:32]


def read_manifest(namespace_dir: Path) -> dict | None:
    """The manifest, or None when it is missing, not a regular file, over 1 MiB, or not a JSON object."""
    try:
        with os.fdopen(open_regular_file(namespace_dir / "manifest.json"), "rb") as file:
            text = file.read(_MAX_MANIFEST_BYTES + 1)
        manifest = json.loads(text) if len(text) <= _MAX_MANIFEST_BYTES else None
    except (OSError, ValueError, RecursionError):
        return None
    return manifest if isinstance(manifest, dict) else None


def open_regular_file(path: Path) -> int:
    """A read-only descriptor of `path`, or OSError when it is not a regular file. Opening never blocks:
    a FIFO (or a device) put where a cache file belongs would otherwise hang its reader for good."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    return fd


def write_manifest(namespace_dir: Path, manifest: dict) -> None:
    path = namespace_dir / "manifest.json"
    tmp = path.with_name(f".manifest.json.{os.getpid()}.{next(_tmp_counter)}.tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


# -- object files --------------------------------------------------------------------------------------------


def probe_direct_io(directory: Path) -> bool:
    """True when files in `directory` can be written with O_DIRECT (not on tmpfs, not on macOS)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    path = directory / f".probe.{os.getpid()}.{next(_tmp_counter)}.tmp"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | flag, 0o644)
    except OSError:
        return False
    try:
        with mmap.mmap(-1, BLOCK) as buffer:
            return os.write(fd, buffer) == BLOCK
    except OSError:
        return False
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            path.unlink()


def _header(kind: int, key: bytes, namespace: str, payload: np.ndarray) -> bytes:
    checksum = hashlib.sha256(memoryview(payload)).digest()
    return _HEADER.pack(
        MAGIC, FORMAT_VERSION, kind, payload.nbytes, bytes.fromhex(namespace)[:16], key, checksum
    )


def write_object(path: Path, kind: int, key: bytes, namespace: str, payload: np.ndarray, direct: bool) -> int:
    """Write `payload` (uint8, contiguous) as an object file, atomically: a temporary name, then a rename.
    Returns the file's size. Raises OSError (disk full, say) with no file left under `path`."""
    size = object_file_size(payload.nbytes)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{next(_tmp_counter)}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | (getattr(os, "O_DIRECT", 0) if direct else 0)
    header = _header(kind, key, namespace, payload)
    fd = os.open(tmp, flags, 0o644)
    try:
        if direct:
            _write_staged(fd, header, payload, size)
        else:
            pad = bytes(size - BLOCK - payload.nbytes)
            parts = [header.ljust(BLOCK, b"\0"), payload, pad]
            write_all(fd, [memoryview(part).cast("B") for part in parts])
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    os.close(fd)
    os.replace(tmp, path)
    return size


def _write_staged(fd: int, header: bytes, payload: np.ndarray, size: int) -> None:
    """The file's bytes through one page-aligned buffer, as O_DIRECT wants (an anonymous mapping: aligned,
    its unused bytes zeros). Buffered writes skip it (`write_all` from the payload itself): staging cost
    a copy of every byte and the zeroing of a fresh mapping per object, CPU and memory bandwidth that the
    engine's thread competes for while it launches a prefill's kernels."""
    with mmap.mmap(-1, size) as buffer:
        buffer[: len(header)] = header
        view = np.frombuffer(buffer, dtype=np.uint8)
        view[BLOCK : BLOCK + payload.nbytes] = payload
        del view  # a live export would keep the mapping from closing
        with memoryview(buffer) as data:
            write_all(fd, [data])


def write_all(fd: int, parts: list[memoryview]) -> None:
    """Every byte of `parts` (byte views), in order: a write may stop short, and the next resumes there."""
    parts = [part for part in parts if part.nbytes]
    while parts:
        written = os.writev(fd, parts)
        while parts and written >= parts[0].nbytes:
            written -= parts[0].nbytes
            parts.pop(0)
        if parts:
            parts[0] = parts[0][written:]


def read_object(path: Path, kind: int, key: bytes, namespace: str, out: np.ndarray) -> None:
    """Read the object at `path` into `out` (uint8, its exact payload size), checking everything.
    Raises CorruptObject on any mismatch (`out` then holds garbage) and OSError when it cannot be read.

    Buffered, also where writes go O_DIRECT: objects written recently (the usual restart case) are still
    in the page cache, and O_DIRECT would fetch them from the device again (on the H200 machine's virtual
    disk that made a 64K-token restore read at 0.03 GB/s)."""
    size = object_file_size(out.nbytes)
    fd = open_regular_file(path)
    try:
        actual = os.fstat(fd).st_size
        if actual != size:
            raise CorruptObject(f"{actual} bytes, expected {size}")
        header = os.pread(fd, _HEADER.size, 0)
        with memoryview(out) as target:
            done = 0
            while done < out.nbytes:
                count = os.preadv(fd, [target[done:]], BLOCK + done)
                if count == 0:
                    raise CorruptObject("short read")
                done += count
    finally:
        os.close(fd)
    _check_header(header, kind, key, namespace, out)


def _check_header(header: bytes, kind: int, key: bytes, namespace: str, payload: np.ndarray) -> None:
    if len(header) < _HEADER.size:
        raise CorruptObject("short header")
    magic, version, got_kind, length, got_namespace, got_key, checksum = _HEADER.unpack(header)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise CorruptObject(f"not a morion cache object of format {FORMAT_VERSION}")
    if got_kind != kind or length != payload.nbytes:
        raise CorruptObject(
            f"kind {got_kind} / {length} bytes, expected kind {kind} / {payload.nbytes} bytes"
        )
    if got_namespace != bytes.fromhex(namespace)[:16] or got_key != key:
        raise CorruptObject("the object belongs to another namespace or key")
    if hashlib.sha256(memoryview(payload)).digest() != checksum:
        raise CorruptObject("checksum mismatch")


def verify_object_file(path: Path, namespace: str, payload_bytes: int) -> str | None:
    """None when the file at `path` (named `<key>.page|snap`) is a valid object, else why not."""
    match = OBJECT_NAME.match(path.name)
    if match is None:
        return "not an object file name"
    kind = KIND_PAGE if match.group(2) == "page" else KIND_SNAPSHOT
    try:
        # Checked before the buffer is allocated: the manifest's payload size is anyone's text.
        status = os.stat(path, follow_symlinks=False)
        if not stat.S_ISREG(status.st_mode):
            return "not a regular file"
        actual = status.st_size
        if actual != object_file_size(payload_bytes):
            return f"{actual} bytes, expected {object_file_size(payload_bytes)}"
        out = np.empty(payload_bytes, dtype=np.uint8)
        read_object(path, kind, bytes.fromhex(match.group(1)), namespace, out)
    except CorruptObject as error:
        return str(error)
    except OSError as error:
        return f"unreadable: {error}"
    return None


def temp_file_writer_pid(name: str) -> int | None:
    """The pid of the process that wrote temporary file `name`, or None if `name` is not one of ours."""
    match = _TMP_NAME.match(name)
    return int(match.group(1)) if match else None


def process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    if not 0 < pid <= _MAX_PID:  # 0 would be our process group; a larger one overflows os.kill
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
