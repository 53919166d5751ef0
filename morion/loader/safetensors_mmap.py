"""Safetensors tensors as memory maps of their files: nothing is read until a byte is touched.

For tables that stay in host memory without being copied (`--ple-placement mmap`): the OS pages their
rows in on first use and may drop them again under memory pressure (clean file pages). The maps are
copy-on-write (a write changes this process's page, never the file), so a stray in-place op cannot
corrupt a checkpoint, and the files may be read-only.

The format: an 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}},
then the data; offsets are relative to the end of the header.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from morion.errors import ModelLoadError

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def mapped_weights(shards: Sequence[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the safetensors files, each a map of its bytes in the file."""
    for shard in shards:
        with open(shard, "rb") as file:
            (header_size,) = struct.unpack("<Q", file.read(8))
            header = json.loads(file.read(header_size))
        data_start = 8 + header_size
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            dtype = _DTYPES.get(entry["dtype"])
            if dtype is None:
                raise ModelLoadError(f"{shard.name}: tensor {name!r} has unsupported dtype {entry['dtype']}")
            begin, end = entry["data_offsets"]
            yield name, _map(shard, data_start + begin, end - begin, dtype, tuple(entry["shape"]))


def _map(path: Path, offset: int, size: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if size == 0:
        return torch.empty(shape, dtype=dtype)
    data = np.memmap(path, dtype=np.uint8, mode="c", offset=offset, shape=(size,))
    return torch.from_numpy(data).view(dtype).view(shape)
