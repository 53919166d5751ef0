"""Counters and gauges of the cache tiers, in one object the engine owns and the server exports."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class CacheStats:
    """Cumulative counters since the engine started, and gauges refreshed every step.

    Hits are counted once per request, at its first admission, by the tier its cached prefix came from;
    `device_hit_tokens + host_hit_tokens + disk_hit_tokens` is the sum of the reported `cached_tokens`.
    A disk hit is a prefix prefetched from disk into host memory for the request and restored from there.
    Restores, bytes and faults count every event (a retracted request restores again when readmitted).
    """

    # hits by tier
    device_hits: int = 0
    host_hits: int = 0
    disk_hits: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    disk_hit_tokens: int = 0
    # load-back (host -> device)
    restores: int = 0
    restored_tokens: int = 0
    restored_snapshots: int = 0
    restore_seconds_total: float = 0.0  # from the admission that found the hit (disk prefetch included)
    restore_seconds_max: float = 0.0  # ... to the copies being done
    # backups (device -> host) and disk traffic
    backed_up_pages: int = 0
    backed_up_snapshots: int = 0
    bytes_device_to_host: int = 0
    bytes_host_to_device: int = 0
    bytes_disk_read: int = 0
    bytes_disk_written: int = 0
    disk_objects_read: int = 0
    disk_objects_written: int = 0
    # faults and evictions
    checksum_failures: int = 0  # disk objects that failed a check on read: each was a miss
    disk_read_errors: int = 0  # unreadable (vanished) objects: misses too
    disk_write_errors: int = 0  # failed writes (disk full, say): the object is simply not on disk
    host_evictions: int = 0
    disk_evictions: int = 0
    # gauges
    host_enabled: bool = False
    host_pages_used: int = 0
    host_pages_capacity: int = 0
    host_snapshots_used: int = 0
    host_snapshots_capacity: int = 0
    host_bytes: int = 0
    disk_enabled: bool = False
    disk_skip_reason: str | None = None
    disk_objects: int = 0
    disk_bytes_used: int = 0
    disk_bytes_budget: int = 0

    def snapshot(self) -> CacheStats:
        """A copy, safe to hand to another thread or process."""
        return dataclasses.replace(self)

    def as_dict(self) -> dict[str, int | float | bool | str | None]:
        return dataclasses.asdict(self)
