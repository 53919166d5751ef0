"""fla-core's varlen metadata for a prefill forward, built once and shared by its Gated DeltaNet layers.

fla's `chunk_gated_delta_rule` needs, besides cu_seqlens, the (sequence, chunk) pairs of the packed batch
(`chunk_indices`) and memoises what it derives from cu_seqlens (`tensor_cache`) by tensor identity. Given
a fresh cu_seqlens at every layer (as `gdn_prefill_` once did, so that a reused buffer with new contents
could never meet stale offsets), each of the 36 layers of the 80B preset rebuilt all of it, and
`prepare_chunk_indices` copied its result to the device with a blocking copy: one host sync per layer,
which leaves the GPU idle until the host has queued the next kernels (the 80B's 1K prefill spent 89 of
its 152 ms of device idle per step in Gated DeltaNet's host code: results/2026-12-02-h200-profile-80b-
prefill.md). Here the metadata is keyed by the sequence bounds' values, so every layer of a forward (and
any later forward of the same bounds) gets the same tensors: fla's memo hits, nothing is rebuilt, and
the one host-to-device copy is asynchronous, from pinned memory.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

# The chunk size `gdn_prefill_` passes fla (its default); chunk_indices are built for it.
FLA_CHUNK_SIZE = 64


class FlaVarlen(NamedTuple):
    bounds: tuple[int, ...]  # 0, end of sequence 0, ..., T
    cu_seqlens: torch.Tensor  # [N + 1] int64 on the device
    cu_seqlens_cpu: torch.Tensor  # the same on the host
    chunk_indices: torch.Tensor  # [chunks, 2] int64 on the device: (sequence, chunk within it)


_last: FlaVarlen | None = None


def fla_varlen(cu_seqlens_cpu: torch.Tensor, device: torch.device) -> FlaVarlen:
    """The metadata of sequences bounded by `cu_seqlens_cpu` ([N + 1], host), on `device`: the last
    call's tensors again when the bounds and the device are the same (their values are all that fla
    reads), else new ones."""
    global _last
    bounds = tuple(int(x) for x in cu_seqlens_cpu)
    if _last is not None and _last.bounds == bounds and _last.cu_seqlens.device == device:
        return _last
    host = torch.tensor(bounds, dtype=torch.int64)
    counts = (host.diff() + FLA_CHUNK_SIZE - 1) // FLA_CHUNK_SIZE
    sequence = torch.repeat_interleave(torch.arange(len(counts)), counts)
    first_of_sequence = counts.cumsum(0) - counts
    chunk = torch.arange(int(counts.sum())) - first_of_sequence[sequence]
    sources = [host, torch.stack([sequence, chunk], 1)]
    if device.type == "cuda":  # asynchronous: the caching host allocator keeps the pinned sources alive
        sources = [tensor.pin_memory() for tensor in sources]
    on_device = [tensor.to(device, non_blocking=True) for tensor in sources]
    _last = FlaVarlen(bounds, on_device[0], host, on_device[1])
    return _last
