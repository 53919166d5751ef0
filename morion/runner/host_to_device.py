"""Small arrays between host and device without stalling the host behind the device's queue.

`to_device`: small host arrays to the device in one copy.

A step's metadata (token ids, positions, K/V slots, page tables, lengths, state slots) is a handful of
arrays of a few hundred bytes each. Copied one by one, each is a driver call of its own, and while the
device waits for a step's inputs, those calls are the step's critical path. Here they are laid out in
one host byte buffer, each array at a 16-byte aligned offset, copied in one transfer, and handed back as
device views of it. 16, not the 8 any dtype needs to be viewed in place: Triton specializes a kernel on
whether each pointer argument is 16-byte aligned, so with 8 a view's alignment would follow the lengths of
the arrays before it, and a batch of a new shape could bring a variant the warm-up never compiled (a
compile stalls every running request for seconds; tests/engine/test_engine_gpu.py checks none happens).

For a CUDA device the buffer is page-locked, from torch's caching host allocator: a copy from pageable
memory may make the driver wait for the stream's earlier work (to stage it), which would stall the host
behind a running graph. The allocator keeps a block until the copy that read it has completed, so a
buffer is never overwritten in flight.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

_ALIGN = 16


def to_device(arrays: Sequence[np.ndarray], device: torch.device | str) -> list[torch.Tensor]:
    """Each array as a tensor on `device` (same dtype and shape), through one host-to-device copy."""
    device = torch.device(device)
    offsets, total = [], 0
    for array in arrays:
        offsets.append(total)
        total += -(-array.nbytes // _ALIGN) * _ALIGN
    staging = torch.empty(max(total, _ALIGN), dtype=torch.uint8, pin_memory=device.type == "cuda")
    packed = staging.numpy()
    for array, offset in zip(arrays, offsets, strict=True):
        packed[offset : offset + array.nbytes] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    on_device = staging.to(device, non_blocking=True)
    return [
        on_device[offset : offset + array.nbytes].view(_TORCH_DTYPES[array.dtype]).view(array.shape)
        for array, offset in zip(arrays, offsets, strict=True)
    ]


_TORCH_DTYPES = {
    np.dtype(np.int64): torch.int64,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.float32): torch.float32,
}


class ToHost:
    """A device tensor's values on their way to the host: the copy into page-locked memory is queued now,
    right behind the work that produces them, and waited for only when first read. Work queued after
    the copy (a draft forward) does not delay the read. On the CPU, a copy of the values."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._done: torch.cuda.Event | None = None
        if tensor.is_cuda:
            self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._host.copy_(tensor, non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record()
        else:
            self._host = tensor.clone()
        self._values: list | None = None

    def tolist(self) -> list:
        if self._values is None:
            if self._done is not None:
                self._done.synchronize()
            self._values = self._host.tolist()
        return self._values
