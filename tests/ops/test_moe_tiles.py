"""The fused MoE kernels' tuned-tile files (ops/moe_tiles.py): named by device and expert shape, read
into tiles, absent for shapes nobody tuned."""

from __future__ import annotations

import json

import torch

from morion.ops import moe_tiles
from morion.ops.moe_tiles import ExpertShape, Tiles


def test_the_file_is_named_by_device_and_shape():
    shape = ExpertShape(512, 2048, 512, "fp8")
    path = moe_tiles.config_path("NVIDIA H200", shape)
    assert path.parent == moe_tiles.CONFIG_DIR
    assert path.name == "NVIDIA_H200_E512_H2048_I512_fp8.json"


def test_the_shape_of_stacked_experts():
    gate_up = torch.empty(8, 2 * 32, 64, dtype=torch.float8_e4m3fn)
    down = torch.empty(8, 64, 32, dtype=torch.float8_e4m3fn)
    assert moe_tiles.expert_shape(gate_up, down) == ExpertShape(8, 64, 32, "fp8")
    assert moe_tiles.expert_shape(gate_up.bfloat16(), down.bfloat16()).dtype == "bfloat16"


def test_tuned_tiles_are_read_once_and_missing_ones_are_none(tmp_path, monkeypatch):
    monkeypatch.setattr(moe_tiles, "CONFIG_DIR", tmp_path)
    moe_tiles.tuned_tiles.cache_clear()
    shape = ExpertShape(8, 64, 32, "fp8")
    try:
        assert moe_tiles.tuned_tiles("Some GPU", shape) is None
        moe_tiles.tuned_tiles.cache_clear()
        path = moe_tiles.config_path("Some GPU", shape)
        path.write_text(json.dumps({"gate_up": [16, 256, 4, 3], "down": [64, 128, 4, 2]}))
        assert moe_tiles.tuned_tiles("Some GPU", shape) == (Tiles(16, 256, 4, 3), Tiles(64, 128, 4, 2))
        assert moe_tiles.tuned_tiles("Other GPU", shape) is None
    finally:
        moe_tiles.tuned_tiles.cache_clear()


def test_the_80b_experts_with_the_shared_expert_stacked_have_the_tuned_tiles():
    """The 80B preset stacks its shared expert as expert 512 (layers/moe.py): E513 runs the E512 tiles."""
    stacked = moe_tiles.tuned_tiles("NVIDIA H200", ExpertShape(513, 2048, 512, "fp8"))
    assert stacked is not None and stacked == moe_tiles.tuned_tiles(
        "NVIDIA H200", ExpertShape(512, 2048, 512, "fp8")
    )
