"""`morion validate` against a fake server of the tests' own: a cache that answers differently on a hit
makes `restore` fail; an endpoint without render/tokenize still sizes needles exactly (through usage);
tool calls are graded, or reported unsupported; bad arguments are one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from morion.cli import main
from morion.validate import cases as case_files


def _run(capsys, tmp_path: Path, *argv: str) -> tuple[int, dict]:
    status = main(["validate", *argv, "--out", str(tmp_path)])
    err = capsys.readouterr().err
    [path] = tmp_path.glob("*-validate-*.json")
    result = json.loads(path.read_text())
    assert path.with_suffix(".md").exists(), err
    return status, result


def test_restore_fails_when_a_cache_hit_changes_the_answer(fake_server, tmp_path, capsys):
    url, behaviour = fake_server
    behaviour.change_repeats = True
    status, result = _run(capsys, tmp_path, "restore", "--url", url, "--flood-tokens", "64")
    suite = result["suites"]["restore"]
    assert status == 1 and result["verdict"] == "fail" and suite["verdict"] == "fail"
    for case in suite["cases"]:
        assert case["verdict"] == "fail"
        assert "device: text differs from cold" in case["reason"]
        assert case["steps"]["cold"]["content"] == "The answer is 4."  # the first attempt, kept
    # The fake server has no /v1/cache/evict_device: the cases leave its GPU memory through a flood.
    assert suite["events"]["eviction"]["method"] == "flood" and suite["events"]["eviction"]["tokens"] >= 64
    assert suite["case_file"]["sha256"] == case_files.FROZEN["restore-v1.json"]


def test_restore_passes_on_a_consistent_server(fake_server, tmp_path, capsys):
    url, _ = fake_server
    marker = tmp_path / "restarted"
    argv = ("restore", "--url", url, "--flood-tokens", "64", "--restart-cmd", f"touch {marker}")
    status, result = _run(capsys, tmp_path, *argv)
    suite = result["suites"]["restore"]
    assert status == 0 and suite["verdict"] == "pass"
    assert suite["tiers_declared"] == {"host": False, "disk": False}
    assert marker.exists() and suite["steps"] == ["cold", "device", "host", "disk"]
    assert suite["events"]["restart"]["exit_status"] == 0


def test_generated_conversations_count_a_hit_that_changes_a_logprob_as_wrong(fake_server, tmp_path, capsys):
    """Same text, same token count, one log probability different: a wrong answer (the fake's cache hits
    are all on the device: it declares no lower tier, and evicts by flood)."""
    url, behaviour = fake_server
    behaviour.change_repeats = True
    argv = ("restore", "--url", url, "--flood-tokens", "16", "--restore-conversations", "3",
            "--restore-lengths", "20:60", "--restore-group", "3")  # fmt: skip
    status, result = _run(capsys, tmp_path, *argv)
    suite = result["suites"]["restore"]
    assert status == 1 and suite["verdict"] == "fail"
    figures = suite["figures"]
    assert figures["hits"]["device"] == 3 and figures["wrong_by_step"]["device"] == 3
    assert figures["wrong_answers"] == 6  # device and host, three conversations each
    assert "token 0: logprob -0.5 vs -0.25" in suite["cases"][0]["reason"]
    # Sent twice more after its group: both repeats answer as the hits did (every hit is the odd one here).
    # Sent once with a fresh cache salt, it is computed cold again and answers as cold: the cause of both
    # wrong answers is the restore.
    for case in suite["cases"]:
        assert len(case["steps"]["again-host"]) == 2
        assert case["sent_again"]["host"] == {"sent": 2, "as_hit": 2, "as_cold": 0}
        assert case["causes"] == {"device": "restore", "host": "restore"}
        salted = case["steps"]["cold-here-host"]
        assert case["cold_here"]["host"] == {
            "text": "x", "token_logprobs": [-0.25], "token_ids": None, "completion_tokens": 1,
            "cache_salt": salted["cache_salt"],
        }  # fmt: skip
        assert salted["cached_tokens"] == 0 and len(salted["cache_salt"]) == 32
    assert figures["wrong_by_cause"] == {"restore": 6, "process": 0, "neither": 0, "unknown": 0}
    reason = suite["cases"][0]["reason"]
    assert "sent again 2: 2 as this hit, 0 as cold; cold here answers as cold: restore" in reason
    report = (tmp_path / next(tmp_path.glob("*.md")).name).read_text()
    assert "**6 hits, 6 wrong answers**" in report and "restore 6, process 0, neither 0, unknown 0" in report
    assert "| device: restore, host: restore |" in report


def test_a_one_off_wrong_hit_is_sent_again_and_the_repeats_answer_as_cold(fake_server, tmp_path, capsys):
    """Only the third request of each prompt (its host hit) answers otherwise: the two repeats sent after
    the group answer as cold, which says the host hit was the odd run, not the cold one."""
    url, behaviour = fake_server
    behaviour.odd_repeat = 2
    argv = ("restore", "--url", url, "--flood-tokens", "16", "--restore-conversations", "2",
            "--restore-lengths", "20:60", "--restore-group", "2")  # fmt: skip
    status, result = _run(capsys, tmp_path, *argv)
    suite = result["suites"]["restore"]
    assert status == 1 and suite["figures"]["wrong_by_step"] == {"device": 0, "host": 2, "disk": 0}
    for case in suite["cases"]:
        assert case["sent_again"] == {"host": {"sent": 2, "as_hit": 0, "as_cold": 2}}
        assert "sent again 2: 0 as this hit, 2 as cold" in case["reason"]


def test_a_wrong_disk_hit_that_the_restarted_process_computes_alike_cold_is_a_process_cause(
    fake_server, tmp_path, capsys
):
    """The restarted fake computes every prompt otherwise: its disk hits differ from cold, and so does the
    prompt computed cold there (salted). The restore was exact; the wrong answers still fail."""
    url, behaviour = fake_server
    marker = tmp_path / "restarted"
    behaviour.restart_marker = marker
    argv = ("restore", "--url", url, "--flood-tokens", "16", "--restore-conversations", "2",
            "--restore-lengths", "20:60", "--restore-group", "2",
            "--restart-cmd", f"touch {marker}")  # fmt: skip
    status, result = _run(capsys, tmp_path, *argv)
    suite = result["suites"]["restore"]
    assert status == 1 and suite["verdict"] == "fail"
    figures = suite["figures"]
    assert figures["wrong_by_step"] == {"device": 0, "host": 0, "disk": 2}
    assert figures["wrong_by_cause"] == {"restore": 0, "process": 2, "neither": 0, "unknown": 0}
    for case in suite["cases"]:
        assert case["causes"] == {"disk": "process"} and "cold-here-host" not in case["steps"]
        assert case["cold_here"]["disk"]["token_logprobs"] == [-0.5]
        assert case["steps"]["disk"]["token_logprobs"] == [-0.5]
        assert "cold here answers as this hit: process (the restore is exact" in case["reason"]
    report = (tmp_path / next(tmp_path.glob("*.md")).name).read_text()
    assert "restore 0, process 2, neither 0, unknown 0" in report and "| disk: process |" in report


@pytest.mark.parametrize("salts", ["reject", "ignore"])
def test_a_server_without_cache_salt_leaves_wrong_answers_without_a_cause(
    fake_server, tmp_path, capsys, salts
):
    """An older server refuses the field (400) or ignores it (the salted prompt is a hit): said once, and
    every wrong answer's cold_here is "unavailable"; the run goes on and fails on the wrong answers."""
    url, behaviour = fake_server
    behaviour.change_repeats, behaviour.salts = True, salts
    argv = ["validate", "restore", "--url", url, "--flood-tokens", "16", "--restore-conversations", "3",
            "--restore-lengths", "20:60", "--restore-group", "3", "--out", str(tmp_path)]  # fmt: skip
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("wrong answers get no cause") == 1, err
    [path] = tmp_path.glob("*-validate-*.json")
    suite = json.loads(path.read_text())["suites"]["restore"]
    assert suite["figures"]["wrong_by_cause"] == {"restore": 0, "process": 0, "neither": 0, "unknown": 6}
    assert ("rejected" if salts == "reject" else "ignored") in suite["events"]["cold_here_unavailable"]
    for case in suite["cases"]:
        assert case["cold_here"] == {"device": "unavailable", "host": "unavailable"}
        assert "cold here unavailable (the server takes no cache_salt): unknown" in case["reason"]


def test_needle_sizes_through_usage_without_render_or_tokenize(fake_server, tmp_path, capsys):
    url, _ = fake_server
    status, result = _run(capsys, tmp_path, "needle", "--url", url, "--needle-lengths", "200,333")
    suite = result["suites"]["needle"]
    assert status == 0 and suite["verdict"] == "pass"
    assert suite["counted_by"] == "usage"
    assert set(suite["count_methods_unavailable"]) == {"render", "tokenize", "tokenizer"}
    assert len(suite["cases"]) == 2 * len(case_files.load("needle").data["cases"])
    for case in suite["cases"]:
        assert case["counted_tokens"] == case["target_tokens"] == case["reply"]["usage"]["prompt_tokens"]
        assert case["follow_up"]["passed"] and len(case["prompt_sha256"]) == 64
    assert result["server"]["server_info"] is None and result["server"]["models_listed"] == ["fake"]


def test_tools_graded_exactly(fake_server, tmp_path, capsys):
    url, _ = fake_server
    status, result = _run(capsys, tmp_path, "tools", "--url", url)
    suite = result["suites"]["tools"]
    assert status == 0 and suite["verdict"] == "pass", suite
    chained = next(case for case in suite["cases"] if case["id"] == "chained-lookup")
    assert [call["name"] for call in chained["calls"]] == ["lookup_customer", "list_orders"]
    assert len(chained["turns"]) == 3  # two tool turns, then the answer


def test_tools_unsupported_when_rejected(fake_server, tmp_path, capsys):
    url, behaviour = fake_server
    behaviour.tools = "reject"
    status, result = _run(capsys, tmp_path, "tools", "--url", url)
    assert status == 0  # unsupported is reported, not a failure, and never called a pass
    assert result["suites"]["tools"]["verdict"] == "unsupported"
    assert result["verdict"] == "unsupported"
    assert "**UNSUPPORTED**" in next(tmp_path.glob("*.md")).read_text()


def test_tools_fail_when_accepted_but_never_called(fake_server, tmp_path, capsys):
    url, behaviour = fake_server
    behaviour.tools = "never"
    status, result = _run(capsys, tmp_path, "tools", "--url", url)
    suite = result["suites"]["tools"]
    assert status == 1 and result["verdict"] == "fail" and suite["verdict"] == "fail"
    assert "accepted tools but the model answered the probe without a tool call" in suite["reason"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["speed", "--url", "http://127.0.0.1:9"], "unknown suite 'speed'"),
        (["needle"], "--url is required"),
        ([], "name at least one suite"),
        (["soak", "--url", "http://127.0.0.1:9", "--soak-clients", "0"], "--soak-clients must be >= 1"),
        (["needle", "--url", "http://127.0.0.1:9", "--needle-lengths", "x"], "--needle-lengths must be"),
        (["needle", "--url", "ftp://x"], "--url must start with http://"),
    ],
)
def test_bad_arguments_are_one_line(argv, message, capsys):
    assert main(["validate", *argv]) == 1
    err = capsys.readouterr().err
    assert err.startswith("morion: error: ") and err.count("\n") == 1 and message in err


def test_unknown_case_id_is_one_line(fake_server, capsys):
    url, _ = fake_server
    assert main(["validate", "needle", "--url", url, "--cases", "nope"]) == 1
    err = capsys.readouterr().err
    assert err == "morion: error: --cases names no case of the chosen suites: nope\n"


def test_case_files_are_frozen():
    for suite in case_files.CURRENT:
        assert case_files.load(suite).sha256 == case_files.FROZEN[case_files.CURRENT[suite]]


def test_soak_with_token_id_prompts(fake_server, tmp_path, capsys):
    """For a server without a tokenizer: blocks of token ids on /v1/completions, the history growing."""
    url, _ = fake_server
    argv = ("soak", "--url", url, "--soak-prompts", "token-ids", "--soak-turn-tokens", "32",
            "--soak-clients", "2", "--soak-max-requests", "6")  # fmt: skip
    status, result = _run(capsys, tmp_path, *argv)
    suite = result["suites"]["soak"]
    assert status == 0 and suite["verdict"] == "pass", suite["reason"]
    records = suite["requests"]
    assert len(records) == 6 and all(r["completion_tokens"] == 1 for r in records)
    by_client = {}
    for record in records:
        by_client.setdefault((record["client"], record["conversation"]), []).append(record["prompt_tokens"])
    assert any(lengths[:2] == [32, 64] for lengths in by_client.values())  # a block a turn


@pytest.mark.parametrize(
    ("leak_mib", "cache_mib", "verdict"),
    [(4, 0, "fail"), (0, 4, "pass"), (4, 4, "fail")],
    ids=["a-leak", "caches-filling", "a-leak-beside-filling-caches"],
)
def test_soak_memory_bound_catches_a_leak_but_not_filling_caches(
    fake_server, tmp_path, capsys, leak_mib, cache_mib, verdict
):
    """The server's real resident memory grows by 4 MiB a request (48 MiB over the soak, bound 24). Memory
    it reports as its caches' (`morion_engine_cache_memory_bytes`, bounded by design) is not a leak; the
    same growth unreported is, also when reported cache growth runs beside it."""
    url, behaviour = fake_server
    behaviour.leak_bytes, behaviour.cache_bytes = leak_mib * 2**20, cache_mib * 2**20
    argv = ("soak", "--url", url, "--soak-prompts", "token-ids", "--soak-turn-tokens", "8",
            "--soak-clients", "2", "--soak-max-requests", "12", "--soak-max-growth-mib", "24")  # fmt: skip
    status, result = _run(capsys, tmp_path, *argv)
    soak = result["suites"]["soak"]
    figures = soak["figures"]
    assert soak["verdict"] == verdict and status == (1 if verdict == "fail" else 0), figures
    assert figures["resident_growth_mib"] >= 12 * (leak_mib + cache_mib) * 0.9
    if cache_mib:
        assert figures["cache_memory_growth_mib"] == 12 * cache_mib
        assert figures["memory_metric"].endswith("- morion_engine_cache_memory_bytes")
        assert figures["memory_growth_mib"] == figures["resident_growth_mib"] - 12 * cache_mib
    else:
        assert figures["cache_memory_growth_mib"] is None and figures["memory_metric"] == (
            "process_resident_memory_bytes"
        )
    if verdict == "fail":
        assert "resident memory grew" in soak["reason"]


def test_soak_beside_restore_measures_its_end_once_restore_traffic_is_over(fake_server, tmp_path, capsys):
    """Memory is compared between two idle points: the soak's clients stop after 2 requests, restore goes
    on (6 conversations, 3 steps each), and the soak reads /metrics for its end only after all of it."""
    url, behaviour = fake_server
    behaviour.cache_bytes = 64  # /metrics exported
    argv = ("restore", "soak", "--url", url, "--soak-during-restore", "--soak-prompts", "token-ids",
            "--soak-turn-tokens", "8", "--soak-clients", "1", "--soak-max-requests", "2",
            "--restore-conversations", "6", "--restore-lengths", "20:40", "--flood-tokens", "16")  # fmt: skip
    status, result = _run(capsys, tmp_path, *argv)
    assert status == 0 and result["suites"]["soak"]["figures"]["requests"] == 2
    events = behaviour.events
    assert events.count("completion") >= 2 + 6 * 3 and events.count("metrics") == 2  # the soak's start, end
    last_completion = len(events) - 1 - events[::-1].index("completion")
    assert events[last_completion + 1 :] == ["metrics"]  # (the start may race restore's first request)


def test_soak_runs_beside_restore_and_ends_before_the_restart(fake_server, tmp_path, capsys):
    url, _ = fake_server
    marker = tmp_path / "restarted"
    argv = ("restore", "soak", "--url", url, "--soak-during-restore", "--soak-prompts", "token-ids",
            "--soak-turn-tokens", "8", "--soak-clients", "2", "--soak-minutes", "0.05",
            "--restore-conversations", "2", "--restore-lengths", "20:40", "--flood-tokens", "16",
            "--restart-cmd", f"touch {marker}")  # fmt: skip
    status, result = _run(capsys, tmp_path, *argv)
    restore, soak = result["suites"]["restore"], result["suites"]["soak"]
    assert status == 0 and restore["verdict"] == "pass" and soak["verdict"] == "pass", soak["reason"]
    assert soak["figures"]["requests"] > 0 and marker.exists()
    assert "--soak-during-restore" in result["provenance"]["command"].split()


def test_resume_sends_only_the_disk_step_of_an_earlier_run(fake_server, tmp_path, capsys):
    """A restart outside validate (another process, a later device call): the disk step of the earlier run's
    conversations, graded with the earlier answers."""
    url, behaviour = fake_server
    argv = ("restore", "--url", url, "--flood-tokens", "16", "--restore-conversations", "3",
            "--restore-lengths", "20:60", "--restore-group", "3", "--label", "first")  # fmt: skip
    status, first = _run(capsys, tmp_path / "first", *argv)
    assert status == 0 and "disk" not in first["suites"]["restore"]["cases"][0]["steps"]
    [earlier] = (tmp_path / "first").glob("*.json")
    sent_before = sum(behaviour.seen.values())
    argv = ("restore", "--url", url, "--restore-resume", str(earlier))
    status, second = _run(capsys, tmp_path / "second", *argv)
    suite = second["suites"]["restore"]
    assert status == 0 and suite["verdict"] == "pass" and suite["seed"] == first["suites"]["restore"]["seed"]
    assert sum(behaviour.seen.values()) - sent_before == 3  # the disk step only
    assert [set(c["steps"]) for c in suite["cases"]] == [{"cold", "device", "host", "disk"}] * 3
    assert suite["events"]["resumed_from"] == earlier.name
    bad = ["validate", "restore", "--url", url, "--restore-resume", str(tmp_path / "none.json")]
    assert main([*bad, "--out", str(tmp_path / "third")]) == 1
    assert "no restore suite to resume" in capsys.readouterr().err
    assert not (tmp_path / "third").exists()  # refused before any suite ran
