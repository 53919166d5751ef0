"""Which batch sizes get a decode graph (the capture itself is covered by the gpu tests)."""

from __future__ import annotations

import pytest

from morion.runner.cuda_graph import batch_buckets


@pytest.mark.parametrize("max_batch", [1, 2, 3, 8, 9, 64, 65, 100, 128])
def test_every_batch_size_has_a_bucket_with_little_padding(max_batch):
    buckets = batch_buckets(max_batch)
    assert buckets == sorted(set(buckets)) and buckets[0] == 1 and buckets[-1] == max_batch
    for size in range(1, max_batch + 1):
        bucket = next(b for b in buckets if b >= size)
        # Padding rows cost a whole decode row each: at most 8 below 64, 16 above.
        assert bucket - size < (8 if size <= 64 else 16)


def test_the_usual_buckets():
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
