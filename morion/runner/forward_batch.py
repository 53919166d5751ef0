"""One forward as the model sees it: a flat token batch and its paging metadata as device tensors (the
backend that gives the layers the engine's memory is `runner/backend.py`)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from morion.runner.host_to_device import to_device


class ForwardBatch(NamedTuple):
    """Host lists describe the batch for Python code; the tensors (on the model's device) are what kernels
    read. Sequence b owns the flat rows cu_seqlens_q[b]:cu_seqlens_q[b+1]; its keys are seq_lens[b]
    positions (this step's tokens included) whose pages are page_table[b, :ceil(seq_lens[b] / page)]."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_slots: torch.Tensor  # [T] int64: flat pool token slot of each new token's K/V
    page_table: torch.Tensor  # [B, max pages] int32
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    state_indices: torch.Tensor | None  # [B] int32 working state slot of each sequence (models with state)
    max_query_len: int
    query_ranges: list[tuple[int, int]]  # (start, length) of each sequence in the flat batch
    last_rows: list[int]  # per sequence: flat row of its last token (where logits come from)
    # The host arrays the tensors were copied from (build_forward_batch's): what rank 0 of a tensor-parallel
    # engine sends its followers, which rebuild the same batch on their devices (`batch_from_host`).
    host: tuple[np.ndarray, ...] = ()

    @property
    def decode_only(self) -> bool:
        return self.max_query_len == 1


def build_forward_batch(
    chunks: Sequence[tuple[Sequence[int], Sequence[int], int, int]],
    state_slots: Sequence[int | None],
    page_size: int,
    device: torch.device,
) -> ForwardBatch:
    """chunks: per sequence (token_ids, pages, start, num_tokens): run token_ids[start:start+num_tokens];
    state_slots: per sequence its working state slot, or None for models without state. The metadata is
    assembled in numpy and reaches the device in one copy (runner/host_to_device.py)."""
    input_ids: list[np.ndarray] = []
    positions: list[np.ndarray] = []
    out_slots: list[np.ndarray] = []
    used_pages: list[Sequence[int]] = []
    for token_ids, pages, start, num_tokens in chunks:
        end = start + num_tokens
        used = pages[: -(-end // page_size)]
        new_positions = np.arange(start, end, dtype=np.int64)
        page_of_token = np.asarray(used, dtype=np.int64)[new_positions // page_size]
        input_ids.append(np.asarray(token_ids[start:end], dtype=np.int64))
        positions.append(new_positions)
        out_slots.append(page_of_token * page_size + new_positions % page_size)
        used_pages.append(used)
    lengths = [num_tokens for _, _, _, num_tokens in chunks]
    host = [
        np.concatenate(input_ids),
        np.concatenate(positions),
        np.concatenate(out_slots),
        page_table_array(used_pages),
        np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32),
        np.asarray([start + length for (_, _, start, length) in chunks], dtype=np.int32),
    ]
    if None not in state_slots:
        host.append(np.asarray(state_slots, dtype=np.int32))
    return batch_from_host(tuple(host), device)


def batch_from_host(host: tuple[np.ndarray, ...], device: torch.device) -> ForwardBatch:
    """The batch of `build_forward_batch`'s host arrays on `device`: token ids, positions, out slots, page
    table, cu_seqlens, seq_lens [, state slots]."""
    tensors = to_device(host, device)
    cu_seqlens = host[4]
    query_ranges = [(int(start), int(end - start)) for start, end in itertools.pairwise(cu_seqlens)]
    return ForwardBatch(
        input_ids=tensors[0],
        positions=tensors[1],
        out_slots=tensors[2],
        page_table=tensors[3],
        cu_seqlens_q=tensors[4],
        seq_lens=tensors[5],
        state_indices=tensors[6] if len(tensors) > 6 else None,
        max_query_len=max(length for _, length in query_ranges),
        query_ranges=query_ranges,
        last_rows=[start + length - 1 for start, length in query_ranges],
        host=host,
    )


def page_table_array(pages: Sequence[Sequence[int]]) -> np.ndarray:
    """[B, max pages] int32: row b lists sequence b's pages, zero-padded."""
    table = np.zeros((len(pages), max(len(p) for p in pages)), dtype=np.int32)
    for row, used in enumerate(pages):
        table[row, : len(used)] = used
    return table
