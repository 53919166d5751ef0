"""`morion bench --workloads turn`: one turn of an agent conversation on top of its cached prefix, offline on
the tiny hybrid Qwen3-Next (its state is reusable only at a snapshot) and through a real server."""

from __future__ import annotations

import json
import statistics

import pytest

from morion.cli import main
from tests.bench.conftest import run_bench

TURN = [
    "--device", "cpu", "--kv-cache-tokens", "2048", "--workloads", "turn",
    "--turn-prefix", "64", "--turn-new", "16", "--repeats", "2", "--label", "turn",
]  # fmt: skip


@pytest.fixture(scope="module")
def turn_result(tiny_qwen3_next_config_dir, tmp_path_factory) -> tuple[dict, str, str]:
    out = tmp_path_factory.mktemp("turn")
    model = ["--model", str(tiny_qwen3_next_config_dir), "--load-format", "dummy"]
    status, stderr = run_bench([*model, *TURN], out)
    assert status == 0, stderr
    [path] = out.glob("*-turn.json")
    return json.loads(path.read_text()), path.with_suffix(".md").read_text(), stderr


def test_every_turn_reuses_exactly_the_conversation(turn_result):
    result, _, _ = turn_result
    section = result["turn"]
    assert (section["prefix_tokens"], section["new_tokens"], section["page_size"]) == (64, 16, 16)
    assert len(section["runs"]) == 2 and section["failures"] == []
    for run in section["runs"]:
        assert run["prime"] == {**run["prime"], "prompt_tokens": 65, "cached_tokens": 0}
        assert run["turn"] == {**run["turn"], "prompt_tokens": 81, "cached_tokens": 64}
        assert run["computed_tokens"] == 17
        assert run["turn_tok_s"] == pytest.approx(17 / run["turn_ttft_s"])
        assert run["prime_tok_s"] == pytest.approx(65 / run["prime_ttft_s"])
    median = section["median"]
    for key in ("prime_ttft_s", "turn_ttft_s", "turn_tok_s"):
        assert median[key] == statistics.median(run[key] for run in section["runs"])
    assert section["ratio_to_cold"] == pytest.approx(median["turn_ttft_s"] / median["prime_ttft_s"])
    # Offline, the engine's two parts of each turn's TTFT (its step outputs), within the TTFT itself.
    for run in section["runs"]:
        parts = run["turn_parts"]
        assert list(parts) == ["queue_s", "prefill_s"] and parts["prefill_s"] > 0 and parts["queue_s"] >= 0
        assert sum(parts.values()) <= run["turn_ttft_s"]


def test_report_and_progress_lines(turn_result):
    result, markdown, stderr = turn_result
    assert "## Agent turn: 16 new tokens on a cached 64-token conversation (+1 token)" in markdown
    assert "every turn found the 64 conversation tokens cached" in markdown
    assert f"| turn | **{result['turn']['median']['turn_ttft_s'] * 1e3:,.0f}** | 64 |" in markdown
    assert stderr.count("morion turn 64+16: run ") == 2 and "(64 cached, " in stderr


def test_a_turn_that_misses_the_cache_fails(tiny_qwen3_next_config_dir, tmp_path, capsys):
    model = ["--model", str(tiny_qwen3_next_config_dir), "--load-format", "dummy"]
    status = main(["bench", *model, *TURN, "--repeats", "1", "--no-prefix-cache", "--out", str(tmp_path)])
    assert status == 1
    err = capsys.readouterr().err
    assert "morion: error: turn FAILED: run 1: the turn found 0 cached tokens, not the conversation's 64" in (
        err
    )
    [path] = tmp_path.glob("*-turn.json")
    assert json.loads(path.read_text())["turn"]["failures"]  # the measurements are kept


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--turn-prefix", "60"], "--turn-prefix must be a multiple of the page size 16"),
        (["--turn-prefix", "480", "--turn-new", "64"], "--turn-prefix + --turn-new needs 546 tokens"),
        (["--turn-new", "0"], "--turn-new must be >= 1, got '0'"),
    ],
)
def test_flag_errors_are_one_line(tiny_qwen3_next_config_dir, tmp_path, capsys, flags, message):
    model = ["--model", str(tiny_qwen3_next_config_dir), "--load-format", "dummy"]
    assert main(["bench", *model, *TURN, *flags, "--out", str(tmp_path)]) == 1
    last = capsys.readouterr().err.splitlines()[-1]  # the length is checked once the engine is built
    assert last.startswith("morion: error: ") and message in last
    assert not list(tmp_path.glob("*.json"))
