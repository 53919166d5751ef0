from morion.ops.moe_decode_triton import exact_mma
from morion.ops.moe_tiles import Tiles
from morion.ops.moe_tune import GATE_UP_CANDIDATES, launch_variants


def test_launch_variants_keep_the_block_shape_and_start_with_the_chosen_tile():
    chosen = Tiles(32, 256, 4, 3, "gemv")
    variants = launch_variants(chosen)
    assert variants[0] == chosen and len(variants) == len(set(variants)) == 12
    assert {(v.block_n, v.block_k, v.mma) for v in variants} == {(32, 256, "gemv")}
    assert {v.num_warps for v in variants} == {2, 4, 8} and {v.num_stages for v in variants} == {2, 3, 4, 5}


def test_fp8_sweeps_leave_out_swapped_operands_only():
    kept = [t for t in GATE_UP_CANDIDATES if exact_mma(t, fp8=True)]
    assert {t.mma for t in kept} == {"dot", "gemv"}
    assert len(kept) == sum(t.mma != "swapped" for t in GATE_UP_CANDIDATES)
    assert all(exact_mma(t, fp8=False) for t in GATE_UP_CANDIDATES)
