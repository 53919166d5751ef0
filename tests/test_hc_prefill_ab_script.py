"""scripts/hc_prefill_ab.py's mechanics on the CPU (Triton's interpreter in fp16 at a small shape; CUDA
graphs are the GPU's, so the timing is a stand-in that runs each step once): both mix paths and every
candidate tile agree with the eager mix, and the table names the best tile of each token count."""

from __future__ import annotations

import torch

from tests.scripts import load_script


def test_every_path_and_tile_agrees_with_the_eager_mix(monkeypatch):
    module = load_script("hc_prefill_ab")
    for name, value in (("HIDDEN", 64), ("STREAMS", 4), ("LOWRANK", 24)):
        monkeypatch.setattr(module, name, value)
    timed = iter(range(1, 100))
    monkeypatch.setattr(module, "graph_microseconds", lambda step, calls: (step(), float(next(timed)))[1])
    rows = module.measure([70], torch.device("cpu"), torch.float16)
    assert [row["path"] for row in rows][:2] == ["eager mix", "tiled mix"]
    assert len(rows) == 2 + len(module.CANDIDATES)
    assert all(row["agrees"] for row in rows), rows
    text = module.table(rows, "CPU")
    assert f"T=70: best up half {tuple(module.CANDIDATES[0])}, 3.0 us" in text
