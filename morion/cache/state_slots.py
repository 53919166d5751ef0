"""State slots: fixed-size storage for per-request state (conv windows, recurrent states)."""

from __future__ import annotations

from typing import Protocol

import torch

from morion.cache.spec import CacheSpec


class DeviceWorkMirror(Protocol):
    """Where rank 0 of a tensor-parallel engine sends the device work its followers repeat on their own
    shards (parallel/step_mirror.py); cache/ only calls it."""

    def send(self, *op: object) -> None: ...

    def agree(self, *op: object, flags: list[bool]) -> list[bool]:
        """Sends `op`, to which every follower answers with its own flags: each flag anded over the ranks."""
        ...


class StateSlots:
    """`num_slots` slots, each holding one request's state of every state component of `spec`.

    Storage of a component is one tensor `[num_layers, num_slots, *shape]`, so a kernel indexes a batch's
    states by slot. A slot is used either as a running request's working state or as a snapshot owned by
    the prefix cache (a state valid at one exact token position); `RadixCache.check_integrity` checks
    that every slot is in exactly one place.
    """

    def __init__(self, spec: CacheSpec, num_slots: int, device: torch.device | str = "cpu") -> None:
        if not spec.has_state:
            raise ValueError("the spec has no state components; a model without state needs no state slots")
        if not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"num_slots must be an int >= 1, got {num_slots!r}")
        self.spec = spec
        self.device = torch.device(device)
        self._num_slots = num_slots
        self._storage = {
            c.name: torch.zeros((c.num_layers, num_slots, *c.shape), dtype=c.dtype, device=self.device)
            for c in spec.state_components
        }
        self._free = list(range(num_slots - 1, -1, -1))  # a stack: slot 0 is handed out first
        self._is_free = bytearray(b"\x01") * num_slots
        # Rank 0 of a tensor-parallel engine: every copy and reset is repeated on each rank's slots.
        self.mirror: DeviceWorkMirror | None = None

    @property
    def num_slots(self) -> int:
        return self._num_slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_bytes(self) -> int:
        """Device bytes held by the storage tensors."""
        return self._num_slots * self.spec.bytes_per_slot

    def storages(self) -> list[torch.Tensor]:
        return list(self._storage.values())

    def storage(self, name: str) -> torch.Tensor:
        """The storage tensor of state component `name`: `[num_layers, num_slots, *shape]`."""
        try:
            return self._storage[name]
        except KeyError:
            raise KeyError(f"no state component {name!r}; the spec has {sorted(self._storage)}") from None

    def alloc(self) -> int | None:
        """Take a free slot, or None when none is free.

        Its contents are whatever the previous owner left: call `zero` for a fresh request, or `copy` a
        snapshot into it.
        """
        if not self._free:
            return None
        slot = self._free.pop()
        self._is_free[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        """Return a slot. Raises ValueError for a slot outside the pool, RuntimeError if it is free."""
        self._check_allocated(slot)
        self._is_free[slot] = 1
        self._free.append(slot)

    def is_free(self, slot: int) -> bool:
        return bool(self._is_free[slot])

    def free_slots(self) -> list[int]:
        """A copy of the free list (for integrity checks and debugging)."""
        return list(self._free)

    def copy(self, src: int, dst: int) -> None:
        """Copy every state component of slot `src` into slot `dst` (taking or restoring a snapshot)."""
        self._check_allocated(src)
        self._check_allocated(dst)
        if self.mirror is not None:
            self.mirror.send("state_copy", src, dst)
        self.copy_storage(src, dst)

    def zero(self, slot: int) -> None:
        """Reset every state component of `slot`: the state before the first token."""
        self._check_allocated(slot)
        if self.mirror is not None:
            self.mirror.send("state_zero", slot)
        self.zero_storage(slot)

    def copy_storage(self, src: int, dst: int) -> None:
        """`copy` without the allocation checks: a follower rank's slots are allocated by rank 0."""
        for tensor in self._storage.values():
            tensor[:, dst].copy_(tensor[:, src])

    def zero_storage(self, slot: int) -> None:
        """`zero` without the allocation checks (a follower rank's)."""
        for tensor in self._storage.values():
            tensor[:, slot].zero_()

    def _check_allocated(self, slot: int) -> None:
        if not 0 <= slot < self._num_slots:
            raise ValueError(f"slot {slot} is not in this pool of {self._num_slots} state slots")
        if self._is_free[slot]:
            raise RuntimeError(f"state slot {slot} is free: it was never allocated or was already freed")
