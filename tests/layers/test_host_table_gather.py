"""HostRowTable.gather: the rows of a sharded host table, in the asked order, whatever shards they fall in."""

from __future__ import annotations

import pytest
import torch

from morion.layers.host_table import HostRowTable, shard_name


def _table(dtype: torch.dtype, num_rows: int = 1000, parts: int = 7) -> tuple[HostRowTable, torch.Tensor]:
    table = HostRowTable(num_rows=num_rows, dim=6, parts=parts)
    table.place("ram", pin_memory=False, model_dtype=torch.bfloat16)
    whole = torch.randn(num_rows, 6, generator=torch.Generator().manual_seed(3)).to(dtype)
    for index, shard in enumerate(whole.split(table.shard_rows)):
        table.load(shard_name(index), shard.clone())
    if dtype == torch.float8_e4m3fn:
        table.load("weight_scale", torch.tensor([0.25]))
    return table, whole


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16])
def test_rows_come_back_in_the_asked_order_across_shards(dtype):
    table, whole = _table(dtype)
    assert table.num_shards == 7
    # Unsorted, repeated, the first and last rows, every shard, and a shard's bounds on both sides.
    edge = table.shard_rows
    rows = torch.tensor([999, 0, edge, edge - 1, 5, 5, 3 * edge + 1, 998, 0, 2 * edge], dtype=torch.int64)
    rows = torch.cat([rows, torch.randint(0, 1000, (500,), generator=torch.Generator().manual_seed(4))])
    gathered = table.gather(rows)
    assert gathered.dtype == dtype and gathered.shape == (rows.shape[0], 6)
    assert torch.equal(gathered.view(torch.uint8), whole[rows].view(torch.uint8))


def test_rows_of_one_shard_and_no_rows():
    table, whole = _table(torch.bfloat16)
    rows = torch.tensor([3, 1, 2], dtype=torch.int64)
    assert torch.equal(table.gather(rows), whole[rows])
    assert table.gather(torch.empty(0, dtype=torch.int64)).shape == (0, 6)
