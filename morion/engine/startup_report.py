"""The engine's startup lines on stderr: what the model, the pool, the state slots and the cache tiers
got, so an operator sees every size the memory was split into."""

from __future__ import annotations

import sys

import torch

from morion.cache.page_pool import PagePool
from morion.cache.state_slots import StateSlots
from morion.cache.tier_stats import CacheStats
from morion.cache.tiers import CacheTiers
from morion.config import EngineConfig
from morion.ops.pdl import pdl_mode


def report_startup(
    config: EngineConfig,
    model: torch.nn.Module,
    pool: PagePool,
    slots: StateSlots | None,
    tiers: CacheTiers | None,
    stats: CacheStats,
    weight_bytes: int,
    activation_reserve: int,
    max_model_len: int,
    bytes_per_token: int,
) -> None:
    device = config.torch_device
    prefix_cache = "on" if config.enable_prefix_cache else "off"
    state = ""
    if slots is not None:
        per_slot = pool.spec.bytes_per_slot
        state = f"; state slots {slots.num_slots} x {per_slot} B ({slots.num_bytes / 2**30:.2f} GiB)"
    kv_dtype = str(pool.spec.token_components[0].dtype).removeprefix("torch.")
    print(
        f"morion: {model.config.model_type} on {device}; weights "
        f"{weight_bytes / 2**30:.2f} GiB; KV pool {pool.num_pages} pages x {config.page_size} = "
        f"{pool.num_pages * config.page_size} tokens at {bytes_per_token} B/token {kv_dtype} "
        f"({pool.num_bytes / 2**30:.2f} GiB){state}; activation reserve "
        f"{activation_reserve / 2**30:.2f} GiB; max model len {max_model_len}; "
        f"chunk {config.chunk_size}; max running {config.max_running_requests}; "
        f"prefix cache {prefix_cache}",
        file=sys.stderr,
    )
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        print(
            f"morion: CUDA memory {free / 2**30:.2f} of {total / 2**30:.2f} GiB free; "
            f"programmatic dependent launch {pdl_mode()} (--pdl {config.pdl})",
            file=sys.stderr,
        )
    if tiers is None:
        return
    line = (
        f"morion: host cache {tiers.host.num_rows} pages x {tiers.host.layout.row_bytes} B"
        f"{' (pinned)' if device.type == 'cuda' else ''}"
    )
    if tiers.snapshots is not None:
        line += f" + {tiers.snapshots.num_rows} snapshots x {tiers.snapshots.layout.row_bytes} B"
    tiers.refresh_gauges()
    line += f" = {stats.host_bytes / 2**30:.2f} GiB, {config.host_cache_write_policy}"
    disk = tiers.disk
    if disk is not None and disk.enabled:
        origin = "" if config.disk_cache_gb is not None else " (auto: half of free space + own objects)"
        line += (
            f"; disk cache {disk.dir} ({disk.num_objects} objects, {disk.used_bytes / 2**30:.2f} of "
            f"{disk.budget_bytes / 2**30:.2f} GiB{origin}, "
            f"{'O_DIRECT' if disk.direct_io else 'buffered'})"
        )
    elif disk is not None:
        line += f"; disk cache SKIPPED: {disk.skip_reason}"
    print(line, file=sys.stderr)
