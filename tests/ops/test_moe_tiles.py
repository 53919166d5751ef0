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


def test_a_grouped_entry_is_read_beside_the_decode_tiles_and_alone(tmp_path, monkeypatch):
    """ops/moe_tune_grouped.py's entry: its rows, promotion and tiles, and `faster` only where it beat
    torch's grouped GEMMs at every token count timed; a file holding it alone has no decode tiles."""
    monkeypatch.setattr(moe_tiles, "CONFIG_DIR", tmp_path)
    entry = {
        "block_m": 32,
        "promote_k": 128,
        "gate_up": [128, 128, 8, 3],
        "down": [128, 64, 4, 4],
        "us_per_call": {"1024": 500.0, "4096": 1100.0},
        "torch_us_per_call": {"1024": 950.0, "4096": 1050.0},
    }
    decode = {"gate_up": [16, 256, 4, 3], "down": [64, 128, 4, 2]}
    both, alone, faster = (ExpertShape(e, 64, 32, "fp8") for e in (8, 9, 10))
    moe_tiles.config_path("Some GPU", both).write_text(json.dumps({**decode, "grouped": entry}))
    moe_tiles.config_path("Some GPU", alone).write_text(json.dumps({"grouped": entry}))
    quicker = {**entry, "us_per_call": {"1024": 500.0, "4096": 1000.0}}
    moe_tiles.config_path("Some GPU", faster).write_text(json.dumps({"grouped": quicker}))
    for cached in (moe_tiles.tuned_tiles, moe_tiles.tuned_grouped_tiles):
        cached.cache_clear()
    try:
        grouped = moe_tiles.tuned_grouped_tiles("Some GPU", both)
        assert grouped == moe_tiles.GroupedTiles(32, 128, Tiles(128, 128, 8, 3), Tiles(128, 64, 4, 4), False)
        assert moe_tiles.tuned_tiles("Some GPU", both) == (Tiles(16, 256, 4, 3), Tiles(64, 128, 4, 2))
        assert moe_tiles.tuned_tiles("Some GPU", alone) is None
        assert moe_tiles.tuned_grouped_tiles("Some GPU", alone) == grouped
        assert moe_tiles.tuned_grouped_tiles("Some GPU", faster).faster
        assert moe_tiles.tuned_grouped_tiles("Other GPU", both) is None
    finally:
        for cached in (moe_tiles.tuned_tiles, moe_tiles.tuned_grouped_tiles):
            cached.cache_clear()
