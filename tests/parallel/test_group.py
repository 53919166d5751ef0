"""The tensor-parallel group at one rank: no process group, the collectives are the identity. Two ranks over
gloo, in real processes, are tested with the model they split (tests/models/test_qwen3_next_tp.py)."""

from __future__ import annotations

import torch

from morion.parallel.group import TensorParallel


def test_one_rank_needs_no_process_group():
    group = TensorParallel()
    x = torch.ones(2)
    assert group.all_reduce_(x) is x and group.gather_last_dim(x) is x
