import json

import torch

from morion.ops.moe_decode_triton import exact_mma
from morion.ops.moe_tiles import ExpertShape, Tiles
from morion.ops.moe_tune import GATE_UP_CANDIDATES, launch_variants, random_batch, split_variants, write_tuned


def test_launch_variants_keep_the_block_shape_and_start_with_the_chosen_tile():
    chosen = Tiles(32, 256, 4, 3, "gemv")
    variants = launch_variants(chosen)
    assert variants[0] == chosen and len(variants) == len(set(variants)) == 12
    assert {(v.block_n, v.block_k, v.mma) for v in variants} == {(32, 256, "gemv")}
    assert {v.num_warps for v in variants} == {2, 4, 8} and {v.num_stages for v in variants} == {2, 3, 4, 5}


def test_split_variants_split_only_the_k_tiles_there_are_and_leave_nvfp4_to_its_first_round():
    """Gate_up at H = 2048 in 128-column tiles (16 K tiles): 2, 4 and 8 slices at 2 and 4 warps; the 80B's
    down at I = 512 in 256-column tiles: 2 slices only; a one-pass down tile (BLOCK_K = I): none."""
    variants = split_variants(Tiles(32, 128, 4, 5, "dot"), 2048, "fp8")
    assert {(v.split_k, v.num_warps) for v in variants} == {(s, w) for s in (2, 4, 8) for w in (2, 4)}
    assert {(v.block_n, v.block_k, v.num_stages, v.mma) for v in variants} == {(32, 128, 5, "dot")}
    assert {v.split_k for v in split_variants(Tiles(64, 256, 4, 3, "gemv"), 512, "bfloat16")} == {2}
    assert split_variants(Tiles(64, 512, 4, 1, "gemv"), 512, "fp8") == []
    assert split_variants(Tiles(32, 128, 4, 3, "gemv"), 2048, "nvfp4") == []


def test_fp8_sweeps_leave_out_swapped_operands_only():
    kept = [t for t in GATE_UP_CANDIDATES if exact_mma(t, fp8=True)]
    assert {t.mma for t in kept} == {"dot", "gemv"}
    assert len(kept) == sum(t.mma != "swapped" for t in GATE_UP_CANDIDATES)
    assert all(exact_mma(t, fp8=False) for t in GATE_UP_CANDIDATES)


def test_a_stacked_shared_expert_is_every_tokens_last_slot():
    """`--shared-expert`: as the presets route E = 513, the last expert takes every token's last slot and
    the k - 1 routed slots stay distinct, among the first E - 1; without it all E are routed at random."""
    shape = ExpertShape(9, 16, 16, "bfloat16")
    hidden, weights, ids = random_batch(shape, 6, 3, torch.device("cpu"), seed=0, shared_expert=True)
    assert hidden.shape == (6, 16) and weights.shape == ids.shape == (6, 3)
    assert ids[:, -1].eq(8).all() and ids[:, :-1].lt(8).all()
    assert all(len(set(row)) == 3 for row in ids.tolist())
    assert weights[:, :-1].float().sum(-1).sub(1).abs().max() < 1e-2 and weights[:, -1].gt(0).all()
    _, _, routed = random_batch(shape, 64, 3, torch.device("cpu"), seed=0)
    assert not routed[:, -1].eq(8).all() and routed.eq(8).any()


def test_the_written_line_compares_with_the_shipped_files_tiles(tmp_path):
    """A tuned file replaces the shipped one only where it is faster: the line names both timings, and
    the JSON keeps the shipped tiles and their times beside the chosen ones."""
    config = {
        "gate_up": [32, 256, 4, 3, "dot"],
        "us_per_call": {"1": 20.0, "4": 50.0},
        "default_us_per_call": {"1": 30.0, "4": 70.0},
        "shipped": {"gate_up": [64, 256, 2, 3, "dot"], "down": [128, 128, 2, 2, "gemv"]},
        "shipped_us_per_call": {"1": 25.0, "4": 48.0},
    }
    line = write_tuned(config, tmp_path / "tiles" / "E.json")
    assert line == (
        "T=1 20.0 us (default 30.0, shipped file 25.0), T=4 50.0 us (default 70.0, shipped file 48.0)"
    )
    assert json.loads((tmp_path / "tiles" / "E.json").read_text()) == config
    del config["shipped_us_per_call"]
    line = write_tuned(config, tmp_path / "E.json")
    assert line == "T=1 20.0 us (default 30.0), T=4 50.0 us (default 70.0)"
