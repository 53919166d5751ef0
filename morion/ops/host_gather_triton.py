"""Rows of a sharded table in page-locked host memory, gathered by a GPU kernel (no host work).

A page-locked (pinned or `cudaHostRegister`ed) buffer is mapped into the GPU's address space on systems
with unified virtual addressing (every 64-bit Linux CUDA system): a kernel can load from it over
PCIe/NVLink-C2C, at the address `device_addresses` asks the driver for (the host address itself where
the device can use host pointers for registered memory; pageable or memory-mapped memory has none). So a
decode step that needs a few rows of a table far larger than the GPU (Qwen3.8-Flash-Next's 47.7 GiB n-gram
table, 16 rows of 160 B per token) reads them in the kernel, with the row ids computed on the device:
nothing syncs, and a CUDA graph can capture it. Shards are addressed by a device tensor of their base
addresses (int64), so any number of shards is one launch.

Under TRITON_INTERPRET=1 the same kernel reads CPU tensors (tests check it against indexing). PDL
(ops/pdl.py): each program waits for the kernel before it first of all.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from morion.ops.pdl import launch_options, wait_for_previous_kernel


@triton.jit
def _gather_kernel(
    rows_ptr, addresses_ptr, out_ptr, shard_rows, ROW_BYTES: tl.constexpr, BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous_kernel(USE_PDL)
    index = tl.program_id(0)
    row = tl.load(rows_ptr + index)
    shard = row // shard_rows
    base = tl.load(addresses_ptr + shard)
    source = (base + (row - shard * shard_rows) * ROW_BYTES).to(tl.pointer_type(tl.uint8))
    for start in tl.static_range(0, ROW_BYTES, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < ROW_BYTES
        tl.store(out_ptr + index * ROW_BYTES + offs, tl.load(source + offs, mask=mask), mask=mask)


def gather_host_rows(
    rows: torch.Tensor, shard_addresses: torch.Tensor, shard_rows: int, row_bytes: int
) -> torch.Tensor:
    """rows [N] int64 (global row ids, on the device); shard_addresses [num_shards] int64 (on the device):
    the address of each shard's first byte, shards of `shard_rows` rows of `row_bytes` bytes each (the
    last may be shorter; rows must exist). Returns [N, row_bytes] uint8 on the rows' device."""
    out = torch.empty(rows.shape[0], row_bytes, dtype=torch.uint8, device=rows.device)
    if rows.shape[0]:
        block = min(1024, triton.next_power_of_2(row_bytes))
        _gather_kernel[(rows.shape[0],)](
            rows, shard_addresses, out, shard_rows, ROW_BYTES=row_bytes, BLOCK=block, **launch_options(),
            num_warps=1,
        )  # fmt: skip
    return out


_CU_POINTER_ATTRIBUTE_DEVICE_POINTER = 3  # CUpointer_attribute: 2 is MEMORY_TYPE


@functools.cache
def _libcuda() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def device_addresses(tensors: Sequence[torch.Tensor], device: torch.device) -> list[int] | None:
    """The address at which kernels on `device` read each host tensor's memory (the driver's
    CU_POINTER_ATTRIBUTE_DEVICE_POINTER), or None when some tensor's memory is not mapped into the
    device's address space (pageable, or memory-mapped files). Synchronizes: call it outside captures."""
    libcuda = _libcuda()
    if libcuda is None:
        return None
    addresses = []
    with torch.cuda.device(device):
        torch.cuda.synchronize()  # the device's primary context is current on this thread from here
        for tensor in tensors:
            address = ctypes.c_uint64()
            status = libcuda.cuPointerGetAttribute(
                ctypes.byref(address),
                ctypes.c_int(_CU_POINTER_ATTRIBUTE_DEVICE_POINTER),
                ctypes.c_uint64(tensor.data_ptr()),
            )
            if status != 0:
                return None
            addresses.append(address.value)
    return addresses
