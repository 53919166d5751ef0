"""`morion bench --workloads spec` on the tiny Qwen3-Next (a hybrid: the verify forward rolls its Gated
DeltaNet state back): plain and speculative decode of the same fresh prompts on one set of weights, the
outputs compared, the speedup and the mean accepted length measured over the measured runs only; results
labelled SYNTHETIC; its errors."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from morion.bench import speculative
from morion.bench.report import markdown
from morion.cli import main
from morion.spec.synthetic import acceptance_for_mean_accepted

WIDTH, OUTPUT = 3, 24
TINY_SPEC = [
    "--device", "cpu", "--kv-cache-tokens", "2048", "--workloads", "spec", "--spec-width", str(WIDTH),
    "--contexts", "32", "--output-tokens", str(OUTPUT),
]  # fmt: skip


def _bench(model_dir: Path, flags: list[str], out: Path) -> tuple[int, str]:
    """Runs `morion bench` on the tiny model with stderr captured in a file: (exit status, stderr)."""
    capture = pytest.MonkeyPatch()
    stderr = out / "stderr.txt"
    model = ["--model", str(model_dir), "--load-format", "dummy"]
    with stderr.open("w") as sink:
        capture.setattr("sys.stderr", sink)
        try:
            status = main(["bench", *model, *TINY_SPEC, *flags, "--out", str(out)])
        finally:
            capture.undo()
    return status, stderr.read_text()


@pytest.fixture(scope="module")
def spec_result(tiny_qwen3_next_config_dir, tmp_path_factory) -> tuple[dict, Path, str]:
    out = tmp_path_factory.mktemp("spec")
    flags = ["--concurrency", "1,2", "--repeats", "2", "--spec-mean-accepted", "2.58", "--label", "tiny"]
    status, stderr = _bench(tiny_qwen3_next_config_dir, flags, out)
    assert status == 0, stderr
    [path] = out.glob("*-tiny.json")
    return json.loads(path.read_text()), path, stderr


def test_results_are_labelled_synthetic_and_record_the_setting(spec_result):
    result, _, _ = spec_result
    section = result["spec"]
    assert result["status"] == "complete" and section["synthetic"] is True
    assert section["width"] == WIDTH and section["target_mean_accepted"] == 2.58
    assert section["acceptance_p"] == acceptance_for_mean_accepted(2.58, WIDTH)
    assert section["failures"] == [] and section["skipped"] == []
    assert section["through"] == "none" and section["drafter_name"] == "synthetic"
    assert result["engine_config"]["spec_width"] == WIDTH and result["engine_config"]["speculative"] == "off"
    assert result["settings"]["spec_mean_accepted"] == 2.58
    assert "--workloads spec" in result["provenance"]["command"]
    assert result["decode"] == [] and result["restore"] is None


def test_outputs_are_identical_and_the_speedup_is_the_ratio_of_medians(spec_result):
    points = spec_result[0]["spec"]["points"]
    assert [(p["concurrency"], p["context"]) for p in points] == [(1, 32), (2, 32)]
    for point in points:
        assert point["identical"] is True and len(point["runs"]) == 2 and len(point["warmup_runs"]) == 1
        for run in point["runs"]:
            assert run["identical"] is True and run["first_difference"] is None
            for kind in ("plain", "speculative"):
                requests = run[kind]["requests"]
                assert len(requests) == point["concurrency"]
                assert all(r["completion_tokens"] == OUTPUT and r["cached_tokens"] == 0 for r in requests)
        median = {
            kind: statistics.median(run[kind]["per_request_tok_s"] for run in point["runs"])
            for kind in ("plain", "speculative")
        }
        assert point["median"]["plain_per_request_tok_s"] == median["plain"]
        assert point["median"]["speculative_per_request_tok_s"] == median["speculative"]
        assert point["speedup"] == median["speculative"] / median["plain"]


def test_mean_accepted_length_comes_from_the_measured_runs_alone(spec_result):
    for point in spec_result[0]["spec"]["points"]:
        runs = point["runs"]
        for run in runs:
            change = run["spec_stats"]
            # One run's change, not the engine's totals: at most every request's decode tokens, plus the
            # drafts of a request's last verify step that went past its end (warm-ups would double it).
            assert change["emitted_tokens"] <= point["concurrency"] * (OUTPUT - 1 + WIDTH)
            assert change["verify_steps"] > 0 and change["verify_graph_replays"] == 0  # no graphs on a CPU
            assert sum(change["drafted_by_position"]) == change["drafted_tokens"]
            assert sum(change["accepted_by_position"]) == change["accepted_tokens"]
            steps = change["emitted_tokens"] - change["accepted_tokens"]
            assert run["mean_accepted"] == change["emitted_tokens"] / steps
        total = point["spec_stats"]
        for key in ("verify_steps", "drafted_tokens", "accepted_tokens", "emitted_tokens"):
            assert total[key] == sum(run["spec_stats"][key] for run in runs)
        assert total["drafted_by_position"] == [
            sum(c) for c in zip(*(r["spec_stats"]["drafted_by_position"] for r in runs), strict=True)
        ]
        mean = total["emitted_tokens"] / (total["emitted_tokens"] - total["accepted_tokens"])
        assert point["measured_mean_accepted"] == mean and 1 < mean < WIDTH + 1
        rates = [
            a / d for a, d in zip(total["accepted_by_position"], total["drafted_by_position"], strict=True)
        ]
        assert point["acceptance_by_position"] == rates and len(rates) == WIDTH


def test_markdown_and_progress_lines(spec_result):
    result, path, stderr = spec_result
    text = path.with_suffix(".md").read_text()
    assert text == markdown(result)
    assert "## Speculative decoding, SYNTHETIC drafter: width 3, p = 0.712, set for 2.58 tokens" in text
    assert "**SYNTHETIC**" in text and "| plain tok/s [1] | speculative tok/s [1] | speedup |" in text
    rows = [line for line in text.splitlines() if line.startswith(("| 1 | 32 |", "| 2 | 32 |"))]
    assert len(rows) == 2 and all(row.endswith("| identical to plain |") for row in rows)
    speedup = result["spec"]["points"][1]["speedup"]
    assert f"| {speedup:.2f}x |" in rows[1]
    assert "[9] speculative decoding, SYNTHETIC" in text and "[10] measured mean accepted length" in text
    assert "[7]" not in text  # no restore footnotes without the restore workload
    assert "spec C=2 ctx=32: run 2/2: plain " in stderr and "output identical" in stderr
    assert "spec C=1 ctx=32: median per-request plain " in stderr


@pytest.mark.parametrize("through", ["off", "mtp"])
@pytest.mark.parametrize("mean, all_accepted", [("1", False), ("4", True)])
def test_acceptance_at_the_extremes(tiny_qwen3_next_config_dir, tmp_path, mean, all_accepted, through):
    """p = 0 accepts nothing (one token per verify step); p = 1 accepts every draft (width + 1 tokens);
    the same through the MTP head, which runs for its cost while the synthetic drafts decide."""
    flags = ["--concurrency", "2", "--repeats", "1", "--warmup-runs", "0", "--spec-mean-accepted", mean]
    status, stderr = _bench(tiny_qwen3_next_config_dir, [*flags, "--speculative", through], tmp_path)
    assert status == 0, stderr
    [path] = tmp_path.glob("*.json")
    result = json.loads(path.read_text())
    section = result["spec"]
    [point] = section["points"]
    change = point["spec_stats"]
    assert change["accepted_tokens"] == (change["drafted_tokens"] if all_accepted else 0)
    assert point["measured_mean_accepted"] == float(mean) and point["identical"]
    assert result["engine_config"]["speculative"] == through  # as given; the plain engine runs without
    if through == "mtp":
        assert section["through"] == "mtp" and section["drafter_name"] == "synthetic (through the mtp path)"
        text = path.with_suffix(".md").read_text()
        assert "Drafter `synthetic (through the mtp path)`: the model's MTP head runs" in text


def test_an_output_that_differs_from_plain_fails(tiny_qwen3_next_config_dir, tmp_path, monkeypatch):
    """A speculative run that answers differently is FAILED whatever its speed: the row and the exit."""

    def corrupted(engine, prompts, max_tokens):
        timings, token_ids = generate(engine, prompts, max_tokens)
        if engine.speculative is not None:
            token_ids[-1][5] += 1
        return timings, token_ids

    generate = speculative.generate
    monkeypatch.setattr(speculative, "generate", corrupted)
    flags = ["--concurrency", "2", "--repeats", "1", "--warmup-runs", "0"]
    status, stderr = _bench(tiny_qwen3_next_config_dir, flags, tmp_path)
    assert status == 1
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("morion: error: spec FAILED: C2 ctx 32, run 1: output differs from plain at ")
    assert "request 1, token 5 (1 problems; results: " in last
    [path] = tmp_path.glob("*-spec-synthetic.json")  # the default label says what the file holds
    section = json.loads(path.read_text())["spec"]
    assert section["points"][0]["identical"] is False and len(section["failures"]) == 1
    text = path.with_suffix(".md").read_text()
    assert "| **FAILED** (run 1) |" in text and "- FAILED: C2 ctx 32, run 1: output differs" in text


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--url", "http://127.0.0.1:9"], "--workloads spec needs the offline engine"),
        ([], "--workloads spec needs --spec-width N, the synthetic drafter's width: e.g. --spec-width 3"),
        (["--spec-width", "2", "--spec-mean-accepted", "3.5"], "--spec-mean-accepted 3.5 must be in [1, 3]"),
        (["--spec-width", "3", "--spec-mean-accepted", "0.5"], "--spec-mean-accepted must be >= 1"),
        (["--spec-width", "3", "--speculative", "ngram"], "use --speculative mtp (the MTP head runs for its"),
        (["--spec-width", "3", "--host-cache-gb", "1"], "leave out --host-cache-gb and --disk-cache-dir"),
    ],
)
def test_flag_errors_are_one_line(flags, message, tmp_path, capsys):
    assert main(["bench", "--device", "cpu", "--workloads", "spec", *flags, "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("morion: error: ") and err.count("\n") == 1
    assert message in err
    assert not list(tmp_path.iterdir())
