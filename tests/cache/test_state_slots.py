from __future__ import annotations

import pytest
import torch

from morion.cache.spec import CacheSpec, StateComponent, TokenComponent
from morion.cache.state_slots import StateSlots

KV = TokenComponent("kv", 1, (2, 1, 4), torch.float32)
SPEC = CacheSpec(
    4,
    (KV,),
    (StateComponent("conv", 3, (4, 6), torch.bfloat16), StateComponent("ssm", 3, (2, 4, 4), torch.float32)),
)


def test_storage_layout_and_size() -> None:
    slots = StateSlots(SPEC, 5)
    assert slots.storage("conv").shape == (3, 5, 4, 6)
    assert slots.storage("ssm").shape == (3, 5, 2, 4, 4)
    assert slots.storage("ssm").dtype == torch.float32
    assert slots.num_bytes == 5 * SPEC.bytes_per_slot == sum(t.nbytes for t in slots._storage.values())
    with pytest.raises(KeyError, match="no state component"):
        slots.storage("kv")


def test_alloc_and_free() -> None:
    slots = StateSlots(SPEC, 2)
    a, b = slots.alloc(), slots.alloc()
    assert (a, b) == (0, 1)
    assert slots.alloc() is None
    assert slots.num_free == 0
    slots.free(a)
    assert slots.num_free == 1 and slots.is_free(a)
    assert slots.free_slots() == [a]
    with pytest.raises(RuntimeError, match="state slot 0 is free"):
        slots.free(a)
    with pytest.raises(ValueError, match="slot 2 is not in this pool"):
        slots.free(2)
    assert slots.alloc() == a


def test_copy_and_zero_touch_every_component_and_layer() -> None:
    slots = StateSlots(SPEC, 3)
    src, dst, other = slots.alloc(), slots.alloc(), slots.alloc()
    for name in ("conv", "ssm"):
        tensor = slots.storage(name)
        tensor[:, src] = torch.randn(tensor[:, src].shape).to(tensor.dtype)
        tensor[:, other] = 7
    slots.copy(src, dst)
    for name in ("conv", "ssm"):
        tensor = slots.storage(name)
        assert torch.equal(tensor[:, dst], tensor[:, src])
    slots.zero(src)
    for name in ("conv", "ssm"):
        tensor = slots.storage(name)
        assert not tensor[:, src].any()
        assert tensor[:, dst].any()  # the copy is a copy, not a view
        assert tensor[:, other].eq(7).all()


def test_copy_and_zero_need_allocated_slots() -> None:
    slots = StateSlots(SPEC, 3)
    a = slots.alloc()
    with pytest.raises(RuntimeError, match="is free"):
        slots.copy(a, 2)
    with pytest.raises(RuntimeError, match="is free"):
        slots.copy(2, a)
    with pytest.raises(RuntimeError, match="is free"):
        slots.zero(1)


def test_rejects_specs_without_state_and_empty_pools() -> None:
    with pytest.raises(ValueError, match="no state components"):
        StateSlots(CacheSpec(4, (KV,)), 4)
    with pytest.raises(ValueError, match="num_slots"):
        StateSlots(SPEC, 0)
