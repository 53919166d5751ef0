"""`morion bench --url` against a real `morion serve` subprocess on the tiny Llama (started as in
tests/server: loopback only, a free port, bounded waits), and against a URL where nothing listens."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from morion.cli import main
from tests.server.conftest import free_port, start_server, stop

API_KEY = "bench-key"


@pytest.fixture(scope="module")
def tiny_server(tiny_llama, tmp_path_factory) -> Iterator[tuple[str, Path]]:
    """(base URL, model directory) of a server on the tiny Llama, which has no tokenizer: token-id
    prompts only, and no text to time tokens by."""
    log_path = tmp_path_factory.mktemp("bench_server") / "serve.log"
    args = ["--model", str(tiny_llama.path), "--device", "cpu", "--kv-cache-tokens", "4096"]
    running = start_server(args, log_path, api_key=API_KEY)
    try:
        yield running.base_url, tiny_llama.path
    finally:
        stop(running)


def _bench(tiny_server, tmp_path, capsys, *flags: str) -> tuple[dict, Path]:
    base_url, model_dir = tiny_server
    common = ["--url", base_url, "--api-key", API_KEY, "--model", str(model_dir), "--out", str(tmp_path)]
    assert main(["bench", *common, *flags]) == 0, capsys.readouterr().err
    [path] = tmp_path.glob("*.json")
    return json.loads(path.read_text()), path


def test_bench_against_a_server(tiny_server, tmp_path, capsys):
    _, model_dir = tiny_server
    result, path = _bench(
        tiny_server, tmp_path, capsys, "--concurrency", "1,2", "--contexts", "32", "--output-tokens", "8",
        "--repeats", "2", "--prefill-lengths", "32", "--ttft-length", "32",
    )  # fmt: skip
    assert result["mode"] == "url" and result["status"] == "complete"
    target = result["target"]
    assert target["served_model"] == model_dir.name
    assert target["prompt_format"] == "token_ids"
    assert target["token_timing"] == "logprobs"  # no tokenizer: no text chunks to time
    assert target["server_info"]["model"]["vocab_size"] == 128
    assert API_KEY not in path.read_text()
    for point in result["decode"]:
        assert point["engine"] == "server"
        for run in point["runs"]:
            assert len(run["requests"]) == point["concurrency"]
            for request in run["requests"]:
                assert request["completion_tokens"] == 8 and request["prompt_tokens"] == 32
                assert request["cached_tokens"] == 0
                assert request["decode_tok_s"] > 0 and request["ttft_s"] > 0
            # The server's engine counted its steps of the run (its /metrics, read before and after): 7
            # decode steps when the requests run in step, up to 7 each where one's prefill came a step late.
            steps = run["engine_steps"]["decode_steps"]
            assert steps == 7 if point["concurrency"] == 1 else 7 <= steps <= 7 * point["concurrency"]
            assert run["engine_decode_step_ms"] > 0
            assert isinstance(run["engine_steps"]["loop_overhead_ms_per_step"], float)
    assert all(run["cached_tokens"] == 0 for p in [*result["prefill"], result["ttft"]] for run in p["runs"])
    # The server's engine thread during each prefill (its own split, exported in /metrics): this Linux
    # machine keeps the scheduler's statistics, so each run has it, within the engine's prefill part.
    for run in result["prefill"][0]["runs"]:
        thread, prefill = run["engine_thread"], run["ttft_parts"]["prefill_s"]
        assert thread["on_cpu_s"] > 0 and thread["runqueue_s"] >= 0 and thread["off_cpu_s"] >= 0
        busy = thread["on_cpu_s"] + thread["runqueue_s"]
        assert sum(thread.values()) == pytest.approx(max(prefill, busy))
    # The roofline comes from the model's config (--model), in the dtype the server reports (CPU: fp32);
    # the server is on a CPU, whose peaks are unknown: no bound, and the files say why (never an H200's).
    assert result["roofline"]["model"]["source"] == "config"
    assert result["roofline"]["model"]["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4
    assert result["roofline"]["device"] == "cpu"
    assert result["roofline"]["bandwidth_gbs"] is None and "unknown for cpu" in result["roofline"]["note"]
    assert result["decode"][0]["roofline"] is None and result["decode"][0]["mbu"] is None
    markdown = path.with_suffix(".md").read_text()
    assert "| server | 2 | 32 |" in markdown
    assert "Bandwidth unknown" in markdown and "4300" not in markdown


def test_bench_url_bound_from_the_flags(tiny_server, tmp_path, capsys):
    result, _ = _bench(
        tiny_server, tmp_path, capsys, "--workloads", "decode", "--concurrency", "1", "--contexts", "32",
        "--output-tokens", "4", "--repeats", "1", "--bandwidth-gbs", "50", "--peak-tflops", "1",
    )  # fmt: skip
    roof = result["roofline"]
    assert roof["bandwidth_gbs"] == 50 and roof["peaks_source"] == "the command line"
    assert result["decode"][0]["roofline"]["per_request_tok_s"] > 0


def test_wrong_api_key_is_one_line(tiny_server, capsys):
    base_url, _ = tiny_server
    assert main(["bench", "--url", base_url, "--api-key", "wrong", "--workloads", "ttft"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("morion: error: ") and err.count("\n") == 1
    assert "rejected the API key" in err


def test_unreachable_url_is_one_line(tmp_path, capsys):
    port = free_port()  # nothing listens there once the probe socket is closed
    status = main(["bench", "--url", f"http://127.0.0.1:{port}", "--out", str(tmp_path)])
    assert status == 1
    err = capsys.readouterr().err
    assert err.startswith(f"morion: error: cannot reach http://127.0.0.1:{port}") and err.count("\n") == 1
    assert not list(tmp_path.iterdir())  # nothing written


def test_an_agent_turn_through_the_server_reuses_the_conversation(tiny_server, tmp_path, capsys):
    result, path = _bench(
        tiny_server, tmp_path, capsys, "--workloads", "turn", "--turn-prefix", "64", "--turn-new", "16",
        "--repeats", "1",
    )  # fmt: skip
    section = result["turn"]
    assert section["page_size"] == 16  # the server's, from /v1/server_info: the hit is checked
    [run] = section["runs"]
    assert run["prime"]["cached_tokens"] == 0
    assert (run["turn"]["cached_tokens"], run["computed_tokens"]) == (64, 17)
    markdown = path.with_suffix(".md").read_text()
    assert "every turn found the 64 conversation tokens cached" in markdown
    # The turn's TTFT by part, from the server's histograms read around it: every part, which together
    # cannot exceed the client's TTFT (the client's clock starts first and stops last).
    parts = run["turn_parts"]
    assert list(parts) == ["prepare_s", "to_engine_s", "queue_s", "prefill_s", "from_engine_s"]
    assert all(seconds >= 0 for seconds in parts.values()) and parts["prefill_s"] > 0
    assert sum(parts.values()) <= run["turn_ttft_s"]
    assert section["turn_parts"] == parts  # the median of one run
    assert "The turn's TTFT by part (medians): front end " in markdown
    assert "to the engine (pipe, loop)" in markdown
