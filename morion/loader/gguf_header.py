"""The header of a GGUF file (metadata and tensor table), read with `struct` over a memory map.

gguf's `GGUFReader` makes numpy views of every metadata element: 8.6 s for SmolLM2's 49K-token vocabulary
and merges on the 2-core CPU, paid once by each server process, and its memmap views made dequantizing
the weights slower still. This reads the same header in a fraction of a second; the `gguf` package still
names the value and quantization types and dequantizes the tensor data.

Layout (GGUF v2 and v3, little-endian): magic, version (u32), tensor count and metadata count (u64), the
metadata as key (string), value type (u32), value; then per tensor its name, dimension count (u32),
dimensions (u64, fastest first), quantization type (u32) and offset (u64) from the start of the data,
which begins at the next multiple of `general.alignment` (32) after the header. Strings are a u64 byte
count and UTF-8 bytes; arrays an item type (u32), a count (u64) and the items.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

_SCALARS: dict[GGUFValueType, struct.Struct] = {
    GGUFValueType.UINT8: struct.Struct("<B"),
    GGUFValueType.INT8: struct.Struct("<b"),
    GGUFValueType.UINT16: struct.Struct("<H"),
    GGUFValueType.INT16: struct.Struct("<h"),
    GGUFValueType.UINT32: struct.Struct("<I"),
    GGUFValueType.INT32: struct.Struct("<i"),
    GGUFValueType.FLOAT32: struct.Struct("<f"),
    GGUFValueType.BOOL: struct.Struct("<?"),
    GGUFValueType.UINT64: struct.Struct("<Q"),
    GGUFValueType.INT64: struct.Struct("<q"),
    GGUFValueType.FLOAT64: struct.Struct("<d"),
}
_NUMPY_ITEMS = {kind: np.dtype(layout.format) for kind, layout in _SCALARS.items()}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
# Types stored element by element; every other type is blocks of bytes that gguf dequantizes.
_ELEMENT_TYPES = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


class GGUFTensor(NamedTuple):
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: fastest-varying dimension first
    data: np.ndarray  # a view of the file: elements, or for block types bytes shaped [..., row bytes]


class GGUFHeader(NamedTuple):
    version: int
    metadata: dict[str, Any]
    tensors: list[GGUFTensor]


def read_gguf_header(path: Path) -> GGUFHeader:
    """Raises ValueError (or struct.error on a truncated file) for anything that is not a GGUF we read.

    The tensors' data are views of a read-only memory map of the file, which stays open while they live.
    """
    with path.open("rb") as file:
        mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    return _HeaderParser(mapped).parse()


class _HeaderParser:
    def __init__(self, buffer: mmap.mmap) -> None:
        self._buffer = buffer
        self._offset = 0

    def parse(self) -> GGUFHeader:
        if self._read(_U32) != GGUF_MAGIC:
            raise ValueError("GGUF magic invalid")
        version = self._read(_U32)
        if version not in SUPPORTED_VERSIONS:
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            if swapped in SUPPORTED_VERSIONS:
                raise ValueError("big-endian GGUF files are not supported")
            raise ValueError(f"GGUF version {version} is not supported (supported: 2, 3)")
        tensor_count, metadata_count = self._read(_U64), self._read(_U64)
        metadata = {}
        for _ in range(metadata_count):
            key = self._string()
            if key in metadata:
                raise ValueError(f"duplicate metadata key {key!r}")
            metadata[key] = self._value(GGUFValueType(self._read(_U32)))
        table = [self._tensor_info() for _ in range(tensor_count)]
        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment must be a power of two, got {alignment!r}")
        data_start = -(-self._offset // alignment) * alignment
        tensors = [self._tensor(data_start, *info) for info in table]
        if len({tensor.name for tensor in tensors}) != len(tensors):
            raise ValueError("duplicate tensor names")
        return GGUFHeader(version, metadata, tensors)

    def _read(self, layout: struct.Struct) -> Any:
        (value,) = layout.unpack_from(self._buffer, self._offset)
        self._offset += layout.size
        return value

    def _string(self) -> str:
        return self._strings(1)[0]

    def _strings(self, count: int) -> list[str]:
        """`count` strings in a row: a vocabulary or merge list (~100,000 for SmolLM2, read at every start in
        both of the server's processes), so the loop keeps everything in locals: 3x faster than reading
        them one at a time."""
        buffer, offset, size = self._buffer, self._offset, len(self._buffer)
        unpack_length = _U64.unpack_from
        strings: list[str] = []
        append = strings.append
        for _ in range(count):
            (length,) = unpack_length(buffer, offset)
            start = offset + 8
            offset = start + length
            if offset > size:
                raise ValueError(f"a string of {length} bytes runs past the end of the file")
            append(buffer[start:offset].decode("utf-8"))
        self._offset = offset
        return strings

    def _value(self, kind: GGUFValueType) -> Any:
        layout = _SCALARS.get(kind)
        if layout is not None:
            return self._read(layout)
        if kind == GGUFValueType.STRING:
            return self._string()
        if kind != GGUFValueType.ARRAY:
            raise ValueError(f"unknown metadata value type {kind}")
        item_kind, count = GGUFValueType(self._read(_U32)), self._read(_U64)
        if item_kind == GGUFValueType.STRING:
            return self._strings(count)
        item_dtype = _NUMPY_ITEMS.get(item_kind)
        if item_dtype is None:  # nested arrays: item by item
            return [self._value(item_kind) for _ in range(count)]
        items = np.frombuffer(self._buffer, item_dtype, count, self._offset)
        self._offset += items.nbytes
        return items.tolist()

    def _tensor_info(self) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        name = self._string()
        dimensions = self._read(_U32)
        shape = tuple(self._read(_U64) for _ in range(dimensions))
        return name, shape, GGMLQuantizationType(self._read(_U32)), self._read(_U64)

    def _tensor(
        self, data_start: int, name: str, shape: tuple[int, ...], kind: GGMLQuantizationType, offset: int
    ) -> GGUFTensor:
        elements = int(np.prod(shape, dtype=np.int64))
        block_size, block_bytes = GGML_QUANT_SIZES[kind]
        numpy_shape = tuple(reversed(shape))
        element_type = _ELEMENT_TYPES.get(kind)
        if element_type is not None:
            data = np.frombuffer(self._buffer, element_type, elements, data_start + offset)
        else:
            count = elements // block_size * block_bytes
            data = np.frombuffer(self._buffer, np.uint8, count, data_start + offset)
            numpy_shape = quant_shape_to_byte_shape(numpy_shape, kind)
        return GGUFTensor(name, kind, shape, data.reshape(numpy_shape))
