"""The extend-attention tile tuner's choice and report (bench/attention_tune.py) from given timings; the
timing itself needs a GPU (the H200's run: results/2026-12-04-h200-attention-tune-h16-kv2-d256-fp8.md)."""

from __future__ import annotations

import pytest
import torch

from morion.bench import attention_tune
from morion.ops.paged_attention_triton import KernelConfig

FAST, SLOW, FAILS = KernelConfig(128, 128, 8, 2), KernelConfig(128, 32, 8, 2), KernelConfig(64, 128, 4, 3)


def shape_result(name: str, times: dict[KernelConfig, float | None], refused=()) -> dict:
    rows = []
    for config, micros in times.items():
        row = {"config": config._asdict()}
        if micros is None:
            row["error"] = "out of resources"
        else:
            row.update(us=micros, tflops=1e6 / micros)
        if config in refused:
            row["refused"] = "disagrees"
        rows.append(row)
    return {
        "shape": {"name": name, "queries": 1024, "context": 0},
        "tflop": 1.0,
        "default": SLOW._asdict(),
        "default_us": times[SLOW],
        "anchor_sdpa_bf16_us": None,
        "candidates": rows,
    }


def test_the_least_total_time_over_every_shape_is_chosen():
    results = [
        shape_result("a", {FAST: 10.0, SLOW: 30.0, FAILS: 5.0}),
        shape_result("b", {FAST: 20.0, SLOW: 15.0, FAILS: None}),  # FAILS could not run here
    ]
    best = attention_tune.best_overall(results)
    assert best == {"config": FAST._asdict(), "total_us": 30.0}
    # A refused candidate is never chosen, however fast.
    refused = [shape_result("a", {FAST: 10.0, SLOW: 30.0, FAILS: 1.0}, refused=(FAILS,))]
    assert attention_tune.best_overall(refused)["config"] == FAST._asdict()
    table = attention_tune.markdown(
        {"heads": 16, "kv_heads": 2, "head_dim": 256, "kv_dtype": "fp8", "gpu": "G", "torch": "t",
         "triton": "x"},
        results, best,
    )  # fmt: skip
    assert "| a | 1.00 | (128, 32, 8, 2) | 30 | 33333 | (64, 128, 4, 3) | 5 | 200000 | 10 | n/a |" in table
    assert "Chosen overall (least total time): (128, 128, 8, 2)" in table


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where no GPU is")
def test_without_a_gpu_it_says_so(capsys):
    with pytest.raises(SystemExit):
        attention_tune.main(["--heads", "16", "--kv-heads", "2", "--head-dim", "256", "--out", "/tmp/x"])
    assert "needs a CUDA GPU" in capsys.readouterr().err
