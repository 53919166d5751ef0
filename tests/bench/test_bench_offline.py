"""`morion bench` offline (an in-process engine) on tiny models: the results files, their numbers, the
errors, and the transformers baseline."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from morion.bench.plot import matplotlib_available
from morion.bench.prompts import PromptFactory
from morion.cli import main
from tests.bench.conftest import run_bench

TINY_SWEEP = [
    # A CPU has no known peaks: the roofline's are given (the H200's, as numbers to compute with).
    "--bandwidth-gbs",
    "4300",
    "--peak-tflops",
    "790",
    "--device",
    "cpu",
    "--kv-cache-tokens",
    "2048",
    "--concurrency",
    "1,2",
    "--contexts",
    "32",
    "--output-tokens",
    "8",
    "--repeats",
    "2",
    "--prefill-lengths",
    "32,64",
    "--ttft-length",
    "32",
]


@pytest.fixture(scope="module")
def qwen3_next_result(tiny_qwen3_next_config_dir, tmp_path_factory) -> tuple[dict, Path, str]:
    """One bench of the tiny Qwen3-Next (random weights) through the CLI: (JSON, its path, stderr)."""
    out = tmp_path_factory.mktemp("bench")
    model = ["--model", str(tiny_qwen3_next_config_dir), "--load-format", "dummy"]
    status, stderr = run_bench([*model, *TINY_SWEEP, "--label", "tiny"], out)
    assert status == 0, stderr
    [path] = out.glob("*-tiny.json")
    return json.loads(path.read_text()), path, stderr


def test_json_records_provenance_config_and_settings(qwen3_next_result):
    result, path, _ = qwen3_next_result
    assert path.name == f"{result['date']}-tiny.json"
    assert result["schema"] == "morion-bench/1" and result["status"] == "complete"
    assert result["mode"] == "offline"
    prov = result["provenance"]
    for key in ("git_commit", "git_dirty", "hostname", "date", "torch", "cuda", "triton", "gpus", "command"):
        assert key in prov
    assert prov["command"].startswith("morion bench --model ")
    assert "--concurrency 1,2" in prov["command"]
    assert result["engine_config"]["kv_cache_tokens"] == 2048
    assert result["engine_config"]["load_format"] == "dummy"
    assert result["target"]["model_type"] == "qwen3_next"
    assert result["settings"]["concurrency"] == [1, 2] and result["settings"]["repeats"] == 2
    assert result["roofline"]["bandwidth_gbs"] == 4300 and result["roofline"]["peak_tflops"] == 790
    assert result["roofline"]["peaks_source"] == "the command line"
    assert result["roofline"]["model"]["moe_layers"] == 4
    assert result["roofline"]["model"]["source"] == "model"


def test_decode_medians_are_medians_of_the_raw_runs(qwen3_next_result):
    result, _, _ = qwen3_next_result
    points = result["decode"]
    assert [(p["concurrency"], p["context"]) for p in points] == [(1, 32), (2, 32)]
    for point in points:
        assert len(point["runs"]) == 2
        for run in point["runs"]:
            requests = run["requests"]
            assert len(requests) == point["concurrency"]
            for request in requests:
                assert request["prompt_tokens"] == 32 and request["completion_tokens"] == 8
                assert request["decode_tok_s"] == pytest.approx(7 / request["decode_s"])
            assert run["per_request_tok_s"] == statistics.median(r["decode_tok_s"] for r in requests)
            assert run["aggregate_tok_s"] == pytest.approx(run["total_tokens"] / run["makespan_s"])
            assert run["total_tokens"] == 8 * point["concurrency"]
            # The engine's own steps of the run: one prefill for the batch, then a decode step per token.
            steps = run["engine_steps"]
            assert steps["decode_steps"] == 7 and steps["other_steps"] >= 1
            assert 0 < run["engine_decode_step_ms"] == steps["decode_step_ms"]
            assert steps["loop_overhead_ms_per_step"] is None  # no serving loop in-process
        for key in ("per_request_tok_s", "aggregate_tok_s", "ttft_s", "step_s", "engine_decode_step_ms"):
            assert point["median"][key] == statistics.median(run[key] for run in point["runs"])
        bound = point["roofline"]
        assert bound["context_avg"] == 32 + 3.5
        assert bound["aggregate_tok_s"] == pytest.approx(point["concurrency"] * bound["per_request_tok_s"])
        assert 0 < point["mbu"] < 1


def test_prefill_and_ttft(qwen3_next_result):
    result, path, _ = qwen3_next_result
    assert [p["prompt_tokens"] for p in result["prefill"]] == [32, 64]
    for point in [*result["prefill"], result["ttft"]]:
        for run in point["runs"]:
            assert run["prefill_tok_s"] == pytest.approx(run["prompt_tokens"] / run["ttft_s"])
        assert point["median"]["ttft_s"] == statistics.median(run["ttft_s"] for run in point["runs"])
        assert point["roofline"]["tok_s"] > 0 and point["mfu"] > 0
    assert result["ttft"]["prompt_tokens"] == 32
    # How each prompt's forwards ran (all eagerly on a CPU), 16-token pages: 32 tokens are two short
    # forwards (16 up to the last page boundary, then the tail); 64 a prefill chunk of 48 and the tail.
    forwards = [[run["forwards"] for run in point["runs"]] for point in result["prefill"]]
    assert forwards == [[{"short/eager": 2}] * 2, [{"prefill/eager": 1, "short/eager": 1}] * 2]
    # Where the engine thread's prefill went (the engine's own split, `FirstTokenTimes`): all of it on a
    # CPU, in a run queue or off CPU (this Linux machine keeps the scheduler's statistics), and the
    # report says so per length.
    for point in result["prefill"]:
        for run in point["runs"]:
            thread, prefill = run["engine_thread"], run["ttft_parts"]["prefill_s"]
            assert thread["on_cpu_s"] > 0 and thread["runqueue_s"] >= 0 and thread["off_cpu_s"] >= 0
            busy = thread["on_cpu_s"] + thread["runqueue_s"]
            assert sum(thread.values()) == pytest.approx(max(prefill, busy))
            assert prefill <= run["ttft_s"]
    markdown = path.with_suffix(".md").read_text()
    assert "- 64 tokens: the engine thread on a CPU" in markdown


def test_every_prompt_is_fresh(qwen3_next_result):
    """Prompts of one length repeat across points and workloads (ttft and prefill both use 32 tokens);
    a repeat would be a prefix-cache hit."""
    result, _, _ = qwen3_next_result
    requests = [r for p in result["decode"] for run in p["runs"] for r in run["requests"]]
    requests += [run for p in [*result["prefill"], result["ttft"]] for run in p["runs"]]
    assert len(requests) == 2 * 1 + 2 * 2 + 3 * 2
    assert all(r["cached_tokens"] == 0 for r in requests)


def test_prompt_factory_keys():
    factory = PromptFactory(vocab_size=100, salt=7)
    assert factory.make("a", 50) == factory.make("a", 50)
    assert factory.make("a", 50) != factory.make("b", 50)
    assert PromptFactory(vocab_size=100, salt=8).make("a", 50) != factory.make("a", 50)
    assert all(3 <= t < 100 for t in factory.make("c", 1000))
    assert max(PromptFactory(vocab_size=200_000).make("d", 5000)) < 32000  # clear of special tokens


def test_markdown_table_and_footnotes(qwen3_next_result):
    result, path, _ = qwen3_next_result
    text = path.with_suffix(".md").read_text()
    assert text.startswith("# morion bench: tiny")
    assert "| engine | C | context | per-request tok/s [1] |" in text
    rows = [line for line in text.splitlines() if line.startswith("| morion |")]
    assert len(rows) == 2
    median = result["decode"][1]["median"]["per_request_tok_s"]
    assert f"| morion | 2 | 32 | {median:,.1f} |" in rows[1]
    assert "## Cold prefill" in text and "## TTFT at 32 prompt tokens" in text
    assert "[2] aggregate tok/s: all tokens generated in a run / makespan" in text
    assert "D(B) = E(1 - (1 - k/E)^B)" in text


def test_plot_regenerates_markdown_and_png(qwen3_next_result, tmp_path, capsys):
    _, path, stderr = qwen3_next_result
    copy = tmp_path / path.name
    copy.write_text(path.read_text())
    assert main(["bench", "--plot", str(copy)]) == 0
    assert copy.with_suffix(".md").read_text() == path.with_suffix(".md").read_text()
    if matplotlib_available():
        assert copy.with_suffix(".png").stat().st_size > 0
    else:
        assert "no PNG (matplotlib is not installed here)" in capsys.readouterr().err
        assert stderr.count("no PNG") == 1
    assert "bench [" in stderr and "decode C=2 ctx=32: run 2/2" in stderr  # progress lines


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--workloads", "decode,speed"], "unknown workload 'speed'"),
        (["--concurrency", "1,0"], "--concurrency values must be >= 1, got 0"),
        (["--concurrency", "two"], "--concurrency must be comma-separated integers"),
        (["--baseline", "vllm"], "--baseline must be one of hf"),
        (["--url", "localhost:8000"], "--url must start with http:// or https://"),
        (["--logprobs", "-1"], "--logprobs must be >= 0, got '-1'"),
        (["--concurrency", "4", "--max-running-requests", "2"], "--concurrency 4 exceeds --max-running"),
    ],
)
def test_bad_values_are_one_line_errors(flags, message, capsys):
    assert main(["bench", "--device", "cpu", *flags]) == 1
    err = capsys.readouterr().err
    assert err.startswith("morion: error: ") and err.count("\n") == 1
    assert message in err


def test_prompts_that_cannot_fit_are_rejected_before_measuring(tiny_qwen3_next_config_dir, tmp_path, capsys):
    model = ["--model", str(tiny_qwen3_next_config_dir), "--load-format", "dummy"]
    status = main(["bench", *model, *TINY_SWEEP, "--contexts", "32,600", "--out", str(tmp_path)])
    assert status == 1
    assert (
        "morion: error: --contexts needs 608 tokens (prompt + output) but the engine's max model len is 512"
        in (capsys.readouterr().err)
    )
    assert not list(tmp_path.iterdir())


def test_plot_of_a_non_result_is_an_error(tmp_path, capsys):
    bad = tmp_path / "x.json"
    bad.write_text("{}")
    assert main(["bench", "--plot", str(bad)]) == 1
    assert "is not a morion bench result" in capsys.readouterr().err


def test_hf_baseline_in_the_same_table(tiny_llama, tmp_path, capsys):
    flags = ["--model", str(tiny_llama.path), *TINY_SWEEP, "--workloads", "decode", "--repeats", "1"]
    status = main(["bench", *flags, "--warmup-runs", "0", "--baseline", "hf", "--out", str(tmp_path)])
    assert status == 0, capsys.readouterr().err
    [path] = tmp_path.glob("*.json")
    result = json.loads(path.read_text())
    baseline = result["baseline"]
    assert baseline["target"]["model_class"] == "LlamaForCausalLM"
    [point] = baseline["decode"]
    assert point["engine"] == "transformers" and point["concurrency"] == 1
    [run] = point["runs"]
    assert run["requests"][0]["completion_tokens"] == 8
    assert point["roofline"]["per_request_tok_s"] > 0
    text = path.with_suffix(".md").read_text()
    assert len([line for line in text.splitlines() if line.startswith("| transformers | 1 | 32 |")]) == 1
    assert "LlamaForCausalLM, random weights" in text


def test_logprobs_reach_every_offline_request(tiny_qwen3_next_config_dir):
    """`--logprobs N`: the offline engine does what a server timed through `logprobs: 0` does."""
    from morion.bench.offline import EngineTarget
    from morion.config import EngineConfig

    config = EngineConfig(
        model=str(tiny_qwen3_next_config_dir), load_format="dummy", device="cpu", kv_cache_tokens=2048
    )
    target = EngineTarget(config, logprobs=0)
    seen = []
    add_request = target.engine.add_request
    target.engine.add_request = lambda prompt, params: seen.append(params) or add_request(prompt, params)
    try:
        target.run_group([[5] * 20, [6] * 30], 4)
    finally:
        target.close()
    assert [params.logprobs for params in seen] == [0, 0]
