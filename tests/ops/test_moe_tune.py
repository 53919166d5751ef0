import json

import pytest
import torch

from morion.ops.moe_decode_triton import exact_mma
from morion.ops.moe_tiles import ExpertShape, Tiles, config_path
from morion.ops.moe_tune import (
    GATE_UP_CANDIDATES,
    down_candidates,
    launch_variants,
    random_batch,
    split_variants,
    write_tuned,
)
from morion.ops.moe_tune_grouped import record_grouped, summary


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


def test_the_down_sweep_tries_one_pass_and_narrow_gemv_tiles():
    """The 80B's down (I = 512): one-pass tiles (BLOCK_K spans I) as MMA and as 16- to 64-column GEMV
    tiles, and two-pass GEMV tiles down to 16 columns, each listed once, all of them FP8-exact."""
    candidates = down_candidates(512)
    assert len(candidates) == len(set(candidates))
    one_pass = {(t.block_n, t.mma) for t in candidates if t.block_k == 512}
    assert one_pass == {(64, "dot"), (16, "gemv"), (32, "gemv"), (64, "gemv")}
    assert {t.block_n for t in candidates if t.mma == "gemv" and t.block_k < 512} == {16, 32, 64, 128}
    assert all(exact_mma(t, fp8=True) for t in candidates if t.mma != "swapped")
    assert {t.block_k for t in down_candidates(640) if t.num_stages == 1} == {1024}  # Flash-Next's I


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


def test_the_grouped_entry_joins_the_file_and_keeps_its_decode_tiles(tmp_path):
    shape = ExpertShape(513, 2048, 512, "fp8")
    path = config_path("Some GPU", shape, tmp_path)
    path.write_text(json.dumps({"device": "Some GPU", "gate_up": [32, 256, 2, 3], "down": [64, 128, 2, 5]}))
    entry = {
        "block_m": 32,
        "promote_k": 128,
        "us_per_call": {"1024": 510.5},
        "default_us_per_call": {"1024": 2175.0},
        "torch_us_per_call": {"1024": 958.1},
    }
    assert record_grouped(entry, "Some GPU", shape, tmp_path) == path
    config = json.loads(path.read_text())
    assert config["gate_up"] == [32, 256, 2, 3] and config["grouped"] == entry
    fresh = record_grouped(entry, "Other GPU", shape, tmp_path / "new")
    assert json.loads(fresh.read_text()) == {"device": "Other GPU", **shape._asdict(), "grouped": entry}
    assert summary(entry) == "T=1024 510.5 us (defaults 2175.0, torch 958.1)"


def test_the_grouped_sweep_chooses_the_fastest_agreeing_candidate_and_times_torch_beside_it(monkeypatch):
    """`tune_grouped`'s stages with the kernels' outputs and CUDA-graph times replaced by tables (no GPU
    here; the kernels' own tests cover their results): rows and promotion first, then each kernel's tiles
    and launch variants; a cheaper candidate whose output is off the exact sums is refused; the entry
    holds the cheapest agreeing one, the defaults' and torch's times."""
    from morion.ops import moe_tune, moe_tune_grouped

    exact = torch.linspace(1, 2, 40 * 64).view(40, 64)

    def fake_output(fn, experts, hidden, weights, ids, **options) -> torch.Tensor:
        off = options.get("block_m") == 16 and options.get("promote_k") == 128  # the cheapest rows
        return exact * (1 + 4 * moe_tune.AGREEMENT) if off else exact

    def fake_time(fn, experts, batches, **options) -> float:
        if fn is not moe_tune_grouped.moe_experts_triton:
            return 900.0  # torch's grouped GEMMs
        if options["block_m"] == 128:  # compared at 8 warps: 4 would spill its accumulators
            warps_of_128_rows.update((options["gate_up_tiles"].num_warps, options["down_tiles"].num_warps))
        cost = {16: 10.0, 32: 100.0, 64: 200.0, 128: 400.0}[options["block_m"]]
        cost += 50.0 if options["promote_k"] else 80.0
        cost -= options["gate_up_tiles"].block_n / 8 + options["down_tiles"].num_stages
        return cost

    warps_of_128_rows = set()
    for module in (moe_tune, moe_tune_grouped):
        monkeypatch.setattr(module, "time_in_graph", fake_time)
        monkeypatch.setattr(module, "run_experts", fake_output)
    monkeypatch.setattr(moe_tune_grouped, "GATE_UP_CANDIDATES", [Tiles(64, 64, 4, 3), Tiles(128, 64, 4, 3)])
    monkeypatch.setattr(moe_tune_grouped, "DOWN_CANDIDATES", [Tiles(64, 64, 4, 3)])
    monkeypatch.setattr(
        moe_tune_grouped, "launch_variants", lambda tiles: [tiles, tiles._replace(num_stages=4)]
    )
    shape = ExpertShape(8, 64, 64, "fp8")
    entry = moe_tune_grouped.tune_grouped(shape, 2, [40], torch.device("cpu"), shared=False)
    assert (entry["block_m"], entry["promote_k"]) == (16, 0)  # 16 rows at 128 disagreed
    assert Tiles(*entry["gate_up"]) == Tiles(128, 64, 4, 3) and Tiles(*entry["down"]) == Tiles(64, 64, 4, 4)
    assert entry["us_per_call"] == {"40": 10.0 + 80.0 - 16 - 4}
    assert entry["torch_us_per_call"] == {"40": 900.0}
    assert entry["default_us_per_call"] == {"40": 200.0 + 50.0 - 8 - 3}
    assert warps_of_128_rows == {8}


def test_the_grouped_tuner_names_what_it_cannot_run(capsys):
    from morion.ops import moe_tune_grouped

    flags = ["--experts", "8", "--hidden", "64", "--intermediate", "64", "--top-k", "2"]
    with pytest.raises(SystemExit):
        moe_tune_grouped.main([*flags, "--dtype", "float16"])
    assert "invalid choice: 'float16'" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            moe_tune_grouped.main(flags)
        assert "tuning needs a CUDA device" in capsys.readouterr().err


def test_the_nvfp4_grouped_sweep_tries_both_expansions_and_no_promotion(monkeypatch):
    """NVFP4 experts: their own grouped kernels, rows without a promotion interval (they multiply in
    BF16), each tile in both code expansions; no torch times (no torch path to beat)."""
    from morion.ops import moe_tune, moe_tune_grouped

    out = torch.ones(40, 64)
    seen = []

    def fake_output(fn, experts, hidden, weights, ids, **options) -> torch.Tensor:
        assert fn is moe_tune_grouped.moe_experts_nvfp4 and "promote_k" not in options
        return out

    def fake_time(fn, experts, batches, **options) -> float:
        assert fn is moe_tune_grouped.moe_experts_nvfp4
        seen.append(options["gate_up_tiles"].expand)
        return 100.0 - 10.0 * (options["gate_up_tiles"].expand == "group") + options["block_m"] / 16

    for module in (moe_tune, moe_tune_grouped):
        monkeypatch.setattr(module, "time_in_graph", fake_time)
        monkeypatch.setattr(module, "run_experts", fake_output)
    monkeypatch.setattr(moe_tune_grouped, "GATE_UP_CANDIDATES", [Tiles(64, 64, 4, 3)])
    monkeypatch.setattr(moe_tune_grouped, "DOWN_CANDIDATES", [Tiles(64, 64, 4, 3)])
    monkeypatch.setattr(moe_tune_grouped, "launch_variants", lambda tiles: [tiles])
    entry = moe_tune_grouped.tune_grouped(
        ExpertShape(8, 64, 64, "nvfp4"), 2, [40], torch.device("cpu"), False
    )
    assert (entry["block_m"], entry["promote_k"]) == (16, 0)
    assert Tiles(*entry["gate_up"]).expand == "group" and {"byte", "group"} <= set(seen)
    assert "torch_us_per_call" not in entry
    assert moe_tune_grouped.summary(entry) == "T=40 91.0 us (defaults 104.0)"
