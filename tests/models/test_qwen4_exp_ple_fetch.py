"""PLE's two device fetches (layers/ple_static.py) agree: a forward of sequences with different numbers of
new tokens (`fetch_prefill`, positions from the batch's layout) gives each sequence the table rows and
n-gram history state that `fetch_static` gives it alone, from histories with EOS, fresh (zeroed) slots,
and runs shorter than the history."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from morion.layers.ple import NGRAM_HISTORY
from morion.layers.ple_static import fetch_prefill, fetch_static, ragged_window_indices
from tests.models.conftest import QWEN4_EXP_EOS, QWEN4_EXP_TINY


class _SlotsBackend:
    """What the fetches read of a forward: its layout, each sequence's state slot, the history pool."""

    def __init__(self, pool: torch.Tensor, slots: list[int], lengths: Sequence[int]) -> None:
        self._pool = pool
        self.state_indices = torch.tensor(slots, dtype=torch.int32)
        starts = [sum(lengths[:n]) for n in range(len(lengths))]
        self.query_ranges = list(zip(starts, lengths, strict=True))
        self.verify_slots = None

    def state_pool(self, component: str, ordinal: int) -> torch.Tensor:
        assert component == NGRAM_HISTORY
        return self._pool


def test_window_indices_place_history_then_tokens():
    # Two sequences, c = 2: history ids at 0-3, the tokens of (start 0, 3) and (start 3, 1) at 4 + start.
    positions = ragged_window_indices([(0, 3), (3, 1)], context_len=2)
    sources, after = positions[: 4 * 3].view(4, 3), positions[4 * 3 :].view(2, 2)
    assert sources.tolist() == [[4, 1, 0], [5, 4, 1], [6, 5, 4], [7, 3, 2]]
    assert after.tolist() == [[5, 6], [3, 7]]  # the last two of each window (history, then tokens)


@pytest.mark.parametrize("lengths", [(5, 1, 17, 2), (1,), (30, 3)])
def test_ragged_fetch_equals_each_sequence_fetched_alone(qwen4_exp_tiny, lengths):
    ple = next(layer.ple for layer in qwen4_exp_tiny.model.model.layers if layer.ple is not None)
    context_len = ple.ple_embedding.hash.ngram_size - 1
    generator = torch.Generator().manual_seed(len(lengths))
    vocab = QWEN4_EXP_TINY["vocab_size"]
    tokens = torch.randint(vocab, (sum(lengths),), generator=generator)
    tokens[torch.rand(tokens.shape, generator=generator) < 0.15] = QWEN4_EXP_EOS
    # Stored histories (id + 1): random, one with an EOS, the first slot fresh (zero: EOS before the start).
    pool = torch.randint(1, vocab + 1, (8, context_len), generator=generator)
    pool[0] = 0
    pool[2, -1] = QWEN4_EXP_EOS + 1
    slots = [0, 2, 5, 7][: len(lengths)]

    together = pool.clone()
    fetched = fetch_prefill(ple, tokens, _SlotsBackend(together, slots, lengths)).wait(torch.float32)
    alone = pool.clone()
    expected = []
    for slot, (start, length) in zip(slots, _SlotsBackend(pool, slots, lengths).query_ranges, strict=True):
        backend = _SlotsBackend(alone, [slot], [length])
        expected.append(fetch_static(ple, tokens[start : start + length], backend).wait(torch.float32))
    assert torch.equal(fetched, torch.cat(expected))
    assert torch.equal(together, alone)
    assert not torch.equal(together, pool)  # the state advanced
