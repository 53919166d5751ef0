"""Every suite of `morion validate` against a real `morion serve` on the default model, with short bounded
settings, in one run: one results JSON and one Markdown report, verdicts checked suite by suite."""

from __future__ import annotations

import json

import pytest

from morion.cli import main
from morion.validate import cases as case_files

pytestmark = pytest.mark.slow


def test_every_suite_against_morion(morion_url, tmp_path, capsys):
    url, api_key = morion_url
    # Short bounded settings: one case per suite, short replies; the soak's request bound ends it (its time
    # bound only guards against a hang). The tools suite's verdicts are graded against the fake server.
    argv = [
        "validate", "needle", "restore", "soak", "perf", "--url", url, "--api-key", api_key,
        "--cases", "single-depth-50,fruit-list", "--needle-lengths", "300",
        "--soak-clients", "2", "--soak-minutes", "5", "--soak-max-requests", "4", "--soak-max-tokens", "8",
        "--perf-concurrency", "1,2", "--perf-contexts", "64", "--perf-output-tokens", "4",
        "--perf-prefill-lengths", "64", "--perf-repeats", "1", "--out", str(tmp_path),
    ]  # fmt: skip
    status = main(argv)
    err = capsys.readouterr().err
    [path] = tmp_path.glob("*.json")
    result = json.loads(path.read_text())
    suites = result["suites"]
    assert result["status"] == "complete" and list(suites) == ["needle", "restore", "soak", "perf"]
    assert api_key not in path.read_text()
    assert result["server"]["server_info"]["model"]["id"] == "smollm2"
    assert result["provenance"]["git_commit"] and result["provenance"]["command"].startswith(
        "morion validate"
    )

    needle = suites["needle"]
    assert needle["verdict"] == "pass", err
    assert needle["counted_by"] == "render"
    [case] = needle["cases"]
    assert case["id"] == "single-depth-50" and case["reply"]["usage"]["prompt_tokens"] == 300
    assert needle["case_file"]["sha256"] == case_files.FROZEN["needle-v1.json"]

    restore = suites["restore"]
    assert restore["verdict"] == "pass", restore["cases"]
    assert restore["tiers_declared"] == {"host": True, "disk": False}
    assert [case["id"] for case in restore["cases"]] == ["fruit-list"]
    eviction = restore["events"]["eviction"]
    assert eviction["method"] == "evict_device" and eviction["evicted_pages"] > 0
    for case in restore["cases"]:
        cached = case["cached_tokens"]
        assert cached["device"] > cached["cold"] and cached["host"] > cached["cold"]

    soak = suites["soak"]
    assert soak["verdict"] == "pass", soak["reason"]
    assert soak["figures"]["requests"] == 4 and soak["figures"]["errors"] == 0
    assert soak["figures"]["idle"]["pages_held"] == 0
    # Both of morion's processes report their resident memory, and the engine what its caches hold by
    # design (the host tier filled during restore), so the growth beyond the caches is checked.
    assert soak["figures"]["memory_metric"] == (
        "process_resident_memory_bytes + morion_engine_process_resident_memory_bytes"
        " - morion_engine_cache_memory_bytes"
    )
    assert soak["figures"]["memory_growth_mib"] is not None
    assert soak["figures"]["cache_memory_growth_mib"] is not None

    perf = suites["perf"]
    assert perf["verdict"] == "pass", perf["reason"]
    assert [p["concurrency"] for p in perf["decode"]] == [1, 2] and perf["prefill"][0]["prompt_tokens"] == 64
    # The sweep's forwards as the server's engine ran them: on a CPU every one eagerly.
    forwards = perf["forwards"]
    assert forwards["decode/eager"] > 0 and sum(v for k, v in forwards.items() if k.endswith("/graph")) == 0
    # Each cold prefill's engine part and the engine thread's split of it (the server's /metrics), in the
    # report's prefill table.
    [run] = perf["prefill"][0]["runs"]
    assert run["engine_thread"]["on_cpu_s"] > 0 and run["ttft_parts"]["prefill_s"] > 0

    assert status == 0 and result["verdict"] == "pass"
    report = path.with_suffix(".md").read_text()
    assert "## restore: **pass**" in report and "| single-depth-50 | 300 | 300 |" in report
    assert "| engine prefill ms | engine thread on / off CPU ms |" in report
    [prefill_row] = [line for line in report.splitlines() if line.startswith("| 64 |")]
    assert "—" not in prefill_row, prefill_row


def test_restore_over_generated_token_id_conversations(morion_url, tmp_path, capsys):
    """The qualification's mode: conversations of drawn lengths, by token ids, in rounds with a device-cache
    eviction between the device and host steps; every hit reuses every full page before the last token
    and answers as cold, logprob for logprob."""
    url, api_key = morion_url
    argv = [
        "validate", "restore", "--url", url, "--api-key", api_key, "--restore-conversations", "4",
        "--restore-lengths", "40:400", "--restore-group", "2", "--restore-max-tokens", "4",
        "--restore-seed", "7", "--out", str(tmp_path),
    ]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    [path] = tmp_path.glob("*.json")
    suite = json.loads(path.read_text())["suites"]["restore"]
    assert suite["verdict"] == "pass" and suite["seed"] == 7 and suite["page_size"] == 16
    assert suite["figures"]["hits"] == {"device": 4, "host": 4, "disk": 0}
    assert suite["figures"]["wrong_answers"] == 0
    drawn = suite["lengths"]["drawn"]
    assert drawn[0] % 256 == 0 and drawn[1] % 16 and all(40 <= n <= 400 for n in drawn)
    assert [e["method"] for e in suite["events"]["evictions"]] == ["evict_device"] * 2
    for case in suite["cases"]:
        cold = case["steps"]["cold"]
        assert len(cold["token_logprobs"]) == 4 and cold["cached_tokens"] == 0
        assert case["steps"]["host"]["cached_tokens"] == (case["prompt_tokens"] - 1) // 16 * 16
    report = path.with_suffix(".md").read_text()
    assert "**8 hits, 0 wrong answers**" in report
