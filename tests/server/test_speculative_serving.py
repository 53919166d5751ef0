"""Speculative decoding through a real `morion serve` (n-gram drafts, fixed width 3) on the default model:
the greedy answer equals the shared server's without speculation, /metrics counts drafts and acceptance
(and reads zero where speculation is off), /v1/server_info names the method."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

WIDTH = 3
# A line to repeat: the answer copies it, so the n-gram drafter finds it in the conversation.
LINE = "total = total + values[index] * weights[index]\n"
MESSAGES = [{"role": "user", "content": "Repeat this line of code exactly, five times:\n" + LINE * 3}]
COUNTERS = ("verify_steps", "drafted_tokens", "accepted_tokens", "emitted_tokens")


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory, server_control):
    directory = tmp_path_factory.mktemp("spec_server")
    # The shared server's engine settings (same prefill chunks: same numerics), plus speculation.
    flags = ["--device", "cpu", "--kv-cache-tokens", "8192", "--chunk-size", "512"]
    flags += ["--served-model-name", "smollm2", "--speculative", "ngram", "--spec-width", str(WIDTH)]
    running = server_control.start(flags, directory / "serve.log")
    yield running
    assert server_control.stop(running) == 0, running.log()


def _metrics(server) -> dict[str, float]:
    """Every sample of /metrics by its series (name and labels)."""
    with server.http() as http:
        text = http.get("/metrics").text
    samples = (line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    return {series: float(value) for series, value in samples}


def _answer(server) -> tuple[str, str, int]:
    with server.openai() as client:
        reply = client.chat.completions.create(
            model="smollm2", messages=MESSAGES, max_tokens=48, temperature=0
        )
    choice = reply.choices[0]
    return choice.message.content, choice.finish_reason, reply.usage.completion_tokens


@pytest.fixture(scope="module")
def exchange(server, spec_server) -> dict:
    """The same greedy request to both servers (the speculative server's only request), and the speculative
    server's /metrics after it."""
    answer = _answer(spec_server)
    return {"plain": _answer(server), "speculative": answer, "metrics": _metrics(spec_server)}


def test_greedy_answer_equals_the_answer_without_speculation(exchange):
    content, _, tokens = exchange["speculative"]
    assert LINE.strip() in content and tokens > 8  # it did repeat the line
    assert exchange["speculative"] == exchange["plain"]


def test_metrics_count_drafts_and_acceptance_per_position(exchange):
    metrics = exchange["metrics"]
    counts = {name: metrics[f"morion_spec_{name}_total"] for name in COUNTERS}  # all from the one request
    assert counts["verify_steps"] > 0 and 0 < counts["accepted_tokens"] <= counts["drafted_tokens"]
    # Each verify step gave the request its accepted drafts and one token of the target's own.
    assert counts["emitted_tokens"] == counts["accepted_tokens"] + counts["verify_steps"]
    drafted, accepted = (
        [metrics[f'morion_spec_{outcome}_by_position_total{{position="{p}"}}'] for p in range(1, WIDTH + 1)]
        for outcome in ("drafted", "accepted")
    )
    assert sum(drafted) == counts["drafted_tokens"] and sum(accepted) == counts["accepted_tokens"]
    assert all(a <= d for a, d in zip(accepted, drafted, strict=True)) and accepted[0] > 0
    assert not any('position="4"' in series for series in metrics)  # only the policy's widths
    assert metrics["morion_spec_enabled"] == 1 and metrics["morion_spec_active_width"] == WIDTH
    mean = counts["emitted_tokens"] / counts["verify_steps"]
    assert metrics["morion_spec_mean_accepted_length"] == pytest.approx(mean) and mean > 1


def test_without_speculation_the_series_read_zero(server, exchange):
    metrics = _metrics(server)
    assert metrics["morion_spec_enabled"] == 0 and metrics["morion_spec_active_width"] == 0
    assert all(metrics[f"morion_spec_{name}_total"] == 0 for name in COUNTERS)
    assert metrics["morion_spec_mean_accepted_length"] == 0
    assert not any(series.startswith("morion_spec_drafted_by_position") for series in metrics)


def test_server_info_names_the_method(server, spec_server, exchange):
    info = spec_server.server_info()
    assert info["features"]["speculative"] == {"method": "ngram", "policy": "fixed", "width": WIDTH}
    spec = info["load"]["spec"]
    assert spec["method"] == "ngram" and spec["max_width"] == WIDTH and spec["verify_steps"] > 0
    assert server.server_info()["features"]["speculative"] == {"method": "off", "policy": None, "width": None}
    assert server.server_info()["load"]["spec"] is None
    assert "speculative    ngram drafts, width 3" in spec_server.log()
