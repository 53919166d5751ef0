"""Grammar compilation is bounded (issue 21, item 1): one 112 KB schema of 3,000 required properties
drove the front end to 14 GB, and 1,000 properties took 32 s and 3.4 GB to compile. Now a schema past the
size limit is refused at once; one within it whose compilation passes the memory (or time) bound is
refused when it does, while the server's memory stays within that bound; structured output keeps working
afterwards. Every field a grammar can come from, on every route, meets the same bounds. On the shared
server (conftest.py: --grammar-memory-gb 0.25, --grammar-timeout 5)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from tests.server.conftest import GRAMMAR_MEMORY_GB

pytestmark = pytest.mark.slow

SLACK_BYTES = 128 * 2**20  # what else the server's processes allocate meanwhile, and the sampling's lag


def _schema(properties: int) -> dict:
    names = [f"property_{i}" for i in range(properties)]
    return {"type": "object", "properties": {n: {"type": "string"} for n in names}, "required": names}


def _chat(schema: dict) -> dict:
    return {
        "messages": [{"role": "user", "content": "Give me a JSON object."}],
        "max_tokens": 8,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema}},
    }


def _tree_rss(server) -> int:
    """Resident bytes of the server and its child processes (engine, grammar compiler)."""
    total = 0
    for pid in [server.process.pid, *server.child_pids()]:
        try:
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * 4096
        except OSError:
            continue  # a child that just ended
    return total


def test_a_schema_over_the_size_limit_is_refused_at_once(server):
    started = time.monotonic()
    with server.http() as http:
        response = http.post("/v1/chat/completions", json=_chat(_schema(3000)))
    assert time.monotonic() - started < 5
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "response_format.json_schema.schema"
    assert "over the limit of 65536 bytes" in error["message"]


HUGE = _schema(3000)  # about 100 KB of JSON
HELLO = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/chat/completions", {"messages": HELLO, "max_tokens": 2, "guided_json": HUGE}),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "structured_outputs": {"json": HUGE}}),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "guided_choice": ["a choice"] * 8000}),
        (
            "/v1/completions",
            {"prompt": "Hi", "max_tokens": 2, "ebnf": "root ::= " + '"a" | ' * 20000 + '"a"'},
        ),
        (
            "/v1/responses",
            {"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": HUGE}}},
        ),
        (
            "/v1/messages",
            {
                "max_tokens": 2,
                "messages": HELLO,
                "tools": [{"name": "f", "input_schema": HUGE}],
                "tool_choice": {"type": "any"},
            },
        ),
    ],
    ids=["guided_json", "structured_outputs", "guided_choice", "ebnf", "responses", "messages"],
)
def test_every_grammar_source_meets_the_size_bound(server, path, body):
    started = time.monotonic()
    with server.http() as http:
        response = http.post(path, json=body)
    assert time.monotonic() - started < 5
    assert response.status_code == 400, response.text
    assert "over the limit of 65536 bytes" in response.text


def test_a_schema_too_costly_to_compile_is_refused_within_the_memory_bound(server):
    small = {"type": "object", "properties": {"colour": {"type": "string"}}, "required": ["colour"]}
    with server.http() as http:
        assert http.post("/v1/chat/completions", json=_chat(small)).status_code == 200  # compiler started
        baseline = _tree_rss(server)
        peak = [baseline]
        watching = threading.Event()
        watching.set()

        def watch() -> None:
            while watching.is_set():
                peak[0] = max(peak[0], _tree_rss(server))
                time.sleep(0.01)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            costly = _chat(_schema(1000))  # 35 KB: under the size limit
            assert len(json.dumps(costly["response_format"]["json_schema"]["schema"])) < 65536
            response = http.post("/v1/chat/completions", json=costly)
        finally:
            watching.clear()
            watcher.join()
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "response_format.json_schema.schema"
        assert "--grammar-memory-gb" in error["message"] or "--grammar-timeout" in error["message"]
        growth = peak[0] - baseline
        assert growth <= GRAMMAR_MEMORY_GB * 2**30 + SLACK_BYTES, f"{growth / 2**20:.0f} MiB"
        # The next grammar gets a fresh compiler, and the answer follows its schema.
        sized = {"type": "object", "properties": {"size": {"type": "integer"}}, "required": ["size"]}
        again = http.post("/v1/chat/completions", json=_chat(sized))
    assert again.status_code == 200, again.text
    assert again.json()["choices"][0]["message"]["content"].startswith('{"size":')
