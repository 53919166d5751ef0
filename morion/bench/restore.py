"""The restore workload (issue #7): TTFT of one long conversation cold, then served by each cache tier.

Per repeat, a fresh conversation of N tokens (`--restore-length`, whole pages) and one new token make the
prompt of four requests, each generating `OUTPUT_TOKENS` greedy tokens:

1. cold: nothing cached;
2. device hit: the same prompt again;
3. host hit: after `Engine.evict_device_cache()` (the device copy gone, the host tier's kept);
4. disk hit after a restart: the engine is closed (its disk writes finish), freed and built again from
   the same config: empty device cache and host tier, the same disk directory. Then, not in the TTFT,
   with `--restore-page-cache evict` (the default) every file of the disk directory is written back and
   dropped from the OS page cache (`posix_fadvise(POSIX_FADV_DONTNEED)`), so the disk hit reads the disk
   rather than memory; what was evicted, and how much of it was still resident after, is recorded.

Why the one new token: a request always computes at least its last token (its logits give the next one),
so a prompt ending on a page boundary could reuse all but its last page; and a hybrid model's state is
valid at one position only, so its reusable prefix ends where a snapshot was taken: the last page boundary
of the cold prompt (prefill chunks are cut there for one). With one token after the conversation, all N
tokens are reusable on every model, and `cached_tokens` must be exactly N for each hit.

Every hit's output is compared with the cold output of its conversation, token for token: a fast wrong
answer is the worst failure, so a differing row is FAILED whatever its speed.
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from morion.bench.options import RESTORE_PAGE_CACHE
from morion.bench.timing import median_of
from morion.cache.disk_format import object_file_size
from morion.errors import MorionError

if TYPE_CHECKING:  # annotations only: the report imports this module's names, and needs no engine
    from morion.bench.offline import EngineTarget
    from morion.bench.options import BenchOptions
    from morion.bench.workloads import Workbench
    from morion.config import EngineConfig
    from morion.engine.engine import Engine

OUTPUT_TOKENS = 8  # enough to see a restored state go wrong; ~0.1 s of decode on an 80B model
KINDS = ("cold", "device", "host", "disk")
KIND_NAMES = {"cold": "cold", "device": "device hit", "host": "host hit", "disk": "disk hit after restart"}
# Issue #7's targets, as ratios of the median TTFT to the median cold TTFT.
TARGETS = {
    "host": (0.1, "host-hit TTFT < cold TTFT / 10"),
    "disk": (1.0, "disk-hit TTFT after a restart < cold TTFT"),
}
# CacheStats counters whose change over one request is recorded with it.
COUNTERS = (
    "device_hit_tokens",
    "host_hit_tokens",
    "disk_hit_tokens",
    "restores",
    "restored_tokens",
    "restored_snapshots",
    "restore_seconds_total",
    "bytes_host_to_device",
    "bytes_disk_read",
    "disk_objects_read",
    "checksum_failures",
    "disk_read_errors",
)
# --restore-page-cache: evict the disk directory's files from the OS page cache before the disk hit, or not.
PAGE_CACHE_MODES = RESTORE_PAGE_CACHE
PAGE_CACHE_KEYS = ("files", "bytes", "resident_bytes_before", "resident_bytes_after", "seconds")
SUGGESTED_FLAGS = "e.g. --host-cache-gb 8 --disk-cache-dir /tmp/morion-restore, a directory on a local disk"


def check_flags(config: EngineConfig, options: BenchOptions) -> None:
    """The engine flags the workload needs, checked before any engine is built."""
    flags = (("--host-cache-gb", config.host_cache_gb), ("--disk-cache-dir", config.disk_cache_dir))
    missing = [flag for flag, value in flags if value is None]
    if missing:
        raise MorionError(f"--workloads restore needs {' and '.join(missing)}: {SUGGESTED_FLAGS}")
    if not config.enable_prefix_cache:
        raise MorionError("--workloads restore measures the prefix cache: leave out --no-prefix-cache")
    if options.restore_length % config.page_size:
        raise MorionError(
            f"--restore-length {options.restore_length} must be a multiple of the page size "
            f"{config.page_size} (a conversation is cached in whole pages)"
        )


def check_capacity(engine: Engine, length: int) -> None:
    """The host tier must hold one conversation (its pages and the snapshots of its prefill) and the disk
    budget one conversation's objects; else the hits would be partial and the run wasted."""
    config, tiers, stats = engine.config, engine.tiers, engine.cache_stats
    if tiers is None or tiers.disk is None or not tiers.disk.enabled:
        raise MorionError(f"--workloads restore needs the disk tier, which is off: {stats.disk_skip_reason}")
    pages = length // config.page_size
    page_row = tiers.host.layout.row_bytes
    snapshots, snapshot_row = 0, 0
    if tiers.snapshots is not None:
        # A snapshot at every prefill chunk that ends on a page boundary, the conversation's end included.
        snapshots, snapshot_row = math.ceil(length / config.chunk_size), tiers.snapshots.layout.row_bytes
    if stats.host_pages_capacity < pages or stats.host_snapshots_capacity < snapshots:
        need = pages * page_row
        if snapshots:
            fraction = config.host_cache_state_fraction
            need = max(need / (1 - fraction), snapshots * snapshot_row / fraction)
        raise MorionError(
            f"--host-cache-gb {config.host_cache_gb:g} holds {stats.host_pages_capacity} pages and "
            f"{stats.host_snapshots_capacity} snapshots; a {length:,}-token conversation needs {pages} and "
            f"{snapshots}: use --host-cache-gb {_gib_up(need * 1.25)} or more"
        )
    need = pages * object_file_size(page_row) + snapshots * object_file_size(snapshot_row)
    if stats.disk_bytes_budget < need * 1.1:
        raise MorionError(
            f"the disk cache budget ({_size(stats.disk_bytes_budget)}) is below one {length:,}-token "
            f"conversation ({_size(need)}) and some room: use --disk-cache-gb {_gib_up(need * 1.5)} or "
            "more (the default is half the free space plus the tier's own objects)"
        )


def run_restore(
    bench: Workbench,
    target: EngineTarget,
    length: int,
    repeats: int,
    on_update: Callable[[dict[str, Any]], None] | None = None,
    page_cache: str = "evict",
) -> dict[str, Any]:
    """Runs the workload on `target` (restarting its engine once per repeat); returns the `restore`
    section of the results, which `on_update` also receives after every request. `page_cache`
    (`--restore-page-cache`): "evict" drops the disk directory's files from the OS page cache before each
    disk hit, "keep" leaves them (the disk hit may then read memory)."""
    if page_cache not in PAGE_CACHE_MODES:
        raise MorionError(
            f"--restore-page-cache must be one of {', '.join(PAGE_CACHE_MODES)}, got {page_cache!r}"
        )
    config = target.config
    disk = target.engine.tiers.disk
    section: dict[str, Any] = {
        "engine": bench.label,
        "conversation_tokens": length,
        "prompt_tokens": length + 1,
        "output_tokens": OUTPUT_TOKENS,
        "repeats": repeats,
        "expected_cached_tokens": length,
        "page_size": config.page_size,
        "chunk_size": config.chunk_size,
        "host_cache_gb": config.host_cache_gb,
        "host_cache_write_policy": config.host_cache_write_policy,
        "page_cache": page_cache,
        "disk": {
            "dir": str(disk.dir),
            "direct_io": disk.direct_io,
            "budget_bytes": disk.budget_bytes,
            "filesystem": filesystem_of(disk.dir),
        },
        "runs": [],
    }
    name = f"{bench.label} restore {length:,}"
    for r in range(repeats):
        run: dict[str, Any] = {"repeat": r, "prompt_key": f"{bench.label}:restore:{length}:{r}"}
        section["runs"].append(run)
        _run_conversation(bench, target, section, run, f"{name}: run {r + 1}/{repeats}", on_update)
    bench.say(f"{name}: {summary_line(section)}")
    return section


def _run_conversation(
    bench: Workbench,
    target: EngineTarget,
    section: dict[str, Any],
    run: dict[str, Any],
    name: str,
    on_update: Callable[[dict[str, Any]], None] | None,
) -> None:
    """One repeat: a fresh conversation cold, then from the device, the host and (after a restart) disk."""
    length = section["conversation_tokens"]
    prompt = bench.prompts.make(run["prompt_key"], length + 1)

    def keep(kind: str, sample: dict[str, Any]) -> None:
        run[kind] = sample
        bench.say(f"{name}: {_progress(kind, sample)}")
        summarize(section)
        if on_update is not None:
            on_update(section)

    keep("cold", measure(target, prompt, None, 0, None))
    reference = run["cold"]["output_token_ids"]
    keep("device", measure(target, prompt, reference, length, "device"))
    evicted = target.engine.evict_device_cache()
    keep("host", {**measure(target, prompt, reference, length, "host"), "evicted_pages": evicted})
    close_s, build_s = target.restart()
    # What the new engine found on disk: none would mean another namespace (the weights differ).
    found = target.engine.cache_stats.disk_objects
    run["restart"] = {"close_s": close_s, "build_s": build_s, "disk_objects_found": found}
    bench.say(
        f"{name}: restart: close {close_s:.1f} s (disk writes finish), build {build_s:.1f} s, "
        f"{found} objects on disk"
    )
    # Not in the TTFT: the buffered writes of the old engine (and earlier disk hits' reads) left the objects
    # in the page cache, where the disk hit would find them without reading the disk.
    run["page_cache"] = prepare_page_cache(target.engine.tiers.disk.dir, section["page_cache"])
    bench.say(f"{name}: {_page_cache_progress(run['page_cache'])}")
    keep("disk", measure(target, prompt, reference, length, "disk"))


def measure(
    target: EngineTarget, prompt: list[int], reference: list[int] | None, expected: int, tier: str | None
) -> dict[str, Any]:
    """One request: its TTFT, output, cached tokens and the change in the cache counters over it, checked
    against what it should be: served by `tier` with `expected` cached tokens (None: nothing cached), and
    the output equal to `reference` (None: this is the reference)."""
    engine = target.engine
    before = engine.cache_stats.snapshot()
    timing, token_ids = target.run_request(prompt, OUTPUT_TOKENS)
    # One idle step: it retires the finished copies (their restore latency is counted then) and runs the
    # engine's integrity check (every page free, cached or held; host rows each in one place).
    engine.step()
    after = engine.cache_stats.snapshot()
    delta = {key: getattr(after, key) - getattr(before, key) for key in COUNTERS}
    restore_bytes = {"host": delta["bytes_host_to_device"], "disk": delta["bytes_disk_read"]}.get(tier or "")
    restore_s = delta["restore_seconds_total"] if restore_bytes is not None else None
    difference = _first_difference(token_ids, reference) if reference is not None else None
    sample = {
        "ttft_s": timing.ttft_s,
        "prompt_tokens": timing.prompt_tokens,
        "completion_tokens": timing.completion_tokens,
        "cached_tokens": timing.cached_tokens,
        "output_token_ids": token_ids,
        "identical": None if reference is None else difference is None,
        "first_difference": difference,
        "restore_bytes": restore_bytes,
        "restore_s": restore_s,
        "restore_gbs": restore_bytes / restore_s / 1e9 if restore_bytes and restore_s else None,
        "stats_delta": delta,
    }
    sample["problems"] = _problems(sample, delta, expected, tier)
    return sample


def _problems(sample: dict[str, Any], delta: dict[str, Any], expected: int, tier: str | None) -> list[str]:
    problems = []
    if sample["cached_tokens"] != expected:
        problems.append(f"{sample['cached_tokens']:,} cached tokens, expected {expected:,}")
    served = {t: delta[f"{t}_hit_tokens"] for t in ("device", "host", "disk") if delta[f"{t}_hit_tokens"]}
    if tier is not None and served != {tier: expected}:
        where = ", ".join(f"{t} {n:,}" for t, n in served.items()) or "nothing"
        problems.append(f"hit tokens by tier: {where}; expected {tier} {expected:,}")
    if sample["identical"] is False:
        problems.append(f"output differs from cold at token {sample['first_difference']}")
    return problems


def _first_difference(tokens: list[int], reference: list[int]) -> int | None:
    for index, (mine, theirs) in enumerate(zip(tokens, reference, strict=False)):
        if mine != theirs:
            return index
    return None if len(tokens) == len(reference) else min(len(tokens), len(reference))


def summarize(section: dict[str, Any]) -> None:
    """Medians per kind over the runs measured so far, ratios to cold, the targets and the failures."""
    runs = section["runs"]
    medians: dict[str, dict[str, Any]] = {}
    for kind in KINDS:
        samples = [run[kind] for run in runs if kind in run]
        medians[kind] = {
            key: median_of(samples, key)
            for key in ("ttft_s", "cached_tokens", "restore_gbs", "restore_bytes", "restore_s")
        }
        medians[kind]["runs"] = len(samples)
    section["median"] = medians
    cold = medians["cold"]["ttft_s"]
    section["ratio_to_cold"] = {
        kind: medians[kind]["ttft_s"] / cold if cold and medians[kind]["ttft_s"] is not None else None
        for kind in KINDS[1:]
    }
    failures = [
        f"{KIND_NAMES[kind]}, run {run['repeat'] + 1}: {problem}"
        for run in runs
        for kind in KINDS
        for problem in run.get(kind, {}).get("problems", [])
    ]
    section["failures"] = failures
    section["identical"] = {
        kind: all(run[kind]["identical"] for run in runs if kind in run) if medians[kind]["runs"] else None
        for kind in KINDS[1:]
    }
    section["targets"] = {}
    for kind, (limit, rule) in TARGETS.items():
        ratio = section["ratio_to_cold"][kind]
        ok = not any(run.get(kind, {}).get("problems") for run in runs)
        section["targets"][kind] = {
            "rule": rule,
            "limit": limit,
            "ratio": ratio,
            "met": None if ratio is None else bool(ok and ratio < limit),
        }
    restarts = [run["restart"] for run in runs if "restart" in run]
    section["restart_median"] = {key: median_of(restarts, key) for key in ("close_s", "build_s")}
    passes = [run["page_cache"] for run in runs if "page_cache" in run]
    section["page_cache_median"] = {key: median_of(passes, key) for key in PAGE_CACHE_KEYS}


def prepare_page_cache(directory: Path, mode: str) -> dict[str, Any]:
    """The OS page cache before a disk hit. Every file under `directory` (the disk tier's namespace: its
    object files and manifest) is, with `mode` "evict", written back (`os.fsync`: dirty pages cannot be
    dropped) and dropped from the page cache with `posix_fadvise(POSIX_FADV_DONTNEED)`, which needs no
    root for clean pages; with "keep" it is left alone. Its page-cache residency before and after
    (`mincore`, Linux, files this user owns or may write; else None) says what actually left memory: a
    tmpfs keeps everything, being memory. Where the platform has no `posix_fadvise`, nothing is evicted and
    `reason` says why."""
    started = time.perf_counter()
    supported = hasattr(os, "posix_fadvise") and hasattr(os, "POSIX_FADV_DONTNEED")
    evict = mode == "evict" and supported
    record: dict[str, Any] = {
        "mode": mode,
        "evicted": evict,
        "reason": None if evict or mode == "keep" else "os.posix_fadvise is unavailable on this platform",
        "files": 0,  # files evicted (none under keep)
        "bytes": 0,  # their sizes
        "files_in_dir": 0,
        "bytes_in_dir": 0,
        "resident_bytes_before": 0,  # in the page cache before the eviction (None: not measurable)
        "resident_bytes_after": 0,  # and when the disk hit starts
        "errors": 0,
        "first_error": None,
    }
    for folder, _, names in os.walk(directory):
        for file_name in sorted(names):
            path = os.path.join(folder, file_name)
            try:
                before, after, size = _page_cache_file(path, evict)
            except OSError as error:  # a file gone meanwhile (a temp file), or one we may not open
                record["errors"] += 1
                record["first_error"] = record["first_error"] or f"{path}: {error}"
                continue
            record["files_in_dir"] += 1
            record["bytes_in_dir"] += size
            if evict:
                record["files"] += 1
                record["bytes"] += size
            for key, value in (("resident_bytes_before", before), ("resident_bytes_after", after)):
                record[key] = None if value is None or record[key] is None else record[key] + value
    record["seconds"] = time.perf_counter() - started
    return record


def _page_cache_file(path: str, evict: bool) -> tuple[int | None, int | None, int]:
    """(resident bytes before, resident bytes after, size) of one file, evicted from the page cache first
    when `evict`."""
    fd = os.open(path, os.O_RDONLY)
    try:
        stat = os.fstat(fd)
        # mincore reports every page resident for a file the caller neither owns nor may write.
        measurable = stat.st_uid == os.geteuid() or os.access(path, os.W_OK)
        before = _resident_bytes(fd, stat.st_size) if measurable else None
        if not evict:
            return before, before, stat.st_size
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        after = _resident_bytes(fd, stat.st_size) if measurable else None
        return before, after, stat.st_size
    finally:
        os.close(fd)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library's mmap, munmap and mincore (Linux only: elsewhere mincore means other things)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    except (OSError, AttributeError):
        return None
    return libc


def _resident_bytes(fd: int, size: int) -> int | None:
    """Bytes of the open file `fd` in the page cache (whole pages, at most `size`), from `mincore` on a
    read-only shared mapping that touches no page; None where that cannot be asked."""
    libc = _libc()
    if size == 0 or libc is None:
        return 0 if size == 0 else None
    address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if address is None or address == ctypes.c_void_p(-1).value:  # MAP_FAILED
        return None
    try:
        pages = -(-size // mmap.PAGESIZE)
        vector = (ctypes.c_ubyte * pages)()
        if libc.mincore(address, size, vector) != 0:
            return None
        resident = int(np.count_nonzero(np.frombuffer(vector, dtype=np.uint8) & 1))
    finally:
        libc.munmap(address, size)
    return min(resident * mmap.PAGESIZE, size)


def _page_cache_progress(record: dict[str, Any]) -> str:
    resident = record["resident_bytes_after"]
    if record["evicted"]:
        line = (
            f"page cache: evicted {record['files']} files ({_size(record['bytes'])}) "
            f"in {record['seconds']:.2f} s"
        )
        if resident is not None:
            line += f", resident {_size(record['resident_bytes_before'])} before, {_size(resident)} after"
    elif record["mode"] == "keep":
        line = f"page cache: kept ({record['files_in_dir']} files"
        line += f", {_size(resident)} resident)" if resident is not None else ")"
    else:
        line = f"page cache NOT evicted: {record['reason']}"
    if record["errors"]:
        line += f"; {record['errors']} files failed: {record['first_error']}"
    return line


def summary_line(section: dict[str, Any]) -> str:
    medians, ratios = section["median"], section["ratio_to_cold"]
    parts = [f"median TTFT cold {_ms(medians['cold']['ttft_s'])}"]
    for kind in KINDS[1:]:
        part = f"{kind} {_ms(medians[kind]['ttft_s'])} ({_ratio(ratios[kind])} of cold"
        if kind in TARGETS:
            target = section["targets"][kind]
            part += f", target < {target['limit']:g}: {'met' if target['met'] else 'NOT met'}"
        parts.append(part + ")")
    failures = section["failures"]
    return ", ".join(parts) + (f"; {len(failures)} FAILED: {failures[0]}" if failures else "")


def filesystem_of(path: Path) -> dict[str, str] | None:
    """The mount holding `path` (from /proc/mounts, Linux): a tmpfs "disk" is RAM, and the report says so."""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return None
    resolved, best = str(Path(path).resolve()), None
    for line in mounts:
        fields = line.split()
        if len(fields) < 3:
            continue
        device, mount, fstype = fields[0], fields[1].replace("\\040", " "), fields[2]
        inside = resolved == mount or resolved.startswith(mount.rstrip("/") + "/")
        if inside and (best is None or len(mount) >= len(best["mount"])):
            best = {"mount": mount, "fstype": fstype, "device": device}
    return best


def _progress(kind: str, sample: dict[str, Any]) -> str:
    line = f"{KIND_NAMES[kind]}: TTFT {_ms(sample['ttft_s'])}, {sample['cached_tokens']:,} cached"
    if sample["restore_bytes"] is not None:
        line += (
            f", {_size(sample['restore_bytes'])} restored in {_ms(sample['restore_s'])} "
            f"({_gbs(sample['restore_gbs'])})"
        )
    if sample["identical"] is not None:
        line += ", output identical to cold" if sample["identical"] else ", output DIFFERS from cold"
    if sample["problems"]:
        line += f": FAILED ({'; '.join(sample['problems'])})"
    return line


def _size(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.2f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.2f} MiB"


def _gib_up(num_bytes: float) -> str:
    return f"{math.ceil(num_bytes / 2**30 * 10) / 10:g}"


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:,.0f} ms"


def _gbs(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f} GB/s"


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"
