"""The hyper-connection mix's tuned tiles (ops/hc_tiles.py) and their tuner (ops/hc_tune.py): the file a
tuner writes is the file the kernels read, a shape without one runs the defaults, and the tuner refuses a
candidate whose mix is not the default tiles' up to the summation order. Timing needs a GPU."""

from __future__ import annotations

import json

import pytest
import torch

from morion.ops import hc_tiles, hc_tune
from morion.ops.hc_tiles import DEFAULT_MIX_TILES, MixShape, MixTiles, config_path, mix_shape, tuned_mix_tiles

FLASH_NEXT = MixShape(2560, 320, 4, "bfloat16")


@pytest.fixture
def config_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(hc_tiles, "CONFIG_DIR", tmp_path)
    tuned_mix_tiles.cache_clear()
    yield tmp_path
    tuned_mix_tiles.cache_clear()


def test_the_shape_of_a_mix_names_its_file():
    down = torch.empty(320, 4 * 2560, dtype=torch.bfloat16, device="meta")
    assert mix_shape(down, 4) == FLASH_NEXT
    assert config_path("NVIDIA H200", FLASH_NEXT).name == "NVIDIA_H200_H2560_R320_N4_bfloat16.json"


def test_a_tuned_file_gives_its_tiles_and_a_missing_one_the_defaults(config_dir):
    assert tuned_mix_tiles("NVIDIA H200", FLASH_NEXT) == DEFAULT_MIX_TILES
    tuned = MixTiles(2, 2048, 8, 4, 128, 4)
    # What hc_tune.main writes (its other keys are provenance).
    config = {"device": "NVIDIA H200", **FLASH_NEXT._asdict(), "tiles": tuned._asdict(), "us_per_call": {}}
    config_path("NVIDIA H200", FLASH_NEXT, config_dir).write_text(json.dumps(config))
    tuned_mix_tiles.cache_clear()
    assert tuned_mix_tiles("NVIDIA H200", FLASH_NEXT) == tuned
    assert tuned_mix_tiles("NVIDIA H100", FLASH_NEXT) == DEFAULT_MIX_TILES


def test_the_candidates_hold_the_defaults_and_fit_the_registers():
    d = DEFAULT_MIX_TILES
    assert (d.down_block_n, d.down_block_k, d.down_warps, d.down_stages) in hc_tune.DOWN_CANDIDATES
    assert (d.up_block_c, d.up_block_r, d.up_warps, d.up_stages) in hc_tune.UP_CANDIDATES
    # [4 tokens, rows, step] fp32 accumulators (kernel 2: rows of the 4 streams), 128 values a thread.
    assert all(4 * n * k <= 128 * 32 * w for n, k, w, _ in hc_tune.DOWN_CANDIDATES)
    assert all(4 * 4 * c * r <= 128 * 32 * w for c, r, w, _ in hc_tune.UP_CANDIDATES)
    # Pipelined variants of each kernel, and the plain loop.
    for candidates in (hc_tune.DOWN_CANDIDATES, hc_tune.UP_CANDIDATES):
        assert {stages for *_, stages in candidates} >= {1, 3, 6}


def test_a_file_from_before_the_pipelined_tiles_runs_plain_loops(config_dir):
    """Files written before MixTiles had stages name six tiles: the loops they timed, unpipelined."""
    old = dict(zip(MixTiles._fields[:6], (4, 512, 4, 4, 64, 4), strict=True))
    config = {"device": "NVIDIA H200", **FLASH_NEXT._asdict(), "tiles": old}
    config_path("NVIDIA H200", FLASH_NEXT, config_dir).write_text(json.dumps(config))
    assert tuned_mix_tiles("NVIDIA H200", FLASH_NEXT) == MixTiles(4, 512, 4, 4, 64, 4, 1, 1)


def test_the_tuner_refuses_tiles_whose_mix_differs():
    shape = MixShape(64, 24, 4, "float32")
    mixes = hc_tune.random_mixes(shape, torch.device("cpu"))[:1]
    streams = torch.randn(2, 4 * 64)
    reference = hc_tune.run_mixes(shape, mixes, streams, DEFAULT_MIX_TILES)
    wrong = [(mixed + 0.1, weights) for mixed, weights in reference]
    with pytest.raises(hc_tune.Disagrees, match=r"max difference 0\.1"):
        hc_tune.time_tiles(shape, mixes, {2: streams}, {2: wrong}, MixTiles(2, 32, 4, 4, 8, 4))


def test_the_tuner_needs_a_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    with pytest.raises(SystemExit):
        hc_tune.main(["--hidden", "2560", "--lowrank", "320", "--streams", "4"])
    assert "tuning needs a CUDA device" in capsys.readouterr().err
