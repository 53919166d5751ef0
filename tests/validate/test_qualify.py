"""`python -m morion.validate.qualify`: a validate run and an offline bench run into one qualification."""

from __future__ import annotations

import json
from pathlib import Path

from morion.validate.qualify import main

PROVENANCE = {"command": "morion validate restore soak perf", "git_commit": "abc", "gpus": [], "date": "d"}


def _median(per_request: float, aggregate: float, ttft: float) -> dict[str, float]:
    return {"per_request_tok_s": per_request, "aggregate_tok_s": aggregate, "ttft_s": ttft, "step_s": 0.01}


def _validate(wrong: int = 0, host_hits: int = 100) -> dict:
    restore = {
        "verdict": "fail" if wrong else "pass",
        "lengths": {"min": 1024, "max": 65536, "drawn": [1024]},
        "figures": {
            "conversations": 100,
            "hits": {"device": 100, "host": host_hits, "disk": 100},
            "hits_total": 200 + host_hits,
            "wrong_answers": wrong,
            "wrong_by_step": {"device": 0, "host": wrong, "disk": 0},
            "median_ttft_s": {"cold": 1.0, "device": 0.03, "host": 0.2, "disk": 0.5},
        },
        "cases": [
            {"id": f"conversation-{i}", "prompt_tokens": 4732, "wrong": ["host"], "reason": "host: differs"}
            for i in range(wrong)
        ],
    }
    soak = {
        "verdict": "pass",
        "figures": {
            "requests": 300, "errors": 0, "empty": 0, "truncated": 0, "elapsed_s": 301.0,
            "memory_growth_mib": 12.0, "idle": {"pages_held": 0}, "drift": {},
        },
    }  # fmt: skip
    decode = [
        {"concurrency": c, "context": 1024, "median": _median(p, a, t)}
        for c, p, a, t in ((1, 112.0, 110.0, 0.25), (4, 95.0, 340.0, 0.3), (8, 80.0, 600.0, 0.4))
    ]
    perf = {"verdict": "pass", "decode": decode, "prefill": [{"prompt_tokens": 1024, "median": {}}]}
    return {
        "date": "2026-12-01",
        "provenance": PROVENANCE,
        "server": {},
        "suites": {"restore": restore, "soak": soak, "perf": perf},
    }


def _offline() -> dict:
    decode = [
        {"concurrency": c, "context": 1024, "median": _median(p, a, t)}
        for c, p, a, t in ((1, 114.8, 112.0, 0.22), (4, 100.0, 337.0, 0.25), (8, 90.0, 700.0, 0.3))
    ]
    return {"provenance": {"command": "morion bench ..."}, "decode": decode}


def _run(tmp_path: Path, validate: dict, *extra: str, offline: dict | None = None) -> tuple[int, dict, str]:
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "v.json").write_text(json.dumps(validate))
    (tmp_path / "b.json").write_text(json.dumps(offline or _offline()))
    argv = ["--validate", str(tmp_path / "v.json"), "--offline", str(tmp_path / "b.json"),
            "--label", "h200-qualify-test", "--out", str(tmp_path / "out"), *extra]  # fmt: skip
    status = main(argv)
    [path] = (tmp_path / "out").glob("*.json")
    return status, json.loads(path.read_text()), path.with_suffix(".md").read_text()


def test_a_clean_run_passes_with_the_ratios_against_offline(tmp_path):
    status, result, report = _run(tmp_path, _validate())
    summary = result["summary"]
    assert status == 0 and summary["verdict"] == "pass" and summary["problems"] == []
    c1, _, c8 = summary["perf"]["decode"]
    assert abs(c1["ratios"]["per_request_tok_s"] - 112.0 / 114.8) < 1e-9
    assert c1["targets"]["per_request_tok_s"]["met"] is True  # 0.976 >= 0.97
    assert c8["targets"]["aggregate_tok_s"]["met"] is False  # 600 / 700 < 0.9: reported, not failing
    assert "**300 hits, 0 wrong answers.**" in report and "0.86 ✗" in report
    assert (
        result["label"] == "h200-qualify-test"
        and (tmp_path / "out" / "2026-12-01-h200-qualify-test.md").exists()
    )


def test_a_rate_the_server_could_not_measure_has_no_ratio_and_no_mark(tmp_path):
    """A loaded CPU can deliver a request's tokens in one read: no post-first-token rate (None), which
    must neither crash the summary nor read as a met or missed target."""
    validate = _validate()
    validate["suites"]["perf"]["decode"][0]["median"]["per_request_tok_s"] = None
    status, result, report = _run(tmp_path, validate)
    c1 = result["summary"]["perf"]["decode"][0]
    assert status == 0 and "per_request_tok_s" not in c1["ratios"]
    assert c1["targets"]["per_request_tok_s"]["met"] is None
    assert "| 1 | 1,024 | — | 114.8 | — |" in report


def test_a_wrong_answer_or_too_few_hits_fails(tmp_path):
    status, result, report = _run(tmp_path, _validate(wrong=1))
    assert status == 1 and "1 wrong answers" in result["summary"]["problems"]
    assert "- conversation-0 (4,732 tokens; cause —): host: differs" in report  # each wrong answer, listed
    status, result, _ = _run(tmp_path / "b", _validate(host_hits=99))
    assert status == 1 and result["summary"]["problems"] == ["fewer than 100 hits: host 99"]


def test_restore_and_perf_from_two_validate_runs_are_merged(tmp_path):
    """The script's two device calls: restore + soak in one validate run, perf in another."""
    whole = _validate()
    restored = {**whole, "suites": {k: v for k, v in whole["suites"].items() if k != "perf"}}
    perf = {**whole, "suites": {"perf": whole["suites"]["perf"]}}
    (tmp_path / "r.json").write_text(json.dumps(restored))
    (tmp_path / "p.json").write_text(json.dumps(perf))
    (tmp_path / "b.json").write_text(json.dumps(_offline()))
    argv = ["--validate", str(tmp_path / "r.json"), "--validate", str(tmp_path / "p.json"), "--offline",
            str(tmp_path / "b.json"), "--label", "q", "--out", str(tmp_path / "out")]  # fmt: skip
    assert main(argv) == 0
    [path] = (tmp_path / "out").glob("*.json")
    result = json.loads(path.read_text())
    assert result["summary"]["verdict"] == "pass" and len(result["summary"]["perf"]["decode"]) == 3
    assert result["sources"]["validate"] == "r.json, p.json"


def test_a_miss_computed_again_is_counted_apart_from_wrong_hits(tmp_path):
    """A recorded generated-conversation suite is graded again: a disk step that missed (0 cached tokens)
    and recomputed another answer is not a wrong hit, but the step still fails for want of a hit."""
    cold = {
        "text": "",
        "token_logprobs": [-1.0],
        "token_ids": None,
        "completion_tokens": 1,
        "cached_tokens": 0,
    }
    hit = {**cold, "cached_tokens": 48}
    steps = {"cold": cold, "device": hit, "host": hit, "disk": {**cold, "token_logprobs": [-2.0]}}
    validate = _validate_with_one_conversation(steps)
    status, result, report = _run(tmp_path, validate, "--min-hits", "1", "--source-commit", "abc123")
    restore = result["summary"]["restore"]
    assert status == 1 and restore["wrong_answers"] == 0 and restore["hits"]["disk"] == 0
    assert restore["recomputed_differently_by_step"]["disk"] == 1
    assert result["summary"]["problems"][0] == "fewer than 1 hits: disk 0"
    assert result["provenance"]["git_commit"] == "abc123"
    assert result["provenance"]["git_commit_recorded_by_the_runs"] == "abc"
    assert "| disk | 0 | 0 | 1 |" in report


def _validate_with_one_conversation(steps: dict) -> dict:
    """A validate run whose restore suite holds one 50-token conversation with these steps' replies."""
    suite = {
        "seed": 1,
        "verdict": "pass",
        "lengths": {"min": 50, "max": 60, "drawn": [50]},
        "page_size": 16,
        "tiers_declared": {"host": True, "disk": True},
        "cases": [{"id": "conversation-0", "prompt_tokens": 50, "prompt_sha256": "x", "steps": steps}],
    }
    return {**_validate(), "suites": {**_validate()["suites"], "restore": suite}}


def test_a_wrong_answer_fails_whatever_its_cause_and_the_report_names_it(tmp_path):
    """Graded again from its replies: a disk hit differs from cold, and the prompt computed cold in the
    restarted process (salted) answers as the hit: cause "process", and still a failure."""
    cold = {"text": "", "token_logprobs": [-1.0], "token_ids": None, "completion_tokens": 1}
    cold["cached_tokens"] = 0
    hit = {**cold, "cached_tokens": 48}
    other = {**hit, "token_logprobs": [-2.0]}
    steps = {
        "cold": cold, "device": hit, "host": hit, "disk": other, "again-disk": [other, other],
        "cold-here-disk": {**other, "cached_tokens": 0, "cache_salt": "f00d"},
    }  # fmt: skip
    validate = _validate_with_one_conversation(steps)
    status, result, report = _run(tmp_path, validate, "--min-hits", "1")
    restore = result["summary"]["restore"]
    assert status == 1 and result["summary"]["problems"][0] == "1 wrong answers (process 1)"
    assert restore["wrong_by_cause"] == {"restore": 0, "process": 1, "neither": 0, "unknown": 0}
    assert restore["wrong_cases"][0]["causes"] == {"disk": "process"}
    assert "restore 0, process 1, neither 0, unknown 0" in report
    assert "- conversation-0 (50 tokens; cause disk process): disk: answer differs from cold" in report


def _turn_bench(turn_ttft_s: float) -> dict:
    """What `morion bench --url ... --workloads turn` writes (its `turn` section)."""
    return {
        "turn": {
            "prefix_tokens": 32768,
            "new_tokens": 1024,
            "runs": [{"repeat": 0}, {"repeat": 1}],
            "median": {"prime_ttft_s": 2.0, "turn_ttft_s": turn_ttft_s},
            "ratio_to_cold": turn_ttft_s / 2.0,
            "failures": [],
        }
    }


def test_an_agent_turn_is_reported_beside_its_target_without_deciding_the_verdict(tmp_path):
    """Issue #24's turn through the server: its TTFT against the target, ✓ or ✗, the verdict unchanged."""
    for ttft, mark, met in ((0.08, "✓", True), (0.25, "✗", False)):
        case = tmp_path / mark
        case.mkdir()
        (case / "t.json").write_text(json.dumps(_turn_bench(ttft)))
        extra = ("--turn", str(case / "t.json"), "--turn-target-ms", "100")
        status, result, report = _run(case, _validate(), *extra)
        turn = result["summary"]["turn"]
        assert status == 0 and result["summary"]["verdict"] == "pass"
        assert turn["met"] is met and turn["repeats"] == 2 and turn["target_ttft_s"] == 0.1
        assert f"turn TTFT **{ttft * 1000:.0f} ms** (target <= 100 ms {mark})" in report
        assert result["sources"]["turn"] == "t.json"
    status, result, report = _run(tmp_path / "none", _validate())
    assert result["summary"]["turn"] is None and "agent turn" not in report


def test_the_offline_turn_of_the_same_shape_stands_beside_the_servers(tmp_path):
    """The offline bench's turn (same engine flags and machine) is what the server adds to: reported
    beside the server's when it is the same conversation shape, left out when it is not."""
    (tmp_path / "t.json").write_text(json.dumps(_turn_bench(0.2)))
    extra = ("--turn", str(tmp_path / "t.json"), "--turn-target-ms", "100")
    same = {**_offline(), **_turn_bench(0.13)}
    status, result, report = _run(tmp_path / "same", _validate(), *extra, offline=same)
    assert status == 0 and result["summary"]["turn"]["offline_turn_ttft_s"] == 0.13
    assert "cold 2,000 ms (ratio 0.100); offline, same flags: turn TTFT 130 ms. Reported" in report
    other = {**_offline(), "turn": {**_turn_bench(0.13)["turn"], "prefix_tokens": 16384}}
    status, result, report = _run(tmp_path / "other", _validate(), *extra, offline=other)
    assert result["summary"]["turn"]["offline_turn_ttft_s"] is None and "offline, same flags" not in report


def test_the_turns_ttft_by_part_through_the_server_and_offline(tmp_path):
    """Where each turn's TTFT went (bench/first_token_parts.py): the server's four parts beside the
    offline engine's two, so what the server adds reads off the report."""
    served = _turn_bench(0.2)
    served["turn"]["turn_parts"] = {"prepare_s": 0.004, "queue_s": 0.0, "prefill_s": 0.14, "handoff_s": 0.05}
    offline = {**_offline(), **_turn_bench(0.15)}
    offline["turn"]["turn_parts"] = {"queue_s": 0.0, "prefill_s": 0.141}
    (tmp_path / "t.json").write_text(json.dumps(served))
    status, result, report = _run(tmp_path, _validate(), "--turn", str(tmp_path / "t.json"), offline=offline)
    assert status == 0 and result["summary"]["turn"]["turn_parts"]["handoff_s"] == 0.05
    assert (
        "Through the server, the turn's TTFT by part (medians): front end 4 ms, engine queue 0 ms, engine "
        "prefill 140 ms, hand-over (pipes, loops) 50 ms."
    ) in report
    assert "Offline, the turn's TTFT by part (medians): engine queue 0 ms, engine prefill 141 ms." in report


def test_the_perf_servers_forwards_are_reported_by_kind_graph_and_eager(tmp_path):
    validate = _validate()
    validate["suites"]["perf"]["forwards"] = {
        "decode/graph": 1200, "decode/eager": 3, "short/graph": 4, "short/eager": 0, "prefill/graph": 4,
        "prefill/eager": 1, "verify/graph": 0, "verify/eager": 0,
    }  # fmt: skip
    status, result, report = _run(tmp_path, validate)
    assert status == 0 and result["summary"]["perf"]["forwards"]["prefill/eager"] == 1
    assert (
        "replayed from a CUDA graph / eager: decode 1,200 / 3; short 4 / 0; prefill 4 / 1; verify 0 / 0."
    ) in report
    _, _, without = _run(tmp_path / "none", _validate())
    assert "replayed from a CUDA graph" not in without


def test_the_cold_prefill_points_through_the_server_are_tabled(tmp_path):
    validate = _validate()
    validate["suites"]["perf"]["prefill"] = [
        {"prompt_tokens": 1024, "median": {"ttft_s": 0.095, "prefill_tok_s": 10778.9}},
        {"prompt_tokens": 65536, "median": {"ttft_s": 2.9, "prefill_tok_s": 22598.6}},
    ]
    status, result, report = _run(tmp_path, validate)
    assert status == 0 and [p["prompt_tokens"] for p in result["summary"]["perf"]["prefill"]] == [1024, 65536]
    assert "| 1,024 | 95 | 10,778.9 |" in report
    assert "| 65,536 | 2,900 | 22,598.6 |" in report
