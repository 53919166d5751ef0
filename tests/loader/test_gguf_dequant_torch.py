"""The torch dequantizers of Q8_0, Q4_0 and Q4_1 against the `gguf` package's numpy code, bit for bit, on
blocks of every byte pattern that matters (random codes, scales of both signs, subnormal and zero)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from morion.loader.gguf_dequant_torch import dequantize_torch
from morion.loader.gguf_header import GGUFTensor

KINDS = [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1]


def _random_blocks(kind: GGMLQuantizationType, rows: int, columns: int) -> np.ndarray:
    """[rows, columns / 32 * block bytes] of random bytes whose fp16 fields are finite scales."""
    _, block_bytes = GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(int(kind))
    blocks = rng.integers(0, 256, size=(rows * columns // 32, block_bytes), dtype=np.uint8)
    scales = 2 if kind != GGMLQuantizationType.Q4_1 else 4  # d, and m for Q4_1
    halves = rng.standard_normal((blocks.shape[0], scales // 2)).astype(np.float16)
    halves[:3] = np.array([0.0, -0.0, 6e-8], dtype=np.float16)[:, None]  # zero, negative zero, subnormal
    blocks[:, :scales] = halves.view(np.uint8)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("chunk_blocks", [1 << 17, 5], ids=["one-pass", "chunked"])
@pytest.mark.parametrize("kind", KINDS, ids=lambda kind: kind.name)
def test_matches_the_gguf_package_bit_for_bit(kind, chunk_blocks, monkeypatch):
    monkeypatch.setattr("morion.loader.gguf_dequant_torch._CHUNK_BLOCKS", chunk_blocks)
    rows, columns = 48, 256
    data = _random_blocks(kind, rows, columns)
    tensor = GGUFTensor("blk.0.ffn_up.weight", kind, (columns, rows), data)  # GGUF order: fastest first
    ours = dequantize_torch(tensor)
    theirs = quants.dequantize(data, kind).reshape(rows, columns)
    assert ours is not None and ours.shape == (rows, columns)
    assert np.array_equal(ours.numpy().view(np.uint32), theirs.astype(np.float32).view(np.uint32))


def test_other_types_are_left_to_the_gguf_package():
    data = np.zeros((2, 4), dtype=np.float32)
    assert dequantize_torch(GGUFTensor("output_norm.weight", GGMLQuantizationType.F32, (4, 2), data)) is None
