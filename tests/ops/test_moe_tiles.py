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


def test_the_presets_experts_with_the_shared_expert_stacked_have_tiles_tuned_as_served():
    """The presets stack their shared expert as expert 512 (layers/moe.py): each E513 shape has an H200
    file of its own, tuned with every token's last slot on that expert (`moe_tune --shared-expert`)."""
    for hidden, inter in ((2048, 512), (2560, 640)):
        shape = ExpertShape(513, hidden, inter, "fp8")
        config = json.loads(moe_tiles.config_path("NVIDIA H200", shape).read_text())
        assert config["shared_expert"] is True and config["top_k"] == 11
        assert moe_tiles.tuned_tiles("NVIDIA H200", shape) == (
            Tiles(*config["gate_up"]),
            Tiles(*config["down"]),
        )
