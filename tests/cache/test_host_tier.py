"""Page keys, host object layout and store, and the synchronous copy engine."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from morion.cache import CacheSpec, PagePool, StateComponent, StateSlots, TokenComponent
from morion.cache.copy_engine import SyncCopyEngine
from morion.cache.host_store import HostObjectStore, ObjectLayout
from morion.cache.page_keys import ROOT_KEY, extend_page_keys, page_keys

PS = 4
SPEC = CacheSpec(
    PS,
    (TokenComponent("kv", 2, (2, 1, 3), torch.float32), TokenComponent("idx", 3, (5,), torch.bfloat16)),
    (StateComponent("conv", 2, (3, 2), torch.bfloat16), StateComponent("ssm", 2, (2, 2), torch.float32)),
)


def test_page_keys_chain_over_the_whole_prefix() -> None:
    tokens = list(range(10))
    keys = page_keys(tokens, PS)
    assert len(keys) == 2  # the partial last page has no key
    first = hashlib.sha256(ROOT_KEY + np.arange(4, dtype="<u4").tobytes()).digest()
    assert keys[0] == first
    assert keys[1] == hashlib.sha256(first + np.arange(4, 8, dtype="<u4").tobytes()).digest()
    # The same page after another prefix has another key; extending is the same as computing at once.
    assert page_keys([9, *tokens[1:8]], PS)[1] != keys[1]
    partial = page_keys(tokens, PS)[:1]
    assert extend_page_keys(partial, tokens, PS, 2) == keys
    with pytest.raises(ValueError):
        extend_page_keys([], tokens, PS, 3)


def test_object_layout_aligns_every_part() -> None:
    layout = ObjectLayout.for_pages(SPEC)
    # kv: 2 layers x 4 tokens x 6 fp32 = 192 bytes; idx: 3 x 4 x 5 bf16 = 120 bytes, padded to 128.
    assert layout.offsets == {"kv": 0, "idx": 192} and layout.row_bytes == 320
    rows = torch.zeros((3, layout.row_bytes), dtype=torch.uint8)
    views = layout.views(rows)
    assert views["kv"].shape == (3, 2, PS, 2, 1, 3) and views["idx"].dtype == torch.bfloat16
    views["idx"][1].fill_(1.5)
    assert rows[0].sum() == 0 and rows[2].sum() == 0
    assert all(offset % 64 == 0 for offset in layout.offsets.values()) and layout.row_bytes % 64 == 0


def test_host_store_evicts_lru_and_never_a_pinned_row() -> None:
    store = HostObjectStore(ObjectLayout.for_snapshots(SPEC), 2)
    a = store.reserve(b"a")
    a.ready = True
    store.unpin(b"a")
    store.reserve(b"b")  # stays pinned
    assert store.reserve(b"c").row == a.row and b"a" not in store and store.num_evicted == 1
    store.unpin(b"c")
    store.touch(b"c")
    assert store.reserve(b"d") is not None and b"c" not in store  # b is pinned: c was the only choice
    assert store.reserve(b"e") is None  # everything pinned
    store.unpin(b"b")
    store.drop(b"b")
    assert b"b" not in store and store.num_used == 1
    store.check_integrity()
    with pytest.raises(KeyError):
        store.reserve(b"d")


def test_sync_copy_engine_round_trips_pages_and_state() -> None:
    pool = PagePool(SPEC, 6)
    slots = StateSlots(SPEC, 4)
    for component in (*SPEC.token_components, *SPEC.state_components):
        storage = (
            pool.storage(component.name)
            if component in SPEC.token_components
            else slots.storage(component.name)
        )
        storage.copy_(torch.randn(storage.shape).to(storage.dtype))
    pages = pool.alloc(3)
    source = slots.alloc()
    host = HostObjectStore(ObjectLayout.for_pages(SPEC), 8)
    snapshots = HostObjectStore(ObjectLayout.for_snapshots(SPEC), 2)
    rows = [5, 1, 6]
    engine = SyncCopyEngine()
    assert engine.backup(pool, pages, host, rows, slots, source, snapshots, 1).done()
    fresh = pool.alloc(3)
    targets = [slots.alloc(), slots.alloc()]
    engine.restore(host, rows, pool, fresh, snapshots, 1, slots, targets)
    for c in SPEC.token_components:
        storage = pool.storage(c.name)
        src, dst = pool.token_slots(pages, 3 * PS), pool.token_slots(fresh, 3 * PS)
        assert torch.equal(storage[:, src], storage[:, dst])
    for c in SPEC.state_components:
        storage = slots.storage(c.name)
        for target in targets:
            assert torch.equal(storage[:, source], storage[:, target])
