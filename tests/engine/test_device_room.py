"""What the engine says when state slots or an explicit K/V size do not fit the device: one line naming the
flag and what would fit, instead of CUDA's out-of-memory traceback (the full Flash-Next preset with the
default 64 running requests asks for 27 GiB of state slots where 16 are free). The CUDA branch is reached
through `_device_room`, faked here with the room a GPU would report."""

from __future__ import annotations

import pytest
import torch

from morion.config import EngineConfig
from morion.engine import assembly
from morion.errors import MorionError

MIB = 2**20


def test_state_slots_that_do_not_fit_name_the_flag_and_what_fits():
    config = EngineConfig(max_running_requests=64)
    with pytest.raises(MorionError) as error:
        # 257 slots of 110 MiB (64 requests x 4, one for graphs) in 16 GiB.
        assembly._require_room_for_state_slots(config, 110 * MIB, 257, 4, 16 * 1024 * MIB)
    message = str(error.value)
    assert "--max-running-requests 64 needs 257 state slots of 110.0 MiB (27.61 GiB)" in message
    assert "37 running requests would fill it" in message and "try --max-running-requests 18" in message
    assert "\n" not in message
    explicit = EngineConfig(max_running_requests=64, state_slots=300)
    with pytest.raises(MorionError, match="--state-slots 300 needs 301"):
        assembly._require_room_for_state_slots(explicit, 110 * MIB, 301, 4, 16 * 1024 * MIB)
    assembly._require_room_for_state_slots(config, 110 * MIB, 33, 4, 16 * 1024 * MIB)  # fits: no error


def test_an_explicit_kv_cache_size_that_does_not_fit_says_how_many_tokens_do(monkeypatch):
    config = EngineConfig(kv_cache_tokens=65536, device="cuda")
    monkeypatch.setattr(EngineConfig, "torch_device", property(lambda self: torch.device(self.device)))
    monkeypatch.setattr(assembly, "_device_room", lambda device, reserve: 10 * 1024 * MIB)
    bytes_per_page = 16 * 256 * 1024  # 256 KiB a token
    with pytest.raises(MorionError) as error:
        assembly._num_pages(config, bytes_per_page, 0, 2 * 1024 * MIB, 100 * 1024 * MIB)
    message = str(error.value)
    assert message.startswith("--kv-cache-tokens 65536 needs 16.00 GiB, more than the 10.00 GiB free")
    assert "at most 40960 tokens fit" in message
    fitting = EngineConfig(kv_cache_tokens=40960, device="cuda")
    assert assembly._num_pages(fitting, bytes_per_page, 0, 0, 0) == 40960 // 16


def test_running_requests_are_lowered_until_their_state_slots_take_half_of_what_is_free():
    # Qwen3.8-Flash-Next in FP8 on an H200: 108 MiB slots, 4 a request, one scratch slot, 15.8 GiB free.
    room = int(15.8 * 1024) * MIB
    fits = assembly._running_requests_that_fit(108 * MIB, 4, 1, room)
    assert fits == 18 and (4 * fits + 1) * 108 * MIB <= room * assembly._STATE_SHARE
    assert (4 * (fits + 1) + 1) * 108 * MIB > room * assembly._STATE_SHARE
    assert assembly._running_requests_that_fit(108 * MIB, 4, 1, 300 * MIB) == 0  # then the error above
    assert assembly._running_requests_that_fit(5632, 4, 1, 16 * 1024 * MIB) > 64  # the 80B's: no change
