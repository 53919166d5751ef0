"""The GPU's batch-invariance probes on the CPU, where their mechanics can be checked (the CPU's BLAS computes
rows differently at other batch sizes, so only the GPU's figures for those comparisons mean anything).
scripts/decode_invariance.py runs its three phases: alone, a device hit (its tail recomputed, then decode
at batch 1) answers as the cold run here too. scripts/row_invariance_probe.py finds every op it should,
and scripts/decode_divergence_trace.py the first module whose row differs."""

from __future__ import annotations

import json

import pytest
import torch

from tests.scripts import load_script

_script = load_script


def test_cold_and_alone_agree_and_every_comparison_is_reported(tmp_path):
    module = _script("decode_invariance")
    argv = ["--model", "preset:qwen3-next-tiny", "--device", "cpu", "--prompts", "3", "--prompt-tokens", "37",
            "--tokens", "4", "--batch", "2", "--kv-cache-tokens", "4096", "--out", str(tmp_path)]  # fmt: skip
    assert module.main(argv) == 0
    [path] = tmp_path.glob("*-decode-invariance.json")
    result = json.loads(path.read_text())
    assert result["steps_compared"] == 12
    assert result["misses"] == {"alone": [], "together": []}  # the hit phases hit
    assert result["cold_vs_alone"] == {"prompts_differing": 0, "first_differing_token": {}}
    assert set(result["alone_vs_together"]) == {"prompts_differing", "first_differing_token"}
    assert len(result["cold_logprobs"]) == 3 and all(len(answer) == 4 for answer in result["cold_logprobs"])

    # Another process's cold answers (here: the same ones, then one altered at its third token).
    again = tmp_path / "again"
    assert module.main([*argv[:-1], str(again), "--compare-cold", str(path)]) == 0
    [again_path] = again.glob("*-decode-invariance.json")
    assert json.loads(again_path.read_text())["cold_vs_other_process"]["prompts_differing"] == 0
    result["cold_logprobs"][1][2] += 0.5
    path.write_text(json.dumps(result))
    assert module.main([*argv[:-1], str(again), "--compare-cold", str(path)]) == 0
    parted = json.loads(again_path.read_text())["cold_vs_other_process"]
    assert parted == {"prompts_differing": 1, "first_differing_token": {"1": 2}}


def test_hit_phases_that_miss_fail_the_probe(tmp_path, capsys):
    """Too few state slots for every prompt's snapshots: the least recently used go, and the phases that
    should compare hits compare cold runs instead; the probe says so and exits 1."""
    module = _script("decode_invariance")
    argv = ["--model", "preset:qwen3-next-tiny", "--device", "cpu", "--prompts", "4", "--prompt-tokens", "37",
            "--tokens", "4", "--batch", "2", "--kv-cache-tokens", "4096", "--state-slots", "4",
            "--out", str(tmp_path)]  # fmt: skip
    assert module.main(argv) == 1
    [path] = tmp_path.glob("*-decode-invariance.json")
    assert json.loads(path.read_text())["misses"]["alone"]
    assert "not every hit phase hit" in capsys.readouterr().err


def test_cold_answers_of_other_prompts_are_refused(tmp_path):
    module = _script("decode_invariance")
    earlier = tmp_path / "earlier.json"
    earlier.write_text(
        json.dumps({"settings": {"model": "preset:qwen3-next-tiny", "prompts": 5}, "cold_logprobs": []})
    )
    argv = [
        "--model",
        "preset:qwen3-next-tiny",
        "--device",
        "cpu",
        "--prompts",
        "3",
        "--compare-cold",
        str(earlier),
    ]
    with pytest.raises(SystemExit, match="ran other prompts"):
        module.main(argv)


def test_the_row_probe_covers_both_layer_kinds_the_moe_block_and_the_head(tmp_path):
    module = _script("row_invariance_probe")
    argv = ["--model", "preset:qwen3-next-tiny", "--device", "cpu", "--trials", "2", "--out", str(tmp_path)]
    assert module.main(argv) == 0
    [path] = tmp_path.glob("*-row-invariance.json")
    ops = json.loads(path.read_text())["ops"]
    names = set(ops)
    assert {"model.layers.0.linear_attn.in_proj_qkvz", "model.layers.0.mlp", "lm_head"} <= names
    assert any(name.endswith("self_attn.q_proj") for name in names)  # the full-attention layer's too
    assert all(0 <= figures["m1_vs_batched_rows"] <= figures["trials"] == 2 for figures in ops.values())


def test_the_row_probe_compares_the_buckets_it_is_given(tmp_path, capsys):
    """Prefill-sized buckets (here 3 and 40 rows): every trial computes them; a bad list is one error line."""
    module = _script("row_invariance_probe")
    argv = ["--model", "preset:qwen3-next-tiny", "--device", "cpu", "--trials", "1", "--buckets", "40,3",
            "--out", str(tmp_path)]  # fmt: skip
    assert module.main(argv) == 0
    [path] = tmp_path.glob("*-row-invariance.json")
    result = json.loads(path.read_text())
    assert result["buckets"] == [3, 40]
    assert all(figures["batched_rows"] in (0, 1) for figures in result["ops"].values())
    with pytest.raises(SystemExit):
        module.main(["--model", "preset:qwen3-next-tiny", "--device", "cpu", "--buckets", "1,8"])
    assert "--buckets 1,8: row counts of at least 2" in capsys.readouterr().err


def test_the_row_probe_takes_flash_next_mixes_as_the_layer_runs_them(tmp_path):
    from morion.loader import load_model
    from tests.models.conftest import QWEN4_EXP_TINY_CONFIG

    (tmp_path / "config.json").write_text(json.dumps(QWEN4_EXP_TINY_CONFIG))
    model = load_model(str(tmp_path), torch.float32, torch.device("cpu"), "dummy").model
    ops = _script("row_invariance_probe")._ops(model)
    mix = "model.layers.0.attn_hyper_connection"
    assert {mix, f"{mix}.hc_norm", "model.layers.0.mlp", "lm_head"} - set(ops) == {f"{mix}.hc_norm"}
    assert not any(name.startswith(f"{mix}.") for name in ops)  # its weights are the fused kernels'
    assert any(".self_attn.indexer.index_qk_proj" in name for name in ops)  # the QSA layer's too
    assert not any(name.startswith("mtp.") for name in ops)
    op, features = ops[mix]
    hc_count = model.model.layers[0].attn_hyper_connection.hc_count
    assert op(torch.randn(3, features)).shape == (3, features // hc_count)


def test_the_divergence_trace_names_the_modules_whose_row_differs(tmp_path):
    module = _script("decode_divergence_trace")
    argv = ["--model", "preset:qwen3-next-tiny", "--device", "cpu", "--prompt-tokens", "37", "--tokens", "4",
            "--batch", "3", "--trace-prompt", "1", "--kv-cache-tokens", "4096",
            "--out", str(tmp_path)]  # fmt: skip
    assert module.main(argv) == 0
    [path] = tmp_path.glob("*-decode-divergence-trace.json")
    result = json.loads(path.read_text())
    # The CPU's BLAS computes a row differently beside others from the first decode step on: the trace
    # must find it there, in the first layer's projections, with the traced prompt's row in the batch.
    first = result["steps"][0]
    assert first["step"] == 0 and first["row"] == 1 and first["differing"] > 0
    assert first["first"][0][0].startswith("model.layers.0.") and first["first"][0][1] > 0


def test_the_prefill_sync_probe_names_our_innermost_frame_and_needs_a_gpu():
    import traceback

    module = _script("prefill_syncs")
    stack = [
        traceback.FrameSummary("/x/site-packages/morion/engine/engine.py", 10, "step"),
        traceback.FrameSummary("/x/site-packages/fla/ops/utils/index.py", 164, "prepare_chunk_indices"),
        traceback.FrameSummary("/x/site-packages/torch/_tensor.py", 5, "to"),
    ]
    assert module._site(stack) == "fla/ops/utils/index.py:164 prepare_chunk_indices"
    assert module._site(stack[2:]) == "(outside morion and fla)"
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            module.main(["--model", "preset:qwen3-next-tiny", "--device", "cpu"])


def test_the_prefill_host_profile_times_fresh_prompts_by_function(tmp_path, capsys):
    """The tiny model on the CPU: two fresh prompts profiled after a warm one; the engine's forward is
    among morion's functions with time under it, the tables print, and the JSON holds each prompt's
    wall time. Names keep the package path; a bad --prompts is one error line."""
    module = _script("prefill_host_profile")
    assert (
        module._name("/x/site-packages/morion/engine/engine.py", 3, "step")
        == "morion/engine/engine.py:3 step"
    )
    assert (
        module._name("/x/site-packages/torch/cuda/graphs.py", 9, "replay") == "torch/cuda/graphs.py:9 replay"
    )
    assert module._name("~", 0, "<built-in method torch.conv1d>") == "<built-in method torch.conv1d>"
    flags = ["--model", "preset:qwen3-next-tiny", "--device", "cpu", "--prompt-tokens", "48"]
    assert module.main([*flags, "--prompts", "2", "--top", "5", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "48-token prefill, 2 fresh prompts" in printed and "own time per prefill:" in printed
    [path] = tmp_path.glob("*-prefill-host-profile.json")
    result = json.loads(path.read_text())
    assert len(result["wall_ms"]) == 2 and all(ms > 0 for ms in result["wall_ms"])
    forward = [r for r in result["functions"] if r["function"].endswith(" forward_eager")]
    assert len(forward) == 1 and forward[0]["ours"] and forward[0]["calls"] >= 1
    assert 0 < forward[0]["cumulative_ms"] <= max(result["wall_ms"])
    with pytest.raises(SystemExit):
        module.main([*flags, "--prompts", "0"])


def test_the_tier_first_run_diagnostic_runs_every_variant_on_the_cpu(capsys):
    """scripts/tier_first_run_diag.py (the H200's question of session 33): on the CPU every variant but
    the graph ones runs and, with the same cut points, answers alike."""
    assert _script("tier_first_run_diag").main(["--device", "cpu", "--tokens", "2"]) == 0
    printed = capsys.readouterr().out
    assert "CPU model, full prefill: top 3" in printed and printed.count(" tokens [") == 5
    assert "differ from the first variant: none" in printed
