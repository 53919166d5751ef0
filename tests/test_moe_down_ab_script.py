"""scripts/moe_down_ab.py's mechanics on the CPU (Triton's interpreter; CUDA graphs are the GPU's, so the
timing is a stand-in): every down tile it times, the new one-pass and narrow GEMV tiles among them, must
agree with the default tiles' output, or the sweep refuses it."""

from __future__ import annotations

import torch

from morion.ops import moe_tune
from morion.ops.moe_tiles import ExpertShape, Tiles
from tests.scripts import load_script


def test_every_down_tile_agrees_with_the_default_tiles(monkeypatch, capsys):
    module = load_script("moe_down_ab")
    timed = []
    monkeypatch.setattr(moe_tune, "ROUTINGS", 1)
    monkeypatch.setattr(
        moe_tune,
        "time_in_graph",
        lambda fn, experts, batch, **options: timed.append(options["down_tiles"]) or 1.0,
    )
    shape = ExpertShape(9, 64, 64, "fp8")  # 8 routed experts and a stacked shared one
    best, times = module.down_ab([1, 4], torch.device("cpu"), shape, 3, Tiles(32, 32, 4, 3, "dot"))
    assert times == {1: 1.0, 4: 1.0} and best == module.SHIPPED_DOWN[0]
    lines = capsys.readouterr().err.splitlines()
    assert not [line for line in lines if "refused" in line or "skipped" in line]
    one_pass = {(t.block_n, t.num_warps) for t in timed if t.block_k == 64 and t.num_stages == 1}
    assert one_pass == {(n, w) for n in (16, 32, 64) for w in (2, 4, 8)}
    assert {t.block_n for t in timed if t.mma == "gemv" and t.num_stages > 1} == {16, 64, 128}
