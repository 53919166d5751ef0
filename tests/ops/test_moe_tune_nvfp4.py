"""The tuner's NVFP4 candidates (both code expansions, split K for the GEMV tiles) and its agreement check,
on the CPU."""

from __future__ import annotations

import torch

from morion.ops.moe_tune import (
    AGREEMENT,
    GATE_UP_CANDIDATES,
    GEMV_ACC_CANDIDATES,
    SPLIT_K,
    disagreement,
    with_expansions,
)


def test_nvfp4_candidates_come_in_both_expansions_and_other_dtypes_keep_theirs():
    nvfp4 = with_expansions(GATE_UP_CANDIDATES, "nvfp4")
    unsplit = [t for t in nvfp4 if t.split_k == 1]
    assert len(unsplit) == len(set(unsplit)) == 2 * len(GATE_UP_CANDIDATES)
    assert {t._replace(expand="byte") for t in unsplit} == set(GATE_UP_CANDIDATES)
    assert {t.expand for t in nvfp4} == {"byte", "group"}
    # Every GEMV tile with each split_k, the others unsplit.
    gemv = {t for t in unsplit if t.mma == "gemv"}
    assert {t for t in nvfp4 if t.split_k > 1} == {t._replace(split_k=s) for t in gemv for s in SPLIT_K[1:]}
    assert len(nvfp4) == len(set(nvfp4)) == len(unsplit) + 3 * len(gemv)
    assert with_expansions(GATE_UP_CANDIDATES, "fp8") == GATE_UP_CANDIDATES + GEMV_ACC_CANDIDATES
    assert all(t.mma != "gemv_acc" for t in nvfp4)
    gemv = [t.mma == "gemv" for t in nvfp4]
    assert gemv == sorted(gemv, reverse=True) and any(gemv)  # the GEMV tiles first


def test_a_candidate_off_the_default_tiles_output_is_refused():
    experts = {"gate_up": torch.zeros(1), "down": torch.zeros(1)}
    batches = {t: [(torch.ones(t, 8), torch.ones(t, 1), torch.zeros(t, 1))] for t in (1, 4)}
    reference = {t: torch.linspace(1, 2, 8 * t).view(t, 8) for t in batches}

    def experts_fn(hidden, gate_up, down, weights, ids, *, error: float) -> torch.Tensor:
        return reference[hidden.shape[0]] * (1 + error)

    assert disagreement(experts_fn, experts, batches, reference, error=AGREEMENT / 2) is None
    assert "T=1: relative L2" in disagreement(experts_fn, experts, batches, reference, error=2 * AGREEMENT)
    assert disagreement(experts_fn, experts, batches, reference, error=float("nan")) is not None
