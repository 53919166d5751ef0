from __future__ import annotations

import pytest
import torch

from morion.cache.page_pool import PagePool
from morion.cache.spec import CacheSpec, TokenComponent

SPEC = CacheSpec(
    4,
    (
        TokenComponent("kv", 3, (2, 2, 8), torch.bfloat16),
        TokenComponent("index_k", 3, (16,), torch.float32),
    ),
)


def test_storage_layout_and_size() -> None:
    pool = PagePool(SPEC, 10)
    assert pool.storage("kv").shape == (3, 40, 2, 2, 8)
    assert pool.storage("kv").dtype == torch.bfloat16
    assert pool.storage("index_k").shape == (3, 40, 16)
    total = sum(pool.storage(c.name).nbytes for c in SPEC.token_components)
    assert pool.num_bytes == total == 10 * SPEC.bytes_per_page
    assert not pool.storage("kv").any()
    with pytest.raises(KeyError, match="no token component 'v'"):
        pool.storage("v")


def test_alloc_is_all_or_nothing() -> None:
    pool = PagePool(SPEC, 5)
    assert pool.alloc(0) == []
    assert pool.alloc(3) == [0, 1, 2]
    assert pool.num_free == 2
    assert pool.alloc(3) is None
    assert pool.num_free == 2  # a failed alloc takes nothing
    assert pool.alloc(2) == [3, 4]
    assert pool.alloc(1) is None
    with pytest.raises(ValueError):
        pool.alloc(-1)


def test_free_returns_pages_most_recent_first() -> None:
    pool = PagePool(SPEC, 4)
    pages = pool.alloc(4)
    pool.free([pages[2], pages[0]])
    assert pool.num_free == 2
    assert sorted(pool.free_pages()) == [0, 2]
    assert pool.is_free(0) and not pool.is_free(1)
    assert pool.alloc(1) == [0]


def test_double_free_and_unknown_pages_raise_and_free_nothing() -> None:
    pool = PagePool(SPEC, 4)
    pages = pool.alloc(3)
    pool.free([pages[0]])
    with pytest.raises(RuntimeError, match="double free of page 0"):
        pool.free([pages[1], pages[0]])
    with pytest.raises(RuntimeError, match="more than once"):
        pool.free([pages[1], pages[1]])
    with pytest.raises(ValueError, match="page 4 is not in this pool"):
        pool.free([pages[1], 4])
    with pytest.raises(ValueError):
        pool.free([-1])
    assert pool.num_free == 2  # pages[1] was never freed by the failing calls
    pool.free([pages[1], pages[2]])
    assert pool.num_free == 4


def test_token_slots() -> None:
    pool = PagePool(SPEC, 8)
    slots = pool.token_slots([3, 1, 6], 6)
    assert slots.tolist() == [12, 13, 14, 15, 4, 5]
    assert slots.dtype == torch.int64
    assert pool.token_slots([3, 1], 8).tolist() == [12, 13, 14, 15, 4, 5, 6, 7]
    assert pool.token_slots([], 0).tolist() == []
    with pytest.raises(ValueError, match="do not fit"):
        pool.token_slots([3, 1], 9)


def test_token_slots_index_storage_of_every_layer() -> None:
    pool = PagePool(SPEC, 8)
    slots = pool.token_slots([5, 2], 6)
    storage = pool.storage("index_k")
    storage[:, slots] = 1.0
    assert storage[:, 20:24].eq(1).all() and storage[:, 8:10].eq(1).all()
    assert storage.eq(1).sum() == 3 * 6 * 16


def test_num_pages_must_be_positive() -> None:
    with pytest.raises(ValueError, match="num_pages"):
        PagePool(SPEC, 0)
