"""A conversation survives a server restart: the second `morion serve` on the same disk cache restores the
prompt's prefix from disk, reports it as cached, counts it in /metrics, and answers exactly as cold."""

from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.slow

MESSAGES = [
    {"role": "system", "content": "You are a terse assistant. Answer in one short sentence."},
    {
        "role": "user",
        "content": "Here is a list of fruits: apple, banana, cherry, damson, elderberry, fig, grape, "
        "honeydew, kiwi, lemon, mango, nectarine, orange, papaya. Which fruit comes after fig?",
    },
]


def _ask(server) -> tuple[str, int, int]:
    with server.openai() as client:
        reply = client.chat.completions.create(
            model="smollm2", messages=MESSAGES, max_tokens=24, temperature=0
        )
    details = reply.usage.prompt_tokens_details
    return (
        reply.choices[0].message.content,
        reply.usage.prompt_tokens,
        details.cached_tokens if details else 0,
    )


def _metric(server, name: str, labels: str = "") -> float:
    series = f"{name}{{{labels}}}" if labels else name
    with server.http() as http:
        text = http.get("/metrics").text
    match = re.search(rf"^{re.escape(series)} (\S+)$", text, re.MULTILINE)
    assert match, f"{series} not in /metrics:\n{text}"
    return float(match.group(1))


def test_a_restarted_server_restores_the_conversation_from_disk(server_control, tmp_path):
    args = [
        "--device", "cpu", "--kv-cache-tokens", "4096", "--max-model-len", "1024",
        "--host-cache-gb", "0.25", "--disk-cache-dir", str(tmp_path / "disk"),
        "--served-model-name", "smollm2",
    ]  # fmt: skip
    first = server_control.start(args, tmp_path / "first.log")
    try:
        cold_text, prompt_tokens, cold_cached = _ask(first)
    finally:
        assert server_control.stop(first) == 0, first.log()
    assert cold_cached == 0
    assert prompt_tokens > 64  # several pages of 16 tokens to restore

    second = server_control.start(args, tmp_path / "second.log")
    try:
        assert "disk cache" in second.log() and "SKIPPED" not in second.log()
        restored_text, _, restored_cached = _ask(second)
        # Whole pages up to the last page boundary before the final prompt token.
        assert restored_cached == (prompt_tokens - 1) // 16 * 16
        assert restored_text == cold_text
        assert _metric(second, "morion_cache_hits_total", 'tier="disk"') == 1
        assert _metric(second, "morion_cache_hit_tokens_total", 'tier="disk"') == restored_cached
        assert _metric(second, "morion_cache_bytes_moved_total", 'direction="disk_to_host"') > 0
        assert _metric(second, "morion_cache_checksum_failures_total") == 0
    finally:
        assert server_control.stop(second) == 0, second.log()
