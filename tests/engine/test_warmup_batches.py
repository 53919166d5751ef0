"""The warm-up's batch shapes (runner/warmup.py): every kind of forward and every MoE pair block a
decode or short forward can take, within the engine's limits."""

from __future__ import annotations

import pytest

from morion.engine.forward_groups import FORWARD_GROUP_MAX_TOKENS
from morion.layers.hybrid_backend import SHORT_CHUNK_TOKENS
from morion.runner.warmup import warmup_batches


def _pair_block(tokens: int, top_k: int) -> int:
    return 1 << (tokens * top_k - 1).bit_length()  # triton.next_power_of_2, as the fused MoE kernels take it


@pytest.mark.parametrize("top_k", [1, 2, 8, 10])
def test_every_moe_pair_block_up_to_the_group_limit_is_warmed(top_k):
    batches = warmup_batches(4096, FORWARD_GROUP_MAX_TOKENS, 16)
    warmed = {_pair_block(sum(lengths), top_k) for lengths in batches} | {_pair_block(1, top_k)}  # graphs
    needed = {_pair_block(tokens, top_k) for tokens in range(1, FORWARD_GROUP_MAX_TOKENS + 1)}
    assert needed <= warmed


def test_long_and_short_forwards_with_one_and_several_sequences():
    batches = warmup_batches(4096, 64, 16)
    short = [b for b in batches if 1 < max(b) <= SHORT_CHUNK_TOKENS]
    long = [b for b in batches if max(b) > SHORT_CHUNK_TOKENS]
    assert any(len(b) == 1 for b in short) and any(len(b) > 1 for b in short)
    assert any(len(b) == 2 and all(n % 16 for n in b) for b in long)  # no page boundary
    assert all(sum(b) <= 4096 and len(b) <= 16 for b in batches)


def test_limits_hold_for_small_engines():
    batches = warmup_batches(8, 64, 2)
    assert batches and all(sum(b) <= 8 and len(b) <= 2 for b in batches)
