"""A row table that lives in host memory, never on the model's device, and the per-step fetch of its rows.

Qwen3.8-Flash-Next's n-gram table is 320M rows x 160 (47.7 GiB in FP8, 95 GiB in BF16) of which a token
reads 16 rows: it stays on the host and each step copies only the rows it needs. Checkpoints ship it as
row shards (`shard_{i}.weight`, split like `torch.chunk`: equal shards of ceil(rows / parts) rows, the
last one shorter) and, for FP8 shards, one global dequantization `weight_scale` (real = stored * scale);
an unsharded `weight` is taken too.

Placement (`place`, called by the loader before any tensor arrives):
- "ram": shards are copied into host RAM (FP8 kept FP8, other dtypes converted to the model dtype),
  page-locked in place (`cudaHostRegister`: exact size, unlike the power-of-two pinned allocator) when
  the model is on CUDA;
- "mmap": the tensors the loader hands over (maps of the safetensors files, loader/safetensors_mmap.py)
  are kept as they are; the OS pages rows in on first use. Random weights have no file: they go to RAM.

Fetch (`fetch`): the rows are gathered on the host (byte views: any storage dtype) into a pinned staging
buffer and, on CUDA, copied on a side stream with non_blocking, so the copy overlaps whatever the forward
stream runs meanwhile; the consumer waits on the copy's event on the GPU (`FetchedRows.wait`).
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch
from torch import nn

from morion.config import PLE_PLACEMENTS as PLACEMENTS

FP8_DTYPE = torch.float8_e4m3fn
SCALE = "weight_scale"
UNSHARDED = "weight"


def shard_name(index: int) -> str:
    return f"shard_{index}.weight"


def host_tables(model: nn.Module) -> list[HostRowTable]:
    """The model's host-resident tables: what its optional `host_tables()` hook lists (none without one)."""
    hook = getattr(model, "host_tables", None)
    return hook() if hook is not None else []


class FetchedRows(NamedTuple):
    """Rows on their way to the device. `staging` (the pinned host buffer the copy reads) is kept alive
    until the consumer waited for the copy (copy rule 1)."""

    rows: torch.Tensor  # [N, dim] in the table's storage dtype, on the device
    ready: torch.cuda.Event | None  # recorded on the copy stream after the copy; None on the CPU
    staging: torch.Tensor | None
    scale: float | None  # FP8 dequantization scale

    def wait(self, dtype: torch.dtype) -> torch.Tensor:
        """The rows [N, dim] in `dtype`, once the copy is done (a GPU-side wait: the CPU does not block).
        FP8 rows are dequantized in fp32 (value * scale), then rounded once to `dtype`."""
        if self.ready is not None:
            torch.cuda.current_stream(self.rows.device).wait_event(self.ready)
        if self.scale is not None:
            return (self.rows.float() * self.scale).to(dtype)
        return self.rows.to(dtype)


class HostRowTable:
    def __init__(self, num_rows: int, dim: int, parts: int, dummy_dtype: torch.dtype | None = None) -> None:
        """`dummy_dtype`: what random weights are drawn in (the checkpoint's declared table dtype);
        None: the model dtype."""
        self.num_rows = num_rows
        self.dim = dim
        self.shard_rows = -(-num_rows // parts)
        self.num_shards = -(-num_rows // self.shard_rows)
        self.dummy_dtype = dummy_dtype
        self.placement = "ram"
        self.pin_memory = False
        self.model_dtype = torch.float32
        self.shards: list[torch.Tensor | None] = [None] * self.num_shards
        self.scale: float | None = None
        self._copy_stream: torch.cuda.Stream | None = None

    # -- placement and loading ----------------------------------------------------------------------

    def place(self, placement: str, pin_memory: bool, model_dtype: torch.dtype) -> None:
        if placement not in PLACEMENTS:
            raise ValueError(
                f"host table placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}"
            )
        self.placement, self.pin_memory, self.model_dtype = placement, pin_memory, model_dtype

    def shard_shape(self, index: int) -> tuple[int, int]:
        return (min(self.shard_rows, self.num_rows - index * self.shard_rows), self.dim)

    @property
    def dtype(self) -> torch.dtype | None:
        """The storage dtype of the loaded shards (None before any)."""
        return next((s.dtype for s in self.shards if s is not None), None)

    def missing(self) -> list[str]:
        """What a loaded table still lacks (empty when complete)."""
        missing = [shard_name(i) for i, shard in enumerate(self.shards) if shard is None]
        if self.dtype == FP8_DTYPE and self.scale is None:
            missing.append(SCALE)
        return missing

    def load(self, name: str, tensor: torch.Tensor) -> None:
        """Takes a checkpoint tensor by its name relative to the table (`shard_{i}.weight`, `weight`,
        `weight_scale`). Raises ValueError for a wrong shape or dtype."""
        if name == SCALE:
            if tensor.numel() != 1:
                raise ValueError(f"{SCALE} has shape {tuple(tensor.shape)}, expected one value")
            self.scale = float(tensor.float().reshape(()))
        elif name == UNSHARDED:
            if tuple(tensor.shape) != (self.num_rows, self.dim):
                raise ValueError(f"has shape {tuple(tensor.shape)}, expected {(self.num_rows, self.dim)}")
            for index, piece in enumerate(tensor.split(self.shard_rows)):
                self._set_shard(index, piece)
        else:
            index = _shard_index(name)
            if index is None or index >= self.num_shards:
                raise ValueError(f"is not one of the {self.num_shards} shards")
            if tuple(tensor.shape) != self.shard_shape(index):
                raise ValueError(f"has shape {tuple(tensor.shape)}, expected {self.shard_shape(index)}")
            self._set_shard(index, tensor)
        dtypes = {s.dtype for s in self.shards if s is not None}
        if len(dtypes) > 1:
            raise ValueError(f"shards come in several dtypes: {sorted(map(str, dtypes))}")
        if self.scale is not None and dtypes and dtypes != {FP8_DTYPE}:
            raise ValueError(f"a {SCALE} comes with {dtypes.pop()} shards: only FP8 shards are scaled")

    def new_shard(self, index: int, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised host shard of `dtype` that the table holds from now on, in RAM whatever the
        placement (random weights have no file to map); they are drawn into it in place."""
        self.placement = "ram"
        shard = torch.empty(self.shard_shape(index), dtype=dtype)
        if self.pin_memory:
            # Touched first by torch's threads, in parallel: page-locking untouched memory faults in and
            # zeroes every page on one thread (the 47.7 GiB table of the full-size preset took 43 s to draw
            # on the H200, at 1.1 GB/s), as a checkpoint's shard is touched by its copy before it is locked.
            shard.view(torch.uint8).zero_()
        self._keep(index, shard)
        return shard

    def _set_shard(self, index: int, tensor: torch.Tensor) -> None:
        if self.placement == "mmap":
            self.shards[index] = tensor
            return
        dtype = tensor.dtype if tensor.dtype == FP8_DTYPE else self.model_dtype
        shard = torch.empty(tensor.shape, dtype=dtype)
        shard.copy_(tensor)
        self._keep(index, shard)

    def _keep(self, index: int, shard: torch.Tensor) -> None:
        if self.pin_memory:
            _page_lock(shard)
        self.shards[index] = shard

    def describe(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        gib = self.num_rows * self.dim * (self.dtype.itemsize if self.dtype else 0) / 2**30
        where = {"ram": "host RAM", "mmap": "memory-mapped checkpoint files"}[self.placement]
        pinned = " (pinned)" if self.pin_memory and self.placement == "ram" else ""
        scale = "" if self.scale is None else f", scale {self.scale:.4g}"
        return (
            f"{self.num_rows} x {self.dim} {dtype}{scale} in {self.num_shards} shards, "
            f"{gib:.2f} GiB in {where}{pinned}"
        )

    # -- per-step rows ------------------------------------------------------------------------------

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows [N] (int64, host) -> [N, dim] on the host in the storage dtype, pinned when the table is
        used from CUDA. Gathers shard by shard through byte views (indexing is defined for bytes
        everywhere, not for fp8).

        The rows are sorted by shard once, so each shard's rows are one slice of the sorted order: a
        1K-token prefill of Qwen3.8-Flash-Next asks for 16K rows spread over all 128 shards, and a mask
        and a nonzero per shard took the engine thread ~6 ms of its ~17 ms gather on the H200
        (results/2026-12-04-h200-session-notes-8cbb9bd.md)."""
        dtype = self.dtype
        if dtype is None or self.missing():
            raise RuntimeError(f"host table is not loaded: lacks {self.missing() or 'every shard'}")
        out = torch.empty(
            (rows.shape[0], self.dim * dtype.itemsize), dtype=torch.uint8, pin_memory=self.pin_memory
        )
        shard_of = rows // self.shard_rows
        order = torch.argsort(shard_of, stable=True)
        sorted_rows = rows[order]
        by_shard = torch.empty_like(out)  # the rows in sorted order, then scattered back into `out`
        counts = torch.bincount(shard_of, minlength=self.num_shards).tolist()
        start = 0
        for index, count in enumerate(counts):
            if count:
                local = sorted_rows[start : start + count] - index * self.shard_rows
                shard = self.shards[index].view(torch.uint8)
                torch.index_select(shard, 0, local, out=by_shard[start : start + count])
                start += count
        out[order] = by_shard
        return out.view(dtype)

    def fetch(self, rows: torch.Tensor, device: torch.device) -> FetchedRows:
        """Starts moving rows [N] (int64, host) to `device`; `FetchedRows.wait` hands them over."""
        staging = self.gather(rows)
        scale = self.scale if staging.dtype == FP8_DTYPE else None
        if device.type != "cuda":
            return FetchedRows(staging.to(device), None, None, scale)
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device)
        forward = torch.cuda.current_stream(device)
        # Allocated by the forward stream, which only touches it after waiting for the copy; the copy
        # stream first waits for the forward stream's earlier work, which may still use this memory.
        rows_on_device = torch.empty(staging.shape, dtype=staging.dtype, device=device)
        self._copy_stream.wait_stream(forward)
        with torch.cuda.stream(self._copy_stream):
            rows_on_device.copy_(staging, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self._copy_stream)
        return FetchedRows(rows_on_device, ready, staging, scale)


def _shard_index(name: str) -> int | None:
    prefix, suffix = "shard_", ".weight"
    if not (name.startswith(prefix) and name.endswith(suffix)):
        return None
    digits = name[len(prefix) : -len(suffix)]
    return int(digits) if digits.isdigit() else None


def _page_lock(tensor: torch.Tensor) -> None:
    """Registers the tensor's memory as page-locked (pinned) with CUDA, for as long as the tensor lives."""
    cudart = torch.cuda.cudart()
    pointer = tensor.data_ptr()
    error = cudart.cudaHostRegister(pointer, tensor.numel() * tensor.element_size(), 0)
    if int(error) != 0:
        raise RuntimeError(
            f"cudaHostRegister of {tensor.numel() * tensor.element_size()} bytes failed ({error})"
        )
    weakref.finalize(tensor, cudart.cudaHostUnregister, pointer)
