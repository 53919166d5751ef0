"""The tensor-parallel collectives over gloo, in two real processes on the CPU."""

from __future__ import annotations

import socket

import torch
import torch.multiprocessing as mp

from morion.parallel.group import TensorParallel

SIZE = 2


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _rank(rank: int, port: int, results: dict) -> None:
    group = TensorParallel.join(rank, SIZE, torch.device("cpu"), f"tcp://127.0.0.1:{port}")
    try:
        partial = torch.full((2, 3), float(rank + 1))
        summed = group.all_reduce_(partial)
        logits = torch.arange(4, dtype=torch.float32).reshape(1, 4) + 10 * rank
        results[rank] = (summed is partial, summed.tolist(), group.gather_last_dim(logits).tolist())
    finally:
        group.leave()


def test_two_ranks_sum_partials_and_gather_logits_in_rank_order():
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(_free_port(), results), nprocs=SIZE, join=True)
        results = dict(results)
    for rank in range(SIZE):
        in_place, summed, gathered = results[rank]
        assert in_place and summed == [[3.0] * 3] * 2
        assert gathered == [[0.0, 1.0, 2.0, 3.0, 10.0, 11.0, 12.0, 13.0]]


def test_one_rank_needs_no_process_group():
    group = TensorParallel()
    x = torch.ones(2)
    assert group.all_reduce_(x) is x and group.gather_last_dim(x) is x
