"""How many prefill rows a QSA static-path tile takes: its scratch within PREFILL_TILE_BYTES, any context."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from morion.layers import qsa_attention
from morion.layers.qsa_attention import PREFILL_TILE_ALIGN, PREFILL_TILE_BYTES, QSAAttention

# Qwen3.8-Flash-Next's full-attention layers: 24 query heads, 2 K/V heads of 256, budget 2,048 at r = 4.
FLASH_NEXT = SimpleNamespace(num_heads=24, num_kv_heads=2, head_dim=256, compress_ratio=4, block_topk=512)
PAGE_SIZE = 16


def _tile_rows(context: int) -> tuple[int, int]:
    """(rows, scratch bytes a row) of a CPU tile (one split) with a page table wide enough for `context`."""
    backend = SimpleNamespace(page_table=torch.zeros(1, context // PAGE_SIZE), page_size=PAGE_SIZE)
    rows = QSAAttention._prefill_tile_rows(FLASH_NEXT, torch.zeros(1), backend)
    blocks = context // FLASH_NEXT.compress_ratio
    row_bytes = 4 * (blocks + 2051 + 1 + 24 * 257)
    return rows, row_bytes


@pytest.mark.parametrize("context", [1024, 32768, 262144])
def test_a_tile_s_scratch_stays_within_the_budget(context):
    rows, row_bytes = _tile_rows(context)
    assert rows % PREFILL_TILE_ALIGN == 0
    assert rows * row_bytes <= PREFILL_TILE_BYTES
    most = qsa_attention.PREFILL_TILE_ROWS[1]
    assert (rows + PREFILL_TILE_ALIGN) * row_bytes > PREFILL_TILE_BYTES or rows == most


def test_short_contexts_take_more_rows_a_tile_and_the_bounds_hold(monkeypatch):
    assert _tile_rows(1024)[0] > _tile_rows(262144)[0]
    monkeypatch.setattr(qsa_attention, "PREFILL_TILE_BYTES", 1)
    assert _tile_rows(1024)[0] == qsa_attention.PREFILL_TILE_ROWS[0]
    monkeypatch.setattr(qsa_attention, "PREFILL_TILE_BYTES", 1 << 50)
    assert _tile_rows(1024)[0] == qsa_attention.PREFILL_TILE_ROWS[1]
